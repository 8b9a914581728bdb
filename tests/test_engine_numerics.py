"""Selective batching is exact: an iteration that mixes requests in initiation and in increment, at
different positions, gives every request the logits transformers gives that request alone (fp32, 1e-4),
for GPT-2 and for Llama (grouped-query attention, untied head)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from _fixtures import FAMILIES, hf_last_logits, record_logits, tiny_checkpoint, tiny_engine, tiny_reference
from checkpoints import make_gpt2, make_llama
from transformers import AutoModelForCausalLM

from orca import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from orca.models.attention import AttentionMetadata
from orca.worker import Worker

ATOL = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BUILDERS = {"gpt2": make_gpt2, "llama": make_llama}


@pytest.fixture(scope="session", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    tiny_checkpoint(request.param)  # built once per session
    return request.param


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(0, 190) for _ in range(length)]


def test_mixed_iteration_matches_each_request_alone(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine(family, max_bs=8)
    ref = tiny_reference(family)
    rng = random.Random(0)
    prompts = {
        "a": random_prompt(rng, 5),
        "b": random_prompt(rng, 9),
        "c": random_prompt(rng, 3),
        "d": random_prompt(rng, 7),
    }
    generated: dict[str, list[int]] = {rid: [] for rid in prompts}

    def record(outputs: list[RequestOutput]) -> None:
        for out in outputs:
            generated[out.request_id].extend(out.new_token_ids)

    # a and b get into increment at different positions: a has 3 generated tokens, b has 2.
    engine.add_request("a", prompts["a"], GREEDY)
    record(engine.step())
    engine.add_request("b", prompts["b"], GREEDY)
    record(engine.step())
    record(engine.step())
    assert engine.last_iteration.num_initiation == 0
    assert (len(generated["a"]), len(generated["b"])) == (3, 2)

    captured = record_logits(engine, monkeypatch)
    engine.add_request("c", prompts["c"], GREEDY)
    engine.add_request("d", prompts["d"], GREEDY)
    # Then keep checking 5 more iterations, where all four run in increment, each at its own position.
    for iteration in range(6):
        before = {rid: list(tokens) for rid, tokens in generated.items()}
        outputs = engine.step()
        record(outputs)
        stats = engine.last_iteration
        if iteration == 0:
            # The iteration under test: 2 requests in initiation (3 and 7 prompt tokens) and 2 in
            # increment, flattened into 1 + 1 + 3 + 7 rows.
            assert (stats.batch_size, stats.num_initiation, stats.num_tokens) == (4, 2, 12)
        else:
            assert (stats.batch_size, stats.num_initiation, stats.num_tokens) == (4, 0, 4)
        assert sorted(out.request_id for out in outputs) == ["a", "b", "c", "d"]
        logits = captured[-1]
        assert sorted(logits) == ["a", "b", "c", "d"]
        for out in outputs:
            rid = out.request_id
            row = logits[rid]
            assert row.shape == (engine.model_config.vocab_size,) and row.dtype == torch.float32
            expected = hf_last_logits(ref, prompts[rid] + before[rid])
            torch.testing.assert_close(row, expected, atol=ATOL, rtol=0, msg=f"{family} {rid} it {iteration}")
            assert out.new_token_ids == [int(expected.argmax())]
        # The check is discriminating: the four requests' logits are far apart.
        rows = list(logits.values())
        assert min((rows[i] - rows[j]).abs().max() for i in range(4) for j in range(i)) > 0.1
    assert len(captured) == 6


@pytest.mark.parametrize("tables", ["consecutive", "scattered"])
def test_model_forward_over_a_cached_prefix(family: str, tables: str) -> None:
    """The model itself over the paged K/V pool, two requests in one flattened batch: an initiation of a
    whole prompt (every row's logits, i.e. the causal mask) and a continuation of several tokens after a
    cached prefix (the masked path of selective attention, as a later prompt chunk runs), against
    transformers on the full sequences. Block tables of consecutive blocks are read as views of the pool,
    scattered ones through a gather: both must give the same numbers."""
    worker = Worker(EngineConfig(model=str(tiny_checkpoint(family)), block_size=4, n_slots=64))
    worker.init_kv_pool(16)
    model, pool = worker.model, worker.kv_pool
    ref = tiny_reference(family)
    rng = random.Random(1)
    first, second = random_prompt(rng, 6), random_prompt(rng, 10)
    table_first, table_second = ([0, 1], [2, 3, 4]) if tables == "consecutive" else ([9, 2], [7, 0, 12])
    with torch.inference_mode():
        # Iteration 1: the first 4 tokens of `second` alone.
        meta = AttentionMetadata.build([4], [0], [table_second], 4, pool)
        model(torch.tensor(second[:4]), torch.arange(4), meta)
        # Iteration 2: all of `first` (initiation) + the remaining 6 tokens of `second` after its prefix.
        ids = torch.tensor(first + second[4:])
        positions = torch.tensor(list(range(6)) + list(range(4, 10)))
        meta = AttentionMetadata.build([6, 6], [0, 4], [table_first, table_second], 4, pool)
        assert (meta.views[0] is None) == (tables == "scattered")
        logits = model.compute_logits(model(ids, positions, meta))  # (12, V)
        expected_first = ref(torch.tensor([first])).logits[0]  # (6, V)
        expected_second = ref(torch.tensor([second])).logits[0, 4:]  # (6, V)
    torch.testing.assert_close(logits[:6], expected_first, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[6:], expected_second, atol=ATOL, rtol=0)


# -- family variants -------------------------------------------------------------------------------
VARIANTS = [
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}),
    ("gpt2", {"tie_word_embeddings": False}),
    ("gpt2", {"n_inner": 96, "activation_function": "gelu_pytorch_tanh", "layer_norm_epsilon": 1e-3}),
    ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    ("llama", {"num_key_value_heads": 8, "head_dim": 16, "rope_theta": 500000.0, "rms_norm_eps": 1e-3}),
    ("llama", {"num_key_value_heads": 1}),
]


@pytest.mark.parametrize(("family", "overrides"), VARIANTS, ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_family_variants_match_transformers(
    family: str, overrides: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = BUILDERS[family](tmp_path / "ckpt", seed=3, **overrides)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = LLMEngine(EngineConfig(model=str(path), max_bs=4))
    rng = random.Random(2)
    prompts = [random_prompt(rng, n) for n in (4, 11, 1, 6)]
    logits_per_step = record_logits(engine, monkeypatch)
    generated: list[list[int]] = [[] for _ in prompts]
    for iteration in range(7):
        if iteration < len(prompts):
            engine.add_request(str(iteration), prompts[iteration], GREEDY)  # one joins every iteration
        before = [list(g) for g in generated]
        outputs = engine.step()
        for out in outputs:
            i = int(out.request_id)
            expected = hf_last_logits(ref, prompts[i] + before[i])
            torch.testing.assert_close(logits_per_step[-1][out.request_id], expected, atol=ATOL, rtol=0)
            generated[i].extend(out.new_token_ids)
    assert engine.last_iteration.batch_size == 4


def test_gpt2_without_attention_scaling_is_served_right_or_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scale_attn_weights=False (no 1/sqrt(head_dim)): our GPT-2 must either honour it or refuse the
    checkpoint with a ValueError, never serve other numbers (config.py promises as much)."""
    path = BUILDERS["gpt2"](tmp_path / "ckpt", scale_attn_weights=False)
    try:
        engine = LLMEngine(EngineConfig(model=str(path)))
    except ValueError as exc:
        assert "scale_attn_weights" in str(exc)
        return
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    captured = record_logits(engine, monkeypatch)
    engine.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    engine.step()
    torch.testing.assert_close(captured[0]["x"], hf_last_logits(ref, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("family", "overrides", "message"),
    [
        ("gpt2", {"activation_function": "relu"}, "activation"),
        ("llama", {"hidden_act": "gelu"}, "activation"),
        ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "rope"),
    ],
    ids=["gpt2-relu", "llama-gelu", "llama-dynamic-rope"],
)
def test_unsupported_variants_are_refused(family: str, overrides: dict, message: str, tmp_path: Path) -> None:
    path = BUILDERS[family](tmp_path / "ckpt", **overrides)
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(model=str(path)))
