"""orca-bench lora (client/orca_client/bench/lora.py): its option parsing and load-time split, and the
command end to end on the tiny Llama (no tokenizer: the text's bytes as token ids)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _fixtures import (
    one_torch_thread,  # noqa: F401 - autouse: one torch thread
    tiny_checkpoint,
)
from orca_client import bench as orca_bench
from orca_client.bench import lora


def test_adapter_counts_are_sorted_distinct_positive_integers() -> None:
    assert lora.adapter_counts("16,1, 4,4,") == [1, 4, 16]
    for bad in ("0", "a", "1,-2", " , "):
        with pytest.raises(ValueError, match="adapter count"):
            lora.adapter_counts(bad)


def test_summarize_takes_the_median_round_and_every_load() -> None:
    rounds = [{"tokens_per_second": t, "seconds": 1 / t, "adapter_loads": 1} for t in (3.0, 1.0, 2.0)]
    summary = lora.summarize(rounds)
    assert summary["tokens_per_second"] == 2.0 and summary["seconds"] == 0.5 and summary["adapter_loads"] == 3
    assert summary["rounds_tokens_per_second"] == [3.0, 1.0, 2.0]
    assert lora.summarize(rounds[:2])["tokens_per_second"] == 1.0  # an even count: the lower middle


def test_load_times_split_first_loads_from_reloads() -> None:
    times = lora.load_times([("a", 0.010), ("b", 0.012), ("a", 0.001), ("b", 0.002), ("a", 0.003)])
    assert times["first_loads"] == 2 and times["reloads"] == 3
    assert times["first_load_median_ms"] == pytest.approx(11.0)
    assert times["reload_median_ms"] == pytest.approx(2.0)
    assert lora.load_times([])["first_load_median_ms"] is None


def test_lora_bench_on_the_tiny_llama(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lora.json"
    argv = ["lora", "--model", str(tiny_checkpoint("llama")), "--adapters", "1,3", "--requests", "6",
            "--max-tokens", "6", "--prompt-tokens", "16:40", "--rank", "4", "--repeats", "2", "--load-rounds", "2",
            "--torch-compile", "off", "--json", str(out)]
    assert orca_bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "3 adapters, round-robin" in printed and "enable_lora off" in printed and "torch " in printed
    result = json.loads(out.read_text())
    assert result["benchmark"] == "lora" and result["prompts"] == "utf-8 bytes"
    assert {"cpu", "cores", "cpu_flags", "date"} <= set(result["machine"]) and result["torch"]
    assert result["options"]["adapters"] == [1, 3] and result["options"]["max_loras"] == 3
    assert result["adapters"]["made"] == 3 and result["adapters"]["target_modules"] == ["q_proj", "v_proj"]
    assert len(result["spec"]["prompt_tokens"]) == 6
    runs = result["lora"]["runs"]
    assert list(runs) == ["base", "1", "3"] and result["lora"]["max_loras"] == 3
    for name, run in [*runs.items(), ("off", result["lora_off"])]:
        assert run["requests"] == 6 and run["generated_tokens"] == 6 * 6, name
        assert run["tokens_per_second"] > 0 and run["ratio_to_base"] > 0 and run["iterations"] >= 6, name
        assert len(run["rounds_tokens_per_second"]) == 2 and run["tokens_per_second"] in run["rounds_tokens_per_second"]
    assert runs["base"]["ratio_to_base"] == 1.0
    assert [runs[k]["adapters"] for k in runs] == [0, 1, 3] and result["lora_off"]["adapters"] == 0
    # The warm-up put every adapter in its slot, so the timed runs load none (max_loras = the largest count).
    assert all(run["adapter_loads"] == 0 for run in runs.values())
    assert result["lora_engine_loads"]["first_loads"] == 3 and result["lora_engine_loads"]["reloads"] == 0
    assert result["base_same_tokens_as_lora_off"] == {"equal": 6, "requests": 6}
    load = result["load"]  # max_loras 1, two adapters in turn, two rounds: each request evicts the other
    assert load["first_loads"] == 2 and load["reloads"] == 2 and len(load["loads"]) == 4
    assert load["first_load_median_ms"] > 0 and load["reload_median_ms"] > 0


def test_fewer_slots_than_adapters_reload_them(tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    argv = ["lora", "--model", str(tiny_checkpoint("llama")), "--adapters", "4", "--max-loras", "2",
            "--requests", "4", "--max-tokens", "3", "--prompt-tokens", "16:40", "--max-bs", "2", "--rank", "4",
            "--load-rounds", "0", "--torch-compile", "off", "--json", str(out)]
    assert orca_bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["load"] is None and result["lora"]["max_loras"] == 2
    assert result["lora"]["runs"]["4"]["adapter_loads"] >= 2
    assert result["lora_engine_loads"]["reloads"] >= 2


def test_bad_options_are_errors_before_any_work(capsys: pytest.CaptureFixture[str]) -> None:
    model = str(tiny_checkpoint("llama"))
    assert orca_bench.main(["lora", "--model", model, "--adapters", "0,4"]) == 2
    assert "'0' is not one" in capsys.readouterr().err
    assert orca_bench.main(["lora", "--model", model, "--adapters", "100"]) == 2
    assert "max_loras" in capsys.readouterr().err
