"""scripts/variant_repository.py: copies of orca_gpt that differ only in the parameters given, which the
engine's own config reader accepts."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from orca import EngineConfig

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "variant_repository.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("variant_repository", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parameters(config: Path) -> dict[str, str]:
    return dict(re.findall(r'parameters \{ key: "([^"]+)" value: \{ string_value: "([^"]*)" \} \}', config.read_text()))


def test_variants_override_only_the_parameters_given(tmp_path: Path) -> None:
    script = _load_script()
    assert script.main([str(tmp_path), "plain:", "chunked:max_num_batched_tokens=64,kv_admission=reserve"]) == 0
    plain = _parameters(tmp_path / "plain" / "config.pbtxt")
    chunked = _parameters(tmp_path / "chunked" / "config.pbtxt")
    assert plain == _parameters(script.SOURCE / "config.pbtxt")
    assert chunked == {**plain, "max_num_batched_tokens": "64", "kv_admission": "reserve"}
    assert 'name: "chunked"' in (tmp_path / "chunked" / "config.pbtxt").read_text()
    assert (tmp_path / "chunked" / "1" / "model.py").is_file()
    engine = {k: v for k, v in chunked.items() if k != "REPORT_CUSTOM_METRICS"}  # orca_gpt's, not the engine's
    cfg = EngineConfig.from_parameters(engine)
    assert (cfg.max_num_batched_tokens, cfg.kv_admission) == (64, "reserve")
    assert script.main([str(tmp_path / "x"), "no-colon"]) == 2
