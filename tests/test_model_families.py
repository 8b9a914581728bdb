"""The families served by the Llama-style decoder besides Llama itself, each against transformers on a
tiny random checkpoint built with transformers' own classes (tests/checkpoints.py), with the family's
special options on: Llama 3.x rotary scaling (llama3, and linear / yarn), Mistral's sliding window, Qwen2's
q/k/v biases and per-layer sliding windows, Qwen3's q/k norms and head_dim of its own, and the mixtures of
experts Mixtral (top-2 of 4, renormalised, sliding window) and Qwen3-MoE (top-2 of 4, not renormalised,
one dense layer).

For each: an iteration mixing prompts and increments gives every request transformers' logits (fp32,
1e-4), and 16 requests joining at different iterations, through a small paged pool under on_demand
admission (preemptions) with chunked prefill, generate exactly transformers' greedy tokens."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from _fixtures import _root, hf_greedy, hf_last_logits, record_logits
from checkpoints import (
    make_llama,
    make_llama3,
    make_mistral,
    make_mixtral,
    make_qwen2,
    make_qwen3,
    make_qwen3_moe,
    write_gguf,
)
from transformers import AutoModelForCausalLM

from orca import LLM, EngineConfig, LLMEngine, SamplingParams

ATOL = 1e-4
BUILDERS: dict[str, Any] = {
    "llama3-rope": make_llama3,
    "llama-linear-rope": functools.partial(
        make_llama, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    ),
    "llama-yarn-rope": functools.partial(
        make_llama,
        rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0
        },
    ),
    "mistral-sliding-window": make_mistral,
    "qwen2-bias-sliding-window": make_qwen2,
    "qwen3-qk-norm": make_qwen3,
    "mixtral-moe-top2": make_mixtral,
    "qwen3-moe-top2-dense-layer": make_qwen3_moe,
}


@functools.cache
def checkpoint(name: str) -> Path:
    return BUILDERS[name](_root() / name)


@functools.cache
def reference(name: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(checkpoint(name), dtype=torch.float32).eval()


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(0, 190) for _ in range(length)]


@pytest.mark.parametrize("name", list(BUILDERS))
def test_mixed_iteration_matches_transformers(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two prompts start; two iterations later two more join the two in increment: an iteration of 2
    prompts + 2 increments at different positions, then increments only. Every logits row of every
    iteration equals transformers' for that request alone."""
    engine = LLMEngine(EngineConfig(model=str(checkpoint(name)), max_bs=4))
    ref = reference(name)
    rng = random.Random(2)
    prompts = [random_prompt(rng, n) for n in (12, 20, 3, 9)]  # longer than the sliding windows (6, 8)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    captured = record_logits(engine, monkeypatch)
    generated: list[list[int]] = [[] for _ in prompts]
    joins = {0: (0, 1), 2: (2, 3)}
    for iteration in range(8):
        for i in joins.get(iteration, ()):
            engine.add_request(str(i), prompts[i], greedy)
        before = [list(g) for g in generated]
        outputs = engine.step()
        if iteration == 2:
            assert (engine.last_iteration.num_initiation, engine.last_iteration.batch_size) == (2, 4)
        for out in outputs:
            i = int(out.request_id)
            expected = hf_last_logits(ref, prompts[i] + before[i])
            torch.testing.assert_close(captured[-1][out.request_id], expected, atol=ATOL, rtol=0)
            generated[i].extend(out.new_token_ids)
    assert all(len(g) == 8 for g in generated[:2]) and all(len(g) == 6 for g in generated[2:])


@pytest.mark.parametrize("name", list(BUILDERS))
def test_interleaved_requests_through_the_block_pool_generate_transformers_greedy_tokens(name: str) -> None:
    engine = LLMEngine(
        EngineConfig(
            model=str(checkpoint(name)), max_bs=5, n_slots=48, block_size=4, kv_admission="on_demand",
            max_num_batched_tokens=8,
        )
    )
    rng = random.Random(0)
    specs = [(random_prompt(rng, rng.randint(1, 24)), rng.randint(1, 20)) for _ in range(16)]
    join_at = sorted(rng.randint(0, 20) for _ in specs)
    final: dict[str, list[int]] = {}
    iteration = added = 0
    while added < len(specs) or engine.has_unfinished():
        while added < len(specs) and join_at[added] <= iteration:
            prompt, n = specs[added]
            engine.add_request(f"r{added}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            added += 1
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
        iteration += 1
        assert iteration < 2000
    assert engine.stats().preemptions >= 1, "the small pool must preempt"
    assert sum(len(prompt) > 8 for prompt, _ in specs) >= 6, "prompts must be chunked"
    ref = reference(name)
    expected = [hf_greedy(ref, prompt, n) for prompt, n in specs]
    assert [final[f"r{i}"] for i in range(len(specs))] == expected
    assert len({t for tokens in expected for t in tokens}) > 10  # the model does not repeat one token


@pytest.mark.parametrize(
    ("builder", "overrides", "message"),
    [
        (make_mistral, {"hidden_act": "gelu"}, "activation"),
        (make_qwen2, {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "rope"),
        (make_qwen3, {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
    ],
    ids=["mistral-gelu", "qwen2-dynamic-rope", "qwen3-partial-rotary"],
)
def test_unsupported_options_are_refused_by_name(builder: Any, overrides: dict, message: str, tmp_path: Path) -> None:
    path = builder(tmp_path / "ckpt", **overrides)
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(model=str(path)))


@pytest.mark.parametrize(
    ("arch", "builder", "overrides"),
    [
        ("qwen2", make_qwen2, {"use_sliding_window": False}),
        # transformers' GGUF reader takes Qwen3's head_dim from its default (128), not from the file
        ("qwen3", make_qwen3, {"head_dim": 128}),
    ],
    ids=["qwen2", "qwen3"],
)
def test_gguf_files_of_the_family_generate_what_transformers_generates_from_them(
    arch: str, builder: Any, overrides: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    gguf_file = write_gguf(builder(tmp_path / "hf", **overrides), gguf_dir / f"tiny-{arch}.gguf", arch)
    ref = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    llm = LLM(model=str(gguf_file), max_bs=4)
    assert llm.engine.model_config.model_type == arch
    rng = random.Random(5)
    prompts = [random_prompt(rng, n) for n in (3, 11, 7)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [out.token_ids for out in outputs] == [hf_greedy(ref, prompt, 10) for prompt in prompts]
    assert llm.engine.tokenizer is not None  # the GGUF's own tokenizer came through the conversion

