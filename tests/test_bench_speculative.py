"""orca-bench speculative (client/orca_client/bench/speculative.py): its workloads, and the command end to end
on the tiny Llama (no tokenizer: the text's bytes as token ids), speculation off alone, n-gram against off and
a draft of the model's first layers against off; the draft's maker (orca_client.bench.decode.build_layer_draft)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _fixtures import (
    one_torch_thread,  # noqa: F401 - autouse: one torch thread
    tiny_checkpoint,
)
from checkpoints import make_llama
from orca_client import bench as orca_bench
from orca_client.bench import decode, speculative

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
              repeats: int = 1, max_tokens: int = 16, streams: int = 3, single_prompts: int = 2) -> dict[str, Any]:
    """The command on the tiny Llama (128 positions: prompts of at most about 100 tokens, 16 new ones),
    3 streams, 2 single-stream prompts (unless told); checks what every run reports."""
    out = tmp_path / "speculative.json"
    argv = ["speculative", "--model", str(tiny_checkpoint("llama")), "--max-tokens", str(max_tokens), "--streams",
            str(streams), "--single-prompts", str(single_prompts), "--repeats", str(repeats), "--passage-tokens",
            "16:40", "--random-prompt-len", "8:24", "--torch-compile", "off", "--workload", ",".join(workloads),
            "--json", str(out), *options]
    assert orca_bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "speculative" and "machine" in result and result["prompts"] == "utf-8 bytes"
    assert list(result["workloads"]) == list(workloads)
    for workload in result["workloads"].values():
        assert workload["spec"]["requests"] == streams and workload["spec"]["single_prompts"] == single_prompts
        for run in workload["methods"].values():
            streams_run, single = run["streams"], run["single"]
            assert streams_run["generated_tokens"] == streams * max_tokens and streams_run["tokens_per_second"] > 0
            assert streams_run["iterations"] >= 1
            assert single["prompts"] == single_prompts and single["decode_tokens_per_second"] > 0
            assert single["tokens_per_second"] > 0
            for record in single["per_prompt"]:
                assert record["max_tokens"] == max_tokens and len(record["seconds"]) == repeats
                assert "tokens" not in record
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
    and the repetitive workload, built to copy its prompt, gets proposals and accepts some of them (its 3
    streams too: speculation never disabled by the batch here)."""
    result = run_bench(tmp_path, *options, "--speculative-disable-by-batch-size", "1024", workloads=workloads)
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
            _check_counters(workload["methods"]["ngram"][run]["speculation"], result)
    repetitive = result["workloads"]["repetitive"]["methods"]["ngram"]
    assert repetitive["streams"]["speculation"]["proposed_tokens"] > 0
    assert sum(repetitive[run]["speculation"]["accepted_tokens"] for run in ("streams", "single")) > 0


def _check_counters(spec: dict, result: dict) -> None:
    """A speculating run's counters agree with each other: no more accepted or verifying iterations than
    proposed tokens, and where any were proposed, a rate in [0, 1] and 1 to k + 1 tokens per verification."""
    assert 0 <= spec["accepted_tokens"] <= spec["proposed_tokens"]
    assert spec["verifications"] <= spec["proposed_tokens"]
    if spec["proposed_tokens"]:
        assert 0 <= spec["acceptance_rate"] <= 1 and spec["verifications"] >= 1
        assert 1 <= spec["mean_tokens_per_verification"] <= 1 + result["options"]["num_speculative_tokens"]


@pytest.mark.parametrize("layers", [1, 3])
def test_draft_of_the_models_first_layers_against_off(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch, layers: int) -> None:
    """--methods off,draft --draft-layers N: the draft is built from the tiny Llama's first N of its 3 layers in
    a temporary directory (gone afterwards), its engine proposes and the figures are reported as ngram's are;
    greedy, its tokens are off's (float32: the dtype where verification is exact on the CPU, README.md). A draft
    of all 3 layers is the model itself: it proposes what the model draws, and every proposal is accepted."""
    built: list[Path] = []
    build = decode.build_layer_draft

    def recording_build(checkpoint: Path, n: int, path: Path) -> Path:
        built.append(path)
        return build(checkpoint, n, path)

    monkeypatch.setattr(decode, "build_layer_draft", recording_build)
    result = run_bench(tmp_path, "--methods", "off,draft", "--draft-layers", str(layers), "--dtype", "float32",
                       "--speculative-disable-by-batch-size", "1024",
                       max_tokens=8, streams=2, single_prompts=1)
    assert len(built) == 1 and not built[0].parent.exists()  # the temporary directory is removed
    assert result["options"]["methods"] == ["off", "draft"] and result["options"]["draft_layers"] == layers
    assert result["options"]["speculative_model"] is None
    assert result["draft"] == {"checkpoint": None, "layers": layers, "of_layers": 3}
    for name, workload in result["workloads"].items():
        assert workload["methods"]["draft"]["speculative_method"] == "draft"
        assert workload["same_tokens_as_off"]["draft"] == {
            "streams": {"equal": 2, "requests": 2, "first_differences": []},
            "single": {"equal": 1, "requests": 1, "first_differences": []}}, name
        ratios = workload["ratios_to_off"]["draft"]
        assert ratios["streams"] > 0 and ratios["single"] > 0
        for run in ("streams", "single"):
            assert workload["methods"]["off"][run]["speculation"]["proposed_tokens"] == 0
            spec = workload["methods"]["draft"][run]["speculation"]
            assert spec["proposed_tokens"] > 0 and spec["verifications"] >= 1, (name, run)
            _check_counters(spec, result)
            if layers == 3:
                assert spec["acceptance_rate"] == 1.0, (name, run)
    out = capsys.readouterr().out
    assert f"draft: up to 4 tokens per proposal by the model's first {layers} of 3 layers" in out
    assert "draft/off" in out and "ngram" not in out and "tokens differ" not in out


def test_draft_options_are_errors_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def no_work(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the bench ran")

    monkeypatch.setattr(speculative, "run_workload", no_work)
    monkeypatch.setattr(decode, "build_layer_draft", no_work)
    model = str(tiny_checkpoint("llama"))
    cases = [
        (["--methods", "off,draft"], "--methods draft needs a draft model: --speculative-model PATH"),
        (["--speculative-model", model], "--speculative-model is for the draft method, which --methods (off,ngram) "
                                         "does not run"),
        (["--methods", "off", "--draft-layers", "1"], "--draft-layers is for the draft method"),
        (["--methods", "draft", "--speculative-model", model, "--draft-layers", "1"],
         "give --speculative-model or --draft-layers, not both"),
        (["--methods", "draft", "--speculative-model", str(tmp_path / "none")], "no such checkpoint"),
    ]
    for options, message in cases:
        assert orca_bench.main(["speculative", "--model", model, *options]) == 2, options
        assert message in capsys.readouterr().err, options
    gguf = str(tmp_path / "model.gguf")
    assert orca_bench.main(["speculative", "--model", gguf, "--methods", "off,draft", "--draft-layers", "1"]) == 2
    assert f"--model {gguf} is a .gguf file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        orca_bench.main(["speculative", "--model", model, "--methods", "draft", "--draft-layers", "0"])
    assert "argument --draft-layers: must be > 0" in capsys.readouterr().err


def test_build_layer_draft_keeps_the_first_layers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    checkpoint = tiny_checkpoint("llama")
    draft = decode.build_layer_draft(checkpoint, 2, tmp_path / "draft")
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    loaded = AutoModelForCausalLM.from_pretrained(draft)
    assert loaded.config.num_hidden_layers == len(loaded.model.layers) == 2
    assert loaded.config.vocab_size == model.config.vocab_size == VOCAB and loaded.dtype == model.dtype
    kept = loaded.state_dict()
    assert all(torch.equal(kept[name], value) for name, value in model.state_dict().items()
               if not name.startswith("model.layers.2."))
    assert not any(name.startswith("model.layers.2.") for name in kept)
    with pytest.raises(ValueError, match="has 3 decoder layers"):
        decode.build_layer_draft(checkpoint, 4, tmp_path / "too-deep")


def test_a_one_layer_draft_of_a_one_layer_model_is_the_model(tmp_path: Path) -> None:
    """All the layers kept: the same logits; the checkpoint's tokenizer files are copied beside it."""
    from transformers import AutoModelForCausalLM

    checkpoint = make_llama(tmp_path / "one-layer", num_hidden_layers=1)
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
    for name in tokenizer_files:
        (checkpoint / name).write_text(f"{name}\n")
    draft = decode.build_layer_draft(checkpoint, 1, tmp_path / "draft")
    assert all((draft / name).read_text() == f"{name}\n" for name in tokenizer_files)
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    loaded = AutoModelForCausalLM.from_pretrained(draft).eval()
    assert loaded.config.num_hidden_layers == 1 and loaded.config.vocab_size == VOCAB
    tokens = torch.tensor([[1, 5, 42, 7, 196, 100, 3]])
    with torch.inference_mode():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
