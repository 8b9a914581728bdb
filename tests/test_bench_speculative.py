"""orca-bench speculative (client/orca_client/bench/speculative.py): its workloads, and the command end to end
on the tiny Llama (no tokenizer: the text's bytes as token ids), speculation off alone and n-gram against off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _fixtures import (
    one_torch_thread,  # noqa: F401 - autouse: one torch thread
    tiny_checkpoint,
)
from orca_client import bench as orca_bench
from orca_client.bench import speculative

VOCAB = 197  # the tiny Llama's


def test_repetitive_prompts_are_passages_of_real_text_behind_an_instruction() -> None:
    prompter = speculative.Prompter(None, VOCAB)
    assert prompter.kind == "utf-8 bytes" and not prompter.chat
    texts = speculative.passages(prompter.count, 100, 250, 12)
    assert len(texts) == 12 and len(set(texts)) == 12
    assert all(100 <= len(t.encode()) <= 250 + 2 * t.count("\n\n") for t in texts)
    assert not any("****" in t for t in texts)  # the topics' titles are left out
    assert "assert" in texts[0]  # the topics in sorted order: "assert" first, one passage per topic in turn
    prompts = speculative.repetitive_prompts(prompter, 4, (100, 250))
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        assert prompt == [b % VOCAB for b in (speculative.INSTRUCTIONS[i % 2] + text).encode()]
    with pytest.raises(ValueError, match="passages"):
        speculative.repetitive_prompts(prompter, 10_000, (100, 250))


def test_repetitive_prompts_through_the_chat_template() -> None:
    """SmolLM2's chat template (the default model's): the instruction and the passage in the user turn."""
    from orca.checkpoint import resolve_checkpoint
    from orca.frontend.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_checkpoint(None))
    prompter = speculative.Prompter(tokenizer, tokenizer.hf.vocab_size)
    assert prompter.chat and prompter.kind == "chat template"
    prompts = speculative.repetitive_prompts(prompter, 3, (100, 250))
    text = tokenizer.hf.decode(prompts[1])
    assert "<|im_start|>user\n" + speculative.INSTRUCTIONS[1] in text and text.endswith("<|im_start|>assistant\n")
    passage = speculative.passages(prompter.count, 100, 250, 2)[1]
    assert passage in text and 100 <= prompter.count(passage) <= 250 + 2 * passage.count("\n\n")


def test_same_tokens_counts_the_identical_requests_and_says_where_the_others_differ() -> None:
    same = speculative._same([[1, 2, 3], [4, 5, 6], [7, 8]], [[1, 2, 3], [4, 9, 6], [7, 8, 9]])
    assert same == {"equal": 1, "requests": 3, "first_differences": [{"request": 1, "position": 1},
                                                                   {"request": 2, "position": 2}]}


def test_random_prompts_are_the_offline_benchmarks() -> None:
    from orca_client.trace import PRESETS, make_trace

    prompts = speculative.random_prompts(5, (32, 128), VOCAB, 3)
    spec = PRESETS["offline"].with_options(num_requests=5, token_ids=(100, VOCAB), seed=3)
    assert prompts == [list(r.prompt_token_ids) for r in make_trace(spec, None)]
    assert all(32 <= len(p) <= 128 and 100 <= min(p) and max(p) < VOCAB for p in prompts)


def run_bench(tmp_path: Path, *options: str, workloads: tuple[str, ...] = ("repetitive", "random"),
              repeats: int = 1) -> dict[str, Any]:
    """The command on the tiny Llama (128 positions: prompts of at most about 100 tokens, 16 new ones),
    3 streams, 2 single-stream prompts; checks what every run reports."""
    out = tmp_path / "speculative.json"
    argv = ["speculative", "--model", str(tiny_checkpoint("llama")), "--max-tokens", "16", "--streams", "3",
            "--single-prompts", "2", "--repeats", str(repeats), "--passage-tokens", "16:40", "--random-prompt-len",
            "8:24", "--torch-compile", "off", "--workload", ",".join(workloads), "--json", str(out), *options]
    assert orca_bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "speculative" and "machine" in result and result["prompts"] == "utf-8 bytes"
    assert list(result["workloads"]) == list(workloads)
    for workload in result["workloads"].values():
        assert workload["spec"]["requests"] == 3 and workload["spec"]["single_prompts"] == 2
        for run in workload["methods"].values():
            streams, single = run["streams"], run["single"]
            assert streams["generated_tokens"] == 3 * 16 and streams["tokens_per_second"] > 0
            assert streams["iterations"] >= 1
            assert single["prompts"] == 2 and single["decode_tokens_per_second"] > 0
            assert single["tokens_per_second"] > 0
            for record in single["per_prompt"]:
                assert record["max_tokens"] == 16 and len(record["seconds"]) == repeats and "tokens" not in record
    return result


def test_speculation_off_alone(tmp_path: Path) -> None:
    result = run_bench(tmp_path, "--methods", "off", workloads=("random",), repeats=2)
    assert result["options"]["methods"] == ["off"]
    workload = result["workloads"]["random"]
    assert set(workload["methods"]) == {"off"} and "ratios_to_off" not in workload
    off = workload["methods"]["off"]
    assert off["speculative_method"] == "off"
    for run in ("streams", "single"):
        spec = off[run]["speculation"]
        assert spec["proposed_tokens"] == spec["accepted_tokens"] == 0 and spec["acceptance_rate"] is None


def test_bad_options_are_errors_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = str(tiny_checkpoint("llama"))
    assert orca_bench.main(["speculative", "--model", model, "--methods", "medusa"]) == 2
    assert "unknown method 'medusa'" in capsys.readouterr().err
    assert orca_bench.main(["speculative", "--model", model, "--prompt-lookup-min", "5"]) == 2
    assert "prompt_lookup_min 5 exceeds prompt_lookup_max 4" in capsys.readouterr().err


@pytest.mark.parametrize(("options", "workloads"), [
    ((), ("repetitive", "random")),
    # Sampled: the tiny model's draws at 0.8 rarely follow a lookup; cooler, and n-grams from one token, some do.
    (("--sampling", "seeded", "--temperature", "0.3", "--seed", "1", "--prompt-lookup-min", "1"), ("repetitive",)),
], ids=["greedy", "seeded"])
def test_ngram_against_off(tmp_path: Path, options: tuple[str, ...], workloads: tuple[str, ...]) -> None:
    """Both methods: speculation changes no token of any request (greedy and seeded), the counters add up,
    and the repetitive workload, built to copy its prompt, gets proposals and accepts some of them."""
    result = run_bench(tmp_path, *options, workloads=workloads)
    assert result["options"]["methods"] == ["off", "ngram"]
    assert result["options"]["sampling"] == ("seeded" if options else "greedy")
    for name, workload in result["workloads"].items():
        assert set(workload["methods"]) == {"off", "ngram"}
        assert workload["methods"]["ngram"]["speculative_method"] == "ngram"
        same = workload["same_tokens_as_off"]["ngram"]
        assert same == {"streams": {"equal": 3, "requests": 3, "first_differences": []},
                        "single": {"equal": 2, "requests": 2, "first_differences": []}}, name
        ratios = workload["ratios_to_off"]["ngram"]
        assert ratios["streams"] > 0 and ratios["single"] > 0
        for run in ("streams", "single"):
            assert workload["methods"]["off"][run]["speculation"]["proposed_tokens"] == 0
            spec = workload["methods"]["ngram"][run]["speculation"]
            assert 0 <= spec["accepted_tokens"] <= spec["proposed_tokens"]
            assert spec["verifications"] <= spec["proposed_tokens"]
            if spec["proposed_tokens"]:
                assert 0 <= spec["acceptance_rate"] <= 1 and spec["verifications"] >= 1
                assert 1 <= spec["mean_tokens_per_verification"] <= 1 + result["options"]["num_speculative_tokens"]
    repetitive = result["workloads"]["repetitive"]["methods"]["ngram"]
    assert repetitive["streams"]["speculation"]["proposed_tokens"] > 0
    assert sum(repetitive[run]["speculation"]["accepted_tokens"] for run in ("streams", "single")) > 0
