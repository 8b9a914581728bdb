"""EngineConfig.from_parameters: how both Triton models read their config.pbtxt parameters."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from orca import EngineConfig

REPO_ROOT = Path(__file__).resolve().parent.parent


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


def shipped_parameters(model: str) -> dict[str, str]:
    text = (REPO_ROOT / "model_repository" / model / "config.pbtxt").read_text()
    return dict(re.findall(r'^parameters \{ key: "(\w+)" value: \{ string_value: "([^"]*)" \} \}', text, re.M))


def test_orca_gpt_ships_every_settable_option_at_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """config.pbtxt lists the options one would tune, each at EngineConfig's default, so that reading it
    and the dataclass tell the same story."""
    monkeypatch.delenv("ORCA_MODEL", raising=False)
    raw = shipped_parameters("orca_gpt")
    # a model parameter (vllm_backend's switch for the vllm:* metrics), which orca_gpt reads, not the engine
    assert raw.pop("REPORT_CUSTOM_METRICS") == "true"
    assert EngineConfig.from_parameters(raw) == EngineConfig()
    not_shipped = {"seed"}  # sampling seeds are per request
    assert set(raw) == {f.name for f in fields(EngineConfig)} - not_shipped


def test_control_address_takes_its_host_from_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """"$POD_IP:29600": one config file for every pod, each driver bound to its own address."""
    monkeypatch.setenv("POD_IP", "10.4.0.17")
    assert EngineConfig(control_address="$POD_IP:29600").control_address == "10.4.0.17:29600"
    assert EngineConfig(control_address="${POD_IP}:0").control_address == "10.4.0.17:0"
    monkeypatch.delenv("POD_IP")
    with pytest.raises(ValueError, match=r"names the environment variable POD_IP, which is not set"):
        EngineConfig(control_address="$POD_IP:29600")
    with pytest.raises(ValueError, match=r"must be host:port or \$VARIABLE:port, got '\$:29600'"):
        EngineConfig(control_address="$:29600")
    monkeypatch.setenv("POD_IP", "10.4.0.17")
    with pytest.raises(ValueError, match="control_address must be host:port"):
        EngineConfig(control_address="$POD_IP:port")
