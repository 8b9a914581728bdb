"""scripts/gpu_check.sh on a host without a GPU: the whole GPU verification runs end to end as a smoke check
(a tiny model, small batches), says that the GPU parts were skipped, and writes its summary, the tests' XML,
decode.json and offline.json. On a GPU the same script is what a lent machine runs (docs/BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run; a GPU host runs the real check")
def test_gpu_check_runs_end_to_end_on_a_cpu_and_says_the_gpu_parts_were_skipped(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH")}
    env["PYTHON"] = sys.executable
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path), "--budget", "600"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the GPU parts are skipped" in proc.stdout
    assert "no CUDA device (the GPU parts were skipped" in proc.stdout  # the closing table says it too
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["cuda"] is False
    stages = summary["stages"]
    assert {name: stage["status"] for name, stage in stages.items()} == dict.fromkeys(
        ("env", "tests", "checkpoint", "quantized", "speculative", "lora", "prefix", "host", "decode", "offline"),
        "ok")
    counts = stages["tests"]["counts"]
    assert counts["skipped"] > 0 and counts["passed"] == counts["failed"] == counts["errors"] == 0
    decode = json.loads((tmp_path / "decode.json").read_text())
    assert decode["complete"] and decode["systems"] == ["orca-batched", "transformers"]
    for row in decode["runs"]:  # both systems ran every batch size; tokens compared across processes
        assert all(row[system]["decode_tokens_per_second"] > 0 for system in decode["systems"])
        assert 0 <= row["orca-batched"]["same_tokens_as_transformers"] <= row["batch"]
    offline = json.loads((tmp_path / "offline.json").read_text())
    assert offline["orca"]["tokens_per_second"] > 0 and offline["attention_backend"] == "batched"
    assert stages["offline"]["summary"]["breakdown_fraction"]
    # the feature stages: quantized weights' decode, speculative decoding (n-gram and a layer draft), LoRA
    assert [row["batch"] for row in stages["quantized"]["kinds"]["int8"]["table"]] == [1, 4]
    kv = json.loads((tmp_path / "quantized-kv-int8.json").read_text())  # float weights over an int8 pool
    assert (kv["quantization"], kv["kv_cache_dtype"]) == ("none", "int8") and kv["systems"] == ["orca-batched"]
    random = stages["speculative"]["backends"]["auto"]["summary"]["random"]
    assert set(random["tokens_per_second"]) == {"off", "ngram", "draft"}
    assert set(random["same_tokens_as_off"]) == {"ngram", "draft"}
    lora = stages["lora"]["backends"]["auto"]["summary"]
    assert set(lora["ratio_to_base"]) == {"base", "1", "2"} and lora["base_same_tokens_as_lora_off"]["requests"] == 4
    prefix = stages["prefix"]["backends"]["auto"]["summary"]
    assert set(prefix) == {"shared-prefix", "multi-turn"}
    assert all(w["prefix_cache_on"]["hits"] > 0 for w in prefix.values())
    host = stages["host"]["summary"]  # where a decode iteration's time goes, per batch size
    assert [(row["system"], row["batch"]) for row in host] == [("orca-batched", 1), ("orca-batched", 4)]
    assert all(row["step_ms"] > 0 and row["phases_ms"]["model"] > 0 for row in host)
    for name in ("quantized-int8.json", "quantized-int4.json", "speculative-auto.json", "lora-auto.json",
                 "prefix-auto.json", "host.json"):
        assert (tmp_path / name).is_file()


def test_the_quantized_table_keeps_a_run_that_measured_no_rate() -> None:
    """A decode run whose n-token generation took no longer than its 1-token one has no rate (None in its
    JSON): the quantized stage's table says so for that batch size instead of failing the whole check."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    result = {"runs": [
        {"batch": 1, "roofline_tokens_per_second": 1000.4,
         "orca-batched": {"decode_tokens_per_second": None, "fraction_of_roofline": None}},
        {"batch": 4, "roofline_tokens_per_second": 2000.0,
         "orca-batched": {"decode_tokens_per_second": 500.2, "fraction_of_roofline": 0.2501}},
    ]}
    assert gpu_check.quantized_table(result, "orca-batched") == {"table": [
        {"batch": 1, "tokens_per_second": None, "roofline": 1000, "%roofline": None},
        {"batch": 4, "tokens_per_second": 500, "roofline": 2000, "%roofline": 25.0},
    ]}
