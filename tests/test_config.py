"""EngineConfig.from_parameters: how both Triton models read their config.pbtxt parameters."""

from __future__ import annotations

import pytest

from orca import EngineConfig


def test_strings_become_typed_options_and_empty_means_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCA_MODEL", raising=False)
    cfg = EngineConfig.from_parameters({"max_bs": "8", "n_slots": "", "dtype": "float32", "model": " "})
    assert (cfg.max_bs, cfg.n_slots, cfg.dtype, cfg.model) == (8, None, "float32", None)


def test_orca_model_fills_an_empty_model_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCA_MODEL", "/from/env")
    assert EngineConfig.from_parameters({"model": ""}).model == "/from/env"
    assert EngineConfig.from_parameters({"model": "/explicit"}).model == "/explicit"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"max_bss": "8"}, "unknown parameter 'max_bss'; allowed: model, device"),
        ({"max_bs": "eight"}, "parameter max_bs must be an integer, got 'eight'"),
        ({"max_bs": "0"}, "max_bs must be an integer >= 1"),
        ({"dtype": "float64"}, "dtype must be auto or one of"),
    ],
)
def test_bad_parameters_say_what_is_wrong(raw: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_parameters(raw)


def test_fixed_and_not_settable_options() -> None:
    cfg = EngineConfig.from_parameters({"n_slots": "64"}, fixed={"max_bs": 4}, not_settable={"max_queue": "why"})
    assert (cfg.max_bs, cfg.n_slots) == (4, 64)
    with pytest.raises(ValueError, match="parameter 'max_queue' cannot be set here: why"):
        EngineConfig.from_parameters({"max_queue": "3"}, not_settable={"max_queue": "why"})
    with pytest.raises(ValueError, match="unknown parameter 'max_bs'"):  # fixed by the caller
        EngineConfig.from_parameters({"max_bs": "3"}, fixed={"max_bs": 4})
