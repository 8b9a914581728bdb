"""EngineConfig.kv_cache_dtype (orca/worker/kv_cache.py): a K/V pool of float8 e4m3 or int8 values with a
float32 scale per token and K/V head.

The round trip (quantize_kv, dequantize_kv) stays within each format's rounding bound. Attention over a
quantized pool is attention over a float pool holding the dequantized values (1e-6: the storage is the only
difference), for the reference and batched backends, on prompts, increments and mixed iterations over
consecutive and shuffled blocks, the slots written being the quantized new keys and values; the batched
backend's zeroed blocks (values and scales) keep NaN out. The pool holds 4D / (D + 4) times the tokens of a
float32 one in the same bytes. Whole generations stay close to the float pool's (log-probabilities within
each format's tolerance until greedy paths part, most of them never), and the compiled forward pass over an
fp8 pool gives the eager one's tokens and logits. The flex backend reads a quantized pool too (flex_attention
over the iteration's blocks dequantized; its paged decode kernel: tests/test_paged_decode.py). Values that
cannot work are refused at load.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from _fixtures import cpu_graphs, drain, record_logits, tiny_checkpoint

from orca import EngineConfig, LLMEngine, SamplingParams
from orca.models.attention import AttentionMetadata, selective_attention
from orca.models.attention.base import dequantize_kv, quantize_kv
from orca.tuning import BATCHED_MIN_INCREMENTS
from orca.worker.kv_cache import KV_QUANTIZED_DTYPES, KVLayout, resolve_kv_cache_dtype

QUANTIZED = ("fp8_e4m3", "int8")


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_round_trip_stays_within_the_format_s_rounding(name: str, dtype: torch.dtype) -> None:
    """Per row (a token's K/V head), symmetric: the largest magnitude maps to the format's largest (448 or
    127); int8 then errs by at most half a step (amax / 254), float8 e4m3 by half a unit in the last of
    its 3 mantissa bits (2^-4 relative) or, below its normal range, half its subnormal step (2^-10 of the
    scale). Rows of any magnitude, an all-zero row included (no 0 / 0)."""
    qdtype = KV_QUANTIZED_DTYPES[name]
    torch.manual_seed(0)
    magnitudes = torch.tensor([1e-6, 1e-2, 1.0, 30.0, 1e4]).repeat_interleave(40)[:, None]
    x = (torch.randn(200, 64) * magnitudes).to(dtype)
    x[7] = 0
    values, scales = quantize_kv(x, qdtype)
    assert values.dtype == qdtype and scales.dtype == torch.float32 and scales.shape == (200,)
    back = dequantize_kv(values, scales, torch.float32)
    exact = x.float()
    error = (back - exact).abs()
    amax = exact.abs().amax(-1, keepdim=True)
    if qdtype == torch.int8:
        bound = amax / 254
        assert values.abs().amax(-1)[amax[:, 0] > 0].eq(127).all()
    else:
        bound = torch.maximum(exact.abs() * 2**-4, scales[:, None] * 2**-10)
        assert values.float().abs().amax(-1)[amax[:, 0] > 0].eq(448).all()
    assert (error <= bound * (1 + 1e-5)).all(), (error / bound).max()
    assert back[7].eq(0).all() and scales.isfinite().all()
    relative = (error.sum(-1) / exact.abs().sum(-1).clamp_min(1e-30))[amax[:, 0] > 0]
    # Typical relative error of a row: what each format costs (fp8 2.2%, int8 0.6% on these Gaussian rows).
    assert relative.mean() < (0.04 if qdtype != torch.int8 else 0.01)
    # The model's dtype comes back as asked.
    assert dequantize_kv(values, scales, dtype).dtype == dtype


# (new tokens, cached tokens) per request, increments first as the worker orders them.
SHAPES = {
    "prompts": [(12, 0), (7, 0), (1, 0)],
    "increments": [(1, 9), (1, 3), (1, 30), (1, 17)],  # BATCHED_MIN_INCREMENTS or more: one batch
    "mixed": [(1, 9), (1, 3), (1, 30), (12, 0), (5, 6), (1, 0), (9, 17), (10, 0)],  # chunks after a prefix too
}


def _tables(rng: random.Random, shape: list[tuple[int, int]], block_size: int, num_blocks: int) -> list[list[int]]:
    """Every other request's blocks consecutive (read as a view of the pool), the others' drawn at random
    from the rest, in descending order (gathered, from two blocks on)."""
    needs = [-(-(n + past) // block_size) for n, past in shape]
    tables, next_block = [], 0
    for i, need in enumerate(needs):
        if i % 2 == 0:
            tables.append(list(range(next_block, next_block + need)))
            next_block += need
        else:
            tables.append([])
    free = list(range(next_block, num_blocks))
    rng.shuffle(free)
    return [table if i % 2 == 0 else sorted((free.pop() for _ in range(need)), reverse=True)
            for i, (table, need) in enumerate(zip(tables, needs))]


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("backend", ["reference", "batched"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(6, 2, None), (4, 4, None), (6, 2, 5)],
                         ids=["gqa", "mha", "window"])
def test_attention_over_a_quantized_pool_is_attention_over_its_dequantized_values(
    name: str, backend: str, shape: str, block_size: int, heads: int, kv_heads: int, window: int | None
) -> None:
    qdtype = KV_QUANTIZED_DTYPES[name]
    requests = SHAPES[shape]
    rng = random.Random(block_size)
    num_blocks, dim, layers, layer = 160 // block_size + 8, 8, 3, 1
    tables = _tables(rng, requests, block_size, num_blocks)
    lengths, context = [n for n, _ in requests], [p for _, p in requests]
    torch.manual_seed(block_size)
    cached = torch.randn(layers, 2, kv_heads, num_blocks * block_size, dim) * 3  # cached keys/values everywhere
    values, scales = quantize_kv(cached, qdtype)
    q = torch.randn(sum(lengths), heads, dim)
    kv = torch.randn(sum(lengths), 2, kv_heads, dim)

    quantized = AttentionMetadata.build(lengths, context, tables, block_size, values.clone(), backend=backend,
                                        kv_scales=scales.clone())
    assert bool(quantized.increments) == (backend == "batched" and shape != "prompts")
    # Which requests read a view and which a gather (not the batched increments: they read their own way).
    own = range(quantized.num_increment if quantized.increments else 0, len(requests))
    assert [quantized.views[i] is None for i in own] == [i % 2 == 1 and len(tables[i]) > 1 for i in own]
    out = selective_attention(q, kv, quantized, layer, 0.3, window)

    # The same iteration over a float pool holding what the quantized one reads back, the new keys and
    # values stored as they come back too.
    float_pool = dequantize_kv(values, scales, torch.float32)
    stored_kv = dequantize_kv(*quantize_kv(kv, qdtype), torch.float32)
    plain = AttentionMetadata.build(lengths, context, tables, block_size, float_pool, backend=backend)
    want = selective_attention(q, stored_kv, plain, layer, 0.3, window)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    # The slots written hold the quantized new keys and values, and nothing else changed.
    torch.testing.assert_close(dequantize_kv(quantized.kv_pool, quantized.kv_scales, torch.float32), float_pool,
                               atol=0, rtol=0)
    assert not torch.equal(quantized.kv_scales, scales)

    # Against the exact float keys and values: the storage's error, relative to the largest output, within
    # what the format allows (measured over these cases: at most 6.1% fp8, 1.2% int8).
    exact = AttentionMetadata.build(lengths, context, tables, block_size, cached.clone(), backend=backend)
    want_exact = selective_attention(q, kv, exact, layer, 0.3, window)
    assert want_exact.abs().max() > 0.5
    error = (want_exact - out).abs().max() / want_exact.abs().max()
    assert error < (0.1 if qdtype == torch.float8_e4m3fn else 0.02), error


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(6, 2, None), (6, 2, 5)], ids=["gqa", "window"])
def test_flex_over_a_quantized_pool_reads_the_iteration_s_blocks_dequantized(
    name: str, shape: str, block_size: int, heads: int, kv_heads: int, window: int | None
) -> None:
    """flex_attention (on a CPU: PyTorch's unfused implementation) over a quantized pool reads the blocks of
    the iteration's requests gathered and dequantized into a compact pool (compact_blocks): the same
    attention as flex over a float pool of the dequantized values. The compact pool holds the requests'
    blocks, padded to whole slot tiles, not the pool's. (The paged decode kernel, CUDA's path for
    decode iterations, reads the scales itself: tests/test_paged_decode.py.)"""
    from orca.models.attention.flex_layout import compact_blocks

    qdtype = KV_QUANTIZED_DTYPES[name]
    requests = SHAPES[shape]
    rng = random.Random(block_size + 7)
    num_blocks, dim, layers, layer = 160 // block_size + 8, 8, 2, 1
    tables = _tables(rng, requests, block_size, num_blocks)
    lengths, context = [n for n, _ in requests], [p for _, p in requests]
    torch.manual_seed(block_size)
    values, scales = quantize_kv(torch.randn(layers, 2, kv_heads, num_blocks * block_size, dim) * 3, qdtype)
    q, kv = torch.randn(sum(lengths), heads, dim), torch.randn(sum(lengths), 2, kv_heads, dim)

    quantized = AttentionMetadata.build(lengths, context, tables, block_size, values.clone(), backend="flex",
                                        kv_scales=scales.clone())
    used = sorted({b for table in tables for b in table})
    assert sorted(set(quantized.gather_blocks.tolist())) == used  # (the padding repeats the first block)
    assert quantized.flex.num_slots == len(quantized.gather_blocks) * block_size < num_blocks * block_size
    assert quantized.flex.num_slots % max(16, block_size) == 0
    out = selective_attention(q, kv, quantized, layer, 0.3, window)

    float_pool = dequantize_kv(values, scales, torch.float32)
    plain = AttentionMetadata.build(lengths, context, tables, block_size, float_pool, backend="flex")
    assert plain.gather_blocks is None and plain.flex.num_slots == num_blocks * block_size
    want = selective_attention(q, dequantize_kv(*quantize_kv(kv, qdtype), torch.float32), plain, layer, 0.3, window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(dequantize_kv(quantized.kv_pool, quantized.kv_scales, torch.float32), float_pool,
                               atol=0, rtol=0)  # the new keys and values written, quantized
    # compact_blocks: tables renumbered in order of first use, each request's blocks up to its last token.
    blocks, renumbered = compact_blocks([1, 6], [5, 0], [[9, 4, 7], [4, 2, 8]], 4)
    assert blocks[:4] == [9, 4, 2] + [9] and len(blocks) == 8 and renumbered == [[0, 1], [1, 2]]


@pytest.mark.parametrize("name", QUANTIZED)
def test_batched_increments_read_zeroed_blocks_of_a_quantized_pool(name: str) -> None:
    """Values and scales NaN everywhere (unwritten memory: float8's NaN byte, a NaN scale) but the blocks
    of the iteration's requests, which KVLayout.zero_blocks zeroes as the worker does when it hands them
    out: no padding slot of a batched row reaches a result."""
    qdtype = KV_QUANTIZED_DTYPES[name]
    block_size, num_blocks, heads, kv_heads, dim = 4, 64, 6, 2, 8
    layout = KVLayout(2, kv_heads, dim, qdtype, block_size)
    cpu = torch.device("cpu")
    pool, scales = layout.allocate(num_blocks, cpu), layout.allocate_scales(num_blocks, cpu)
    pool.view(torch.uint8).fill_(0x7F)  # NaN in float8 e4m3fn; 127 in int8
    scales.fill_(float("nan"))
    requests = [(1, 1), (1, 2), (1, 39), (1, 6), (7, 0)]  # BATCHED_MIN_INCREMENTS or more increments
    free = list(range(num_blocks))
    random.Random(1).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(n + past) // block_size))] for n, past in requests]
    layout.zero_blocks(pool, torch.tensor([b for table in tables for b in table]), scales)
    assert scales.isnan().sum() == scales.numel() - 2 * 2 * kv_heads * block_size * sum(map(len, tables))
    torch.manual_seed(0)
    for past, table in zip((p for _, p in requests), tables):  # the cached keys and values, nothing else
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(past)])
        if past:
            v, s = quantize_kv(torch.randn(2, 2, kv_heads, past, dim), qdtype)
            pool.view(torch.uint8)[:, :, :, slots] = v.view(torch.uint8)
            scales[:, :, :, slots] = s
    lengths, context = [n for n, _ in requests], [p for _, p in requests]
    meta = AttentionMetadata.build(lengths, context, tables, block_size, pool, backend="batched", kv_scales=scales)
    assert len(meta.increments[0].blocks) > sum(map(len, tables[:4])) >= BATCHED_MIN_INCREMENTS  # padded rows
    out = selective_attention(torch.randn(sum(lengths), heads, dim), torch.randn(sum(lengths), 2, kv_heads, dim),
                              meta, 1, 0.35, None)
    assert out.isfinite().all()


@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_the_pool_holds_more_tokens_in_the_same_bytes(head_dim: int) -> None:
    """A float32 model: 4 x D bytes per token and K/V head, against D values and a 4-byte scale."""
    auto = KVLayout(3, 2, head_dim, resolve_kv_cache_dtype("auto", torch.float32), 16)
    assert auto.dtype == torch.float32 and not auto.quantized
    for name in QUANTIZED:
        layout = KVLayout(3, 2, head_dim, resolve_kv_cache_dtype(name, torch.float32), 16)
        assert layout.quantized and layout.bytes_per_slot == 3 * 2 * 2 * (head_dim + 4)
        assert auto.bytes_per_slot / layout.bytes_per_slot == 4 * head_dim / (head_dim + 4)
        budget = 1 << 20
        assert layout.blocks_for_budget(budget) == budget // (16 * 3 * 2 * 2 * (head_dim + 4))
        pool = layout.allocate(5, torch.device("cpu"))
        scales = layout.allocate_scales(5, torch.device("cpu"))
        assert pool.nbytes + scales.nbytes == 5 * layout.bytes_per_block
    assert auto.allocate_scales(5, torch.device("cpu")) is None


def test_an_engine_s_pool_holds_more_tokens_at_the_same_kv_cache_bytes() -> None:
    """The engine sizes its pool from kv_cache_bytes by bytes per block: the tiny llama (head_dim 8) holds
    4 x 8 / (8 + 4) = 2.67x the blocks quantized; n_slots fixes the tokens whatever the dtype."""
    budget = 3 * 2 * 2 * 4 * 8 * 4 * 300  # 300 float32 blocks of 4 tokens (3 layers, 2 K/V heads, head_dim 8)
    blocks = {}
    for name in ("auto", *QUANTIZED):
        engine = _engine(kv_cache_dtype=name, kv_cache_bytes=budget, block_size=4)
        worker = engine.executor.worker
        blocks[name] = engine.stats().kv_total_blocks
        pool_bytes = worker.kv_pool.nbytes + (0 if worker.kv_scales is None else worker.kv_scales.nbytes)
        assert pool_bytes == blocks[name] * worker.kv_layout.bytes_per_block <= budget
        assert engine.n_slots == blocks[name] * 4
        assert (worker.kv_scales is None) == (name == "auto")
    assert blocks["auto"] == 300
    assert blocks["fp8_e4m3"] == blocks["int8"] == budget // (3 * 2 * 2 * (8 + 4) * 4) == 800
    assert _engine(kv_cache_dtype="int8", n_slots=64, block_size=4).stats().kv_total_blocks == 16


def _engine(**options: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), **options))


def _generate(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, longest: int = 40, max_tokens: int = 24
) -> tuple[dict[str, list[int]], dict[str, list], int]:
    """Greedy tokens of 8 requests (prompts of 3 to `longest` tokens; the last two, added once the others
    finished, start with the first's prompt, which the prefix cache holds), per request the
    log-probabilities each of its tokens was drawn from, and the prompt tokens read from the cache."""
    logits = record_logits(engine, monkeypatch)
    rng = random.Random(3)
    prompts = [[rng.randrange(0, 190) for _ in range(rng.randint(3, longest))] for _ in range(8)]
    prompts[6:] = [(prompts[0] + prompt)[:longest] for prompt in prompts[6:]]
    final = {}
    for i, prompt in enumerate(prompts):
        if i == 6:
            final.update(drain(engine))
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    final.update(drain(engine))
    rows: dict[str, list] = {}
    for iteration in logits:
        for rid, row in iteration.items():
            rows.setdefault(rid, []).append(row.log_softmax(-1))
    tokens = {rid: out.token_ids for rid, out in final.items()}
    return tokens, rows, sum(out.num_cached_tokens for out in final.values())


# Largest |log-probability| difference from the float pool's, over the vocabulary, while the greedy paths
# agree (measured: 0.10 fp8, 0.018 int8).
LOGPROB_TOLERANCE = {"fp8_e4m3": 0.25, "int8": 0.05}
GENERATION = dict(block_size=4, n_slots=800, max_bs=8, max_num_batched_tokens=32)


@pytest.mark.parametrize("name", QUANTIZED)
def test_generation_over_a_quantized_pool_stays_close_to_the_float_one(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each request's log-probabilities, step by step while its tokens so far are the float pool's (the same
    inputs), differ from the float pool's by at most the format's tolerance, the step where the paths part
    included (so they part only where the float pool's top two were within twice that); most tokens come
    before the paths part (measured: 72% fp8, 92% int8). Prompts in chunks after cached ones, batched
    increments, prefix cache hits."""
    want_tokens, want_rows, _ = _generate(_engine(**GENERATION), monkeypatch)
    engine = _engine(kv_cache_dtype=name, **GENERATION)
    assert engine.executor.worker.attention_backend == "batched"  # auto on a CPU
    tokens, rows, cached = _generate(engine, monkeypatch)
    assert cached >= 2 * 4  # whole blocks of quantized keys and values read back from the prefix cache
    assert_close_until_the_paths_part(name, want_tokens, want_rows, tokens, rows)


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_flex_engine_over_a_quantized_pool_generates_what_batched_does(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """attention_backend flex with a quantized pool (on a CPU: flex_attention over the iteration's blocks
    dequantized, for every iteration): the same greedy tokens and log-probabilities as the batched backend
    over the same kind of pool, chunked prompts, increments and prefix-cache hits included; the pool's
    zeroed blocks (flex weighs every slot of a tile it visits) keep every result finite."""
    options = dict(GENERATION, n_slots=320)
    want_tokens, want_rows, _ = _generate(_engine(kv_cache_dtype=name, **options), monkeypatch, longest=24,
                                          max_tokens=12)
    engine = _engine(kv_cache_dtype=name, attention_backend="flex", **options)
    assert engine.executor.worker.attention_backend == "flex" and engine.executor.worker.kv_scales is not None
    tokens, rows, cached = _generate(engine, monkeypatch, longest=24, max_tokens=12)
    assert cached >= 2 * 4 and tokens == want_tokens
    for rid, want in want_rows.items():
        torch.testing.assert_close(torch.stack(rows[rid]), torch.stack(want), atol=1e-4, rtol=0)


def assert_close_until_the_paths_part(name: str, want_tokens: dict[str, list[int]], want_rows: dict[str, list],
                                      tokens: dict[str, list[int]], rows: dict[str, list]) -> None:
    """Each request's log-probabilities over a `name` pool, step by step while its tokens so far are the float
    pool's, the step where they part included, within the format's tolerance of the float pool's; at least
    half of all tokens come before the paths part."""
    before_parting = 0
    for rid, want in want_tokens.items():
        same = next((k for k, (a, b) in enumerate(zip(want, tokens[rid])) if a != b), len(want))
        before_parting += same
        for step in range(min(same + 1, len(want))):
            error = (rows[rid][step] - want_rows[rid][step]).abs().max()
            assert error < LOGPROB_TOLERANCE[name], (rid, step, error)
    assert before_parting >= sum(map(len, want_tokens.values())) / 2


def test_the_compiled_forward_pass_over_an_fp8_pool_is_the_eager_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_compile auto as shipped (the suite's $ORCA_TORCH_COMPILE=off lifted while it loads); chunked
    prompts, batched increments and preemptions; after load any compilation fails the test."""
    options = dict(kv_cache_dtype="fp8_e4m3", max_bs=5, n_slots=40, block_size=4, kv_admission="on_demand",
                   max_num_batched_tokens=8)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ORCA_TORCH_COMPILE")
        compiled = _engine(**options)
    assert cpu_graphs(compiled.executor.worker) is not None
    cpu_graphs(compiled.executor.worker).stance = "fail_on_recompile"
    cpu_graphs(compiled.executor.worker).all_guards = True
    eager = _engine(**options)
    assert cpu_graphs(eager.executor.worker) is None
    tokens, rows, _ = _generate(compiled, monkeypatch, longest=20, max_tokens=14)  # each fits the 40 slots
    want_tokens, want_rows, _ = _generate(eager, monkeypatch, longest=20, max_tokens=14)
    assert compiled.stats().preemptions > 0
    assert tokens == want_tokens
    for rid, want in want_rows.items():
        torch.testing.assert_close(torch.stack(rows[rid]), torch.stack(want), atol=1e-4, rtol=0)


def test_values_that_cannot_work_are_refused_at_load() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3, int8, got 'fp16'"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3, int8, got 'e5m2'"):
        resolve_kv_cache_dtype("e5m2", torch.float32)
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
