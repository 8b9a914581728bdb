"""EngineConfig.attention_backend: the flex backend (one flex_attention call per layer over the whole K/V pool,
orca/models/attention/flex.py) and the batched one (the increments of an iteration as one padded batch) give
the reference's numbers (per-request SDPA, fp32, 1e-4) on mixed iterations
(prompts, chunks after a cached prefix, increments at different positions, partly filled last blocks,
shuffled block tables, GQA and MHA, sliding windows) at block sizes 1, 4 and 16; its block-sparse
structure covers every (query, slot) pair the mask keeps, which is what lets the compiled kernel skip the
rest; whole generations with either are transformers' greedy tokens under chunking and preemption, and
with flex under tensor parallelism. The batched backend batches from BATCHED_MIN_INCREMENTS increments on,
and its padding slots never reach a result.

On this CPU flex runs PyTorch's unfused implementation (the compiled kernels are CUDA's): these tests check
the layout and the mask, which both share."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from _fixtures import FAMILIES, drain, hf_greedy, tiny_checkpoint, tiny_reference
from checkpoints import make_llama, make_mistral, make_mixtral

from orca import EngineConfig, LLMEngine, SamplingParams
from orca.models.attention import (
    AttentionMetadata,
    IterationLayout,
    get_backend,
    selective_attention,
)
from orca.models.attention.flex import FLEX_DECODING_ROWS
from orca.models.attention.flex_layout import FLEX_Q_BLOCK, FlexLayout
from orca.tuning import BATCHED_MIN_INCREMENTS, VERIFYING_MAX_ROWS
from orca.worker import Worker, flex_warm_up_plans, why_not_flex_by_default
from orca.worker.cpu_graphs.decode_attention import FewDecode, LoneDecode, few_inputs, lone_inputs
from orca.worker.warmup import warm_up_flex

BLOCK_SIZES = (1, 4, 16)
# (new tokens, cached tokens) per request, increments first as the worker orders them: two increments at
# different positions, a whole prompt, a prompt chunk after a cached prefix, a one-token prompt, another
# chunk; 40 rows, so three query tiles of FLEX_Q_BLOCK, one shared by several requests.
MIXED = [(1, 9), (1, 3), (1, 30), (12, 0), (5, 6), (1, 0), (9, 17), (10, 0)]
# A decode iteration: increments only.
DECODE = [(1, 9), (1, 3), (1, 30), (1, 0), (1, 17), (1, 44), (1, 15)]


def _tables(rng: random.Random, block_size: int, num_blocks: int, shape: list[tuple[int, int]] = MIXED
            ) -> list[list[int]]:
    """Each request's blocks drawn at random from the pool: tables neither consecutive nor ordered."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    return [[free.pop() for _ in range(-(-(n + past) // block_size))] for n, past in shape]


@pytest.mark.parametrize("backend", ["flex", "batched"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("shape", [MIXED, DECODE], ids=["mixed", "decode"])
def test_the_fused_backends_match_the_reference_on_a_mixed_iteration(
    backend: str, block_size: int, heads: int, kv_heads: int, window: int | None, shape: list[tuple[int, int]]
) -> None:
    rng = random.Random(block_size)
    num_blocks, dim = 160 // block_size + 8, 8
    tables = _tables(rng, block_size, num_blocks, shape)
    lengths, context = [n for n, _ in shape], [p for _, p in shape]
    torch.manual_seed(0)
    pool = torch.randn(3, 2, kv_heads, num_blocks * block_size, dim)  # cached keys/values everywhere
    q = torch.randn(sum(lengths), heads, dim)
    kv = torch.randn(sum(lengths), 2, kv_heads, dim)
    out, pools = {}, {}
    for b in ("reference", backend):
        pools[b] = pool.clone()
        meta = AttentionMetadata.build(lengths, context, tables, block_size, pools[b], backend=b)
        assert (meta.flex is not None) == (b == "flex")
        assert bool(meta.increments) == (b == "batched")  # MIXED has 3 increments, DECODE 7: batched
        out[b] = selective_attention(q, kv, meta, 1, 0.3, window)
    torch.testing.assert_close(out[backend], out["reference"], atol=1e-4, rtol=0)
    torch.testing.assert_close(pools[backend], pools["reference"], atol=0, rtol=0)  # the same K/V written
    assert out["reference"].abs().max() > 0.1


@pytest.mark.parametrize("backend", ["reference", "batched"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("window", [None, 5, 100])
def test_a_lone_increment_over_consecutive_blocks_reads_its_view(backend: str, heads: int, kv_heads: int,
                                                                 window: int | None) -> None:
    """A single stream's decode step (one increment, its blocks consecutive) takes the lone view's path:
    the same output as softmax(q k^T) v written out over its keys (its last `window`), and as the same
    request with its blocks shuffled (the gathering path)."""
    block_size, past, dim = 4, 37, 8
    used = -(-(past + 1) // block_size)
    torch.manual_seed(0)
    pool = torch.randn(2, 2, kv_heads, 64 * block_size, dim)
    q, kv = torch.randn(1, heads, dim), torch.randn(1, 2, kv_heads, dim)
    consecutive, shuffled = list(range(20, 20 + used)), random.Random(1).sample(range(40, 64), used)
    outputs = []
    for table in (consecutive, shuffled):
        layer_pool = pool.clone()
        # the same cached keys and values at each table's slots
        for p in range(past):
            layer_pool[:, :, :, table[p // block_size] * block_size + p % block_size] = pool[:, :, :, 200 + p]
        meta = AttentionMetadata.build([1], [past], [table], block_size, layer_pool, backend=backend)
        assert (meta.lone_view is not None) == (table is consecutive)
        outputs.append(selective_attention(q, kv, meta, 1, 0.3, window))
    keys = torch.cat([pool[1, 0, :, 200 : 200 + past], kv[0, 0, :, None]], 1)  # (KVH, past + 1, D)
    values = torch.cat([pool[1, 1, :, 200 : 200 + past], kv[0, 1, :, None]], 1)
    if window is not None:
        keys, values = keys[:, -window:], values[:, -window:]
    group = heads // kv_heads
    keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)  # (H, keys, D)
    probs = torch.softmax((q[0, :, None] * keys).sum(-1) * 0.3, -1)  # (H, keys)
    expected = (probs[:, :, None] * values).sum(1).reshape(1, heads * dim)
    torch.testing.assert_close(outputs[0], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(outputs[1], expected, atol=1e-5, rtol=0)


def _attends_as_the_backend(step: Any, meta: AttentionMetadata, layers: tuple[int, ...], rows: int, heads: int,
                            kv_heads: int, dim: int, dtype: torch.dtype, pool: torch.Tensor,
                            before: torch.Tensor) -> None:
    """A compiled step's attention (LoneDecode, FewDecode) gives the backend's output for the same step at
    each of `layers` (out of order: `written` follows the calls), each layer's new keys and values
    returned in `written`, the pool (NaN where nothing is cached) left as `before`; a window is refused."""
    for layer in layers:
        q, kv = torch.randn(rows, heads, dim).to(dtype), torch.randn(rows, 2, kv_heads, dim).to(dtype)
        got = selective_attention(q, kv, step, layer, 0.3)
        want = selective_attention(q, kv, meta, layer, 0.3)
        assert not want.isnan().any()
        torch.testing.assert_close(got, want, **({} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 0}))
        assert got.dtype == dtype and got.shape == (rows, heads * dim)
        assert torch.equal(step.written[-1], kv)
    assert len(step.written) == len(layers) and torch.equal(pool.nan_to_num(), before.nan_to_num())  # no write
    with pytest.raises(ValueError, match="sliding window"):
        selective_attention(q, kv, step, 0, 0.3, window=5)


@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("past", [1, 4, 37])
@pytest.mark.parametrize("new", [1, 2, 5])
@pytest.mark.parametrize("tables", ["consecutive", "scattered"])
def test_a_lone_step_attends_over_its_cached_blocks_and_its_own_keys(heads: int, kv_heads: int, dtype: torch.dtype,
                                                                    past: int, new: int, tables: str) -> None:
    """LoneDecode (the compiled single-stream step's attention, inside its graph; one row, or a
    verification's several): the reference's output for the same step (the new keys and values written
    first, each new row seeing the new keys up to its own), reading the cached keys and values through the
    request's block table (its blocks consecutive or not; the pool NaN everywhere else, the last block's
    slots past the cached keys included), without writing the pool: the new keys and values come back in
    `written`, in layer order; a sliding window is refused."""
    block_size, dim, num_blocks = 4, 8, 64
    torch.manual_seed(past + new)
    rng = random.Random(past * new)
    used = -(-(past + new) // block_size)
    table = list(range(20, 20 + used)) if tables == "consecutive" else rng.sample(range(num_blocks), used)
    pool = torch.full((3, 2, kv_heads, num_blocks * block_size, dim), float("nan"), dtype=dtype)
    for p in range(past):
        pool[:, :, :, table[p // block_size] * block_size + p % block_size] = torch.randn(3, 2, kv_heads, dim).to(dtype)
    before = pool.clone()
    layout = IterationLayout(get_backend("reference"), [new], [past], [table], block_size, pool.clone())
    meta, inputs = layout.metadata(), lone_inputs(layout)
    (lone_table,) = inputs.tables
    assert lone_table.tolist() == table[: -(-past // block_size)]
    assert torch.equal(inputs.slot_mapping, meta.slot_mapping)
    lone = LoneDecode(pool.unflatten(3, (-1, block_size)), lone_table, torch.tensor(past))
    _attends_as_the_backend(lone, meta, (0, 2), new, heads, kv_heads, dim, dtype, pool, before)


@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["reference", "batched"])
@pytest.mark.parametrize("pasts", [[1, 4], [37, 2, 8], [5, 16, 1, 23, 11]], ids=["2", "3", "5"])
def test_a_few_step_attends_each_request_over_its_cached_blocks_and_its_own_key(
        heads: int, kv_heads: int, dtype: torch.dtype, backend: str, pasts: list[int]) -> None:
    """FewDecode (the compiled graph of a decode step of 2 to FEW_MAX_ROWS requests): each row gets the
    backend's output for the same step (the new keys and values written first), reading its request's
    cached keys and values through its padded row of the metadata's few_tables (scattered blocks; the pool
    NaN everywhere else, each table's last block's slots past its cached keys and the padding blocks'
    included), without writing the pool: the new keys and values come back in `written`. (Which steps take
    it: tests/test_compiled.py.)"""
    block_size, dim, num_blocks = 4, 8, 64
    n = len(pasts)
    torch.manual_seed(n)
    _, _, tables, pool = _nan_pool_outside([(1, past) for past in pasts], random.Random(n), block_size, num_blocks,
                                           kv_heads, dim, dtype)
    before = pool.clone()
    layout = IterationLayout(get_backend(backend), [1] * n, pasts, tables, block_size, pool.clone())
    meta, inputs = layout.metadata(), few_inputs(layout)
    few_tables, few_past = inputs.tables
    width = max(-(-past // block_size) for past in pasts)
    assert few_tables.tolist() == [t[: -(-p // block_size)] + [t[0]] * (width - -(-p // block_size))
                                   for t, p in zip(tables, pasts)]
    assert few_past.tolist() == pasts and torch.equal(inputs.slot_mapping, meta.slot_mapping)
    few = FewDecode(pool.unflatten(3, (-1, block_size)), few_tables, few_past)
    _attends_as_the_backend(few, meta, (1, 0), n, heads, kv_heads, dim, dtype, pool, before)


def _nan_pool_outside(shape: list[tuple[int, int]], rng: random.Random, block_size: int, num_blocks: int,
                      kv_heads: int, dim: int, dtype: torch.dtype) -> tuple[list[int], list[int], list[list[int]],
                                                                             torch.Tensor]:
    """Requests of (new tokens, cached tokens) `shape`: their lengths, context lengths, block tables shuffled
    over the pool, and a (layers 2) pool that is NaN outside their blocks, zeroed where they are (as the
    worker zeroes each block it hands out: KVLayout.zero_blocks) and random in their cached slots."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(n + past) // block_size))] for n, past in shape]
    lengths, context = [n for n, _ in shape], [p for _, p in shape]
    pool = torch.full((2, 2, kv_heads, num_blocks * block_size, dim), float("nan"), dtype=dtype)
    for past, table in zip(context, tables):
        for b in table:
            pool[:, :, :, b * block_size : (b + 1) * block_size] = 0
        for p in range(past):  # the cached keys and values of each request, nothing else
            pool[:, :, :, table[p // block_size] * block_size + p % block_size] = torch.randn(2, 2, kv_heads, dim)
    return lengths, context, tables, pool


def _reference_and_batched(shape: list[tuple[int, int]], rng: random.Random, seed: int, num_blocks: int,
                           dtype: torch.dtype, window: int | None
                           ) -> tuple[dict[str, torch.Tensor], dict[str, AttentionMetadata]]:
    """Requests of (new tokens, cached tokens) `shape` on a pool NaN outside their blocks (_nan_pool_outside,
    its tables drawn with `rng`: blocks of 4, 6 query heads over 2 K/V heads of 8), queries and new keys and
    values drawn after torch.manual_seed(seed): each of the reference and batched backends' outputs
    (float32) and metadata."""
    torch.manual_seed(seed)
    lengths, context, tables, pool = _nan_pool_outside(shape, rng, 4, num_blocks, 2, 8, dtype)
    q = torch.randn(sum(lengths), 6, 8, dtype=dtype)
    kv = torch.randn(sum(lengths), 2, 2, 8, dtype=dtype)
    out, metas = {}, {}
    for b in ("reference", "batched"):
        metas[b] = AttentionMetadata.build(lengths, context, tables, 4, pool.clone(), backend=b)
        out[b] = selective_attention(q, kv, metas[b], 1, 0.35, window).float()
    return out, metas


@pytest.mark.parametrize("increments", [1, BATCHED_MIN_INCREMENTS - 1, BATCHED_MIN_INCREMENTS, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_increments_read_only_their_own_slots(increments: int, dtype: torch.dtype) -> None:
    """Increments of very different lengths (1 to 40 keys: most rows are padding), beside a prompt, on a
    pool that is NaN outside the blocks of the iteration's requests (zeroed when handed out, as the
    worker does): a padding slot that read another block would poison its row. Fewer than
    BATCHED_MIN_INCREMENTS increments run the reference's calls; from there on, one batch. bfloat16 matches
    the reference to its precision."""
    rng = random.Random(increments)
    shape = [(1, rng.choice([0, 1, 2, 39])) for _ in range(increments)]
    shape = [(n, max(past, 1)) for n, past in shape] + [(7, 0)]
    out, metas = _reference_and_batched(shape, rng, increments, 64, dtype, None)
    for b, meta in metas.items():
        assert bool(meta.increments) == (b == "batched" and increments >= BATCHED_MIN_INCREMENTS)
    assert out["batched"].isfinite().all()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out["batched"], out["reference"], atol=tolerance, rtol=0)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_short_requests_are_the_reference_s(dtype: torch.dtype, window: int | None) -> None:
    """Speculating requests verifying their proposals (2 to VERIFYING_MAX_ROWS tokens after a cached
    prefix) are batched in groups of their own after the increments, each row padded to its group's longest
    request: outputs equal the reference's per-request masked calls, on a pool NaN outside the iteration's
    blocks (no padding query or slot reads another's), with a sliding window too, beside a chunk longer
    than VERIFYING_MAX_ROWS and a prompt (the reference's calls)."""
    rng = random.Random(7)
    shape = ([(1, rng.randint(1, 30)) for _ in range(3)] + [(n, rng.randint(1, 30)) for n in (2, 5, 5, 3, 8)]
             + [(VERIFYING_MAX_ROWS + 3, 6), (7, 0)])
    out, metas = _reference_and_batched(shape, rng, 7, 96, dtype, window)
    groups = [(g.rows, g.queries) for g in metas["batched"].increments]
    assert groups[0] == (3, 1) and sum(rows for rows, _ in groups[1:]) == 5 and max(q for _, q in groups) == 8
    assert out["batched"].isfinite().all()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out["batched"], out["reference"], atol=tolerance, rtol=0)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_the_block_sparse_structure_covers_every_kept_pair(block_size: int) -> None:
    rng = random.Random(10 + block_size)
    num_blocks = 160 // block_size + 8
    tables = _tables(rng, block_size, num_blocks)
    lengths, context = [n for n, _ in MIXED], [p for _, p in MIXED]
    layout = FlexLayout.build(lengths, context, tables, block_size, num_blocks * block_size, torch.device("cpu"))
    rows, slots = layout.num_tokens, layout.num_slots
    keep = layout.mask_mod(None)(0, 0, torch.arange(rows)[:, None], torch.arange(slots)[None, :])  # (T, S)
    # Each row keeps exactly its request's slots up to its own position: past + j + 1 of them.
    expected = [past + j + 1 for n, past in MIXED for j in range(n)]
    assert keep.sum(-1).tolist() == expected
    # The tiles each query tile visits, from the BlockMask, against the tiles its kept pairs fall in.
    q_tiles, kv_tiles = -(-rows // FLEX_Q_BLOCK), -(-slots // layout.kv_block)
    padded = torch.zeros(q_tiles * FLEX_Q_BLOCK, kv_tiles * layout.kv_block, dtype=torch.bool)
    padded[:rows, :slots] = keep
    needed = padded.view(q_tiles, FLEX_Q_BLOCK, kv_tiles, layout.kv_block).any(3).any(1)
    visited = torch.zeros(q_tiles, kv_tiles, dtype=torch.bool)  # (to_dense takes kv_indices as the pool wide)
    for t, (count, indices) in enumerate(zip(layout.kv_num_blocks[0, 0].tolist(), layout.kv_indices[0, 0].tolist())):
        visited[t, indices[:count]] = True
    assert not (needed & ~visited).any(), "a tile the mask keeps pairs in is skipped"
    # Every visited tile holds a block of a request with a row in that query tile, at or before that row's
    # position, and no more: the skipped share (other requests' blocks, a prompt's later blocks) is what
    # the fused kernel saves.
    expected_visits = torch.zeros(q_tiles, kv_tiles, dtype=torch.bool)
    row = 0
    for (n, past), table in zip(MIXED, tables):
        for r in range(row, row + n):
            for j in range((past + r - row) // block_size + 1):
                expected_visits[r // FLEX_Q_BLOCK, table[j] * block_size // layout.kv_block] = True
        row += n
    assert torch.equal(visited, expected_visits)
    # The structure is as wide as the most tiles a query tile visits, not the pool's tiles.
    assert layout.kv_indices.shape[-1] == int(layout.kv_num_blocks.max()) <= kv_tiles
    if block_size == 16:  # (smaller blocks, shuffled over the pool, touch most tiles)
        assert visited.sum() < visited.numel() / 2


def test_the_static_layout_holds_a_decode_iteration_of_scattered_small_blocks() -> None:
    """CUDA graphs' static layout (FlexLayout.static) takes any decode iteration of up to its rows and
    max_blocks: with blocks smaller than a slot tile (4 slots, tiles of 16), a query tile of 16 requests whose
    8 blocks each lie in different tiles visits 128 tiles, more than the tiles 8 contiguous blocks span (3
    per request: 48), the bound the static layout used to have."""
    block_size, max_blocks, rows = 4, 8, 16
    num_blocks = 4 * rows * max_blocks  # every block used below in a tile of its own
    tables = [[4 * (max_blocks * r + j) for j in range(max_blocks)] for r in range(rows)]
    lengths, context = [1] * rows, [max_blocks * block_size - 1] * rows
    layout = FlexLayout.build(lengths, context, tables, block_size, num_blocks * block_size, torch.device("cpu"))
    assert int(layout.kv_num_blocks.max()) == rows * max_blocks
    static = FlexLayout.static(rows, max_blocks, block_size, num_blocks * block_size, torch.device("cpu"))
    static.copy_(layout)
    rows_, slots = torch.arange(rows)[:, None], torch.arange(num_blocks * block_size)[None, :]
    assert torch.equal(static.mask_mod(None)(0, 0, rows_, slots), layout.mask_mod(None)(0, 0, rows_, slots))
    assert torch.equal(static.kv_indices[..., :rows * max_blocks], layout.kv_indices)


def test_a_paged_layout_has_the_rows_and_tables_and_copies_into_the_static_one() -> None:
    """The layout the paged decode kernel reads (CUDA's iterations of few rows per request): the same rows
    and tables as flex's, no block-sparse structure; CUDA graphs' static paged layout takes a padded
    decode iteration's (copy_, head), and a paged and an unpaged layout do not mix."""
    from orca.models.attention.flex_layout import PADDING_ROW

    cpu, block_size, max_blocks = torch.device("cpu"), 4, 6
    tables = [[7, 3], [11, 12, 13], [0]]
    lengths, context, padding = [1, 1, 1], [5, 9, 0], 2
    flex = FlexLayout.build(lengths, context, tables, block_size, 64 * block_size, cpu, padding)
    paged = FlexLayout.build(lengths, context, tables, block_size, 64 * block_size, cpu, padding, paged=True)
    assert paged.paged and paged.kv_indices is None and paged.block_index is None
    for name in ("q_request", "q_position", "tables"):
        assert torch.equal(getattr(paged, name), getattr(flex, name)), name
    assert paged.q_position.tolist() == [5, 9, 0, PADDING_ROW, PADDING_ROW]
    with pytest.raises(ValueError, match="no block-sparse structure"):
        paged.block_mask()
    static = FlexLayout.static(8, max_blocks, block_size, 64 * block_size, cpu, paged=True)
    head = static.head(5)
    head.copy_(paged)
    assert torch.equal(static.q_position[:5], paged.q_position) and torch.equal(static.q_request[:5], paged.q_request)
    assert static.tables[:3, :3].tolist() == [[7, 3, -1], [11, 12, 13], [0, -1, -1]]
    assert (static.tables[:, 3:] == -1).all() and static.q_position[5:].tolist() == [PADDING_ROW] * 3
    with pytest.raises(ValueError, match="do not copy into each other"):
        FlexLayout.static(5, max_blocks, block_size, 64 * block_size, cpu).copy_(paged)
    with pytest.raises(ValueError, match="exceeds the static layout"):
        FlexLayout.static(5, 2, block_size, 64 * block_size, cpu, paged=True).copy_(paged)


def test_flex_is_paged_on_cuda_for_iterations_of_few_rows_per_request() -> None:
    """Which iterations the paged decode kernel takes (FlexMetadata.for_iteration asks takes_paged_decode):
    on CUDA, at most VERIFYING_MAX_ROWS rows per request; longer rows, and every iteration on a CPU, run
    flex_attention."""
    from orca.models.attention.flex import FlexMetadata, takes_paged_decode

    cuda = torch.device("cuda")
    assert takes_paged_decode(cuda, [1, 1, 1]) and takes_paged_decode(cuda, [1, VERIFYING_MAX_ROWS])
    assert not takes_paged_decode(cuda, [1, VERIFYING_MAX_ROWS + 1]) and not takes_paged_decode(cuda, [])
    assert not takes_paged_decode(torch.device("cpu"), [1, 1])
    assert not FlexMetadata.for_iteration([1, 1], [3, 3], [[0], [1]], 4, torch.zeros(2, 2, 64 * 4, 16)).flex.paged


def test_the_flex_layout_grows_with_the_iteration_not_the_pool() -> None:
    """The same iteration over a pool 256 times larger: the tables and the block-sparse structure are the
    same; only the per-block index grows (one int32 per pool block). The old layout made (requests x pool
    tiles) and (query tiles x pool tiles) tensors: 1.2 G entries for a 77k-token iteration over an H200's
    default pool."""
    rng = random.Random(5)
    lengths, context = [1] * 40 + [37, 90], [rng.randint(1, 300) for _ in range(40)] + [0, 25]
    layouts = []
    for num_blocks in (2048, 2048 * 256):
        free = rng.sample(range(num_blocks), 1500)
        tables = [[free.pop() for _ in range(-(-(n + past) // 16))] for n, past in zip(lengths, context)]
        layouts.append(FlexLayout.build(lengths, context, tables, 16, num_blocks * 16, torch.device("cpu")))
    small, large = layouts
    widest = max(-(-(n + past) // 16) for n, past in zip(lengths, context))
    assert small.tables.shape == large.tables.shape == (42, widest)
    assert small.kv_indices.shape == large.kv_indices.shape
    assert large.kv_indices.shape[-1] == int(large.kv_num_blocks.max()) <= 16 * widest
    assert large.block_index.shape == (2048 * 256,)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("family", [*FAMILIES, "mistral"])
def test_the_model_gives_the_same_hidden_states_with_either_backend(
    family: str, block_size: int, tmp_path: Path
) -> None:
    # Mistral: grouped-query attention with a sliding window (8) shorter than the prompts.
    path = make_mistral(tmp_path / "mistral", seed=3) if family == "mistral" else tiny_checkpoint(family)
    hidden = {}
    tables = [[5, 1, 9, 0], [2, 7, 3, 8, 6], [4, 10, 11, 12, 13]] if block_size == 4 else None
    for backend in ("reference", "flex"):
        worker = Worker(EngineConfig(model=str(path), block_size=block_size, n_slots=14 * max(block_size, 4) * 4,
                                     attention_backend=backend))
        assert worker.attention_backend == backend
        worker.init_kv_pool(56 if block_size == 1 else 14 if block_size == 4 else 4)
        if backend == "flex":  # its kernels weigh masked slots by 0: unwritten memory must not be NaN
            assert not worker.kv_pool.any()
        rng = random.Random(4)
        if block_size == 4:
            t = tables
        elif block_size == 1:
            free = list(range(56))
            rng.shuffle(free)
            t = [free[:10], free[10:23], free[23:40]]
        else:
            t = [[2], [0, 3], [1]]
        prefix_a, prefix_b = ([rng.randrange(0, 190) for _ in range(n)] for n in (9, 11))
        increment, chunk, prompt = ([rng.randrange(0, 190) for _ in range(n)] for n in (1, 2, 14))
        with torch.inference_mode():
            # Cached prefixes of 9 and 11 tokens, then one iteration: an increment, a 2-token chunk after
            # the 11 cached, and a whole 14-token prompt.
            worker.model(torch.tensor(prefix_a + prefix_b), torch.tensor([*range(9), *range(11)]),
                         AttentionMetadata.build([9, 11], [0, 0], t[:2], block_size, worker.kv_pool,
                                                 backend=worker.attention_backend))
            meta = AttentionMetadata.build([1, 2, 14], [9, 11, 0], t, block_size, worker.kv_pool,
                                           backend=worker.attention_backend)
            hidden[backend] = worker.model(torch.tensor(increment + chunk + prompt),
                                           torch.tensor([9, 11, 12, *range(14)]), meta)
    torch.testing.assert_close(hidden["flex"], hidden["reference"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_batched_increments_run_in_groups_of_similar_lengths(block_size: int) -> None:
    """40 increments of 1 to 400 cached tokens, shortest first (the worker's order): the rows split into
    groups, contiguous and covering every increment, where one group's padding would pass
    BATCHED_GROUP_SLOTS; each group's rows are the reference's."""
    rng = random.Random(block_size)
    context = sorted(rng.randint(1, 400) for _ in range(40))
    shape = [(1, past) for past in context] + [(6, 0)]
    num_blocks = sum(-(-(n + past) // block_size) for n, past in shape) + 4
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(n + past) // block_size))] for n, past in shape]
    lengths = [n for n, _ in shape]
    torch.manual_seed(block_size)
    pool = torch.randn(1, 2, 2, num_blocks * block_size, 8)
    q, kv = torch.randn(sum(lengths), 6, 8), torch.randn(sum(lengths), 2, 2, 8)
    out = {}
    for b in ("reference", "batched"):
        meta = AttentionMetadata.build(lengths, [*context, 0], tables, block_size, pool.clone(), backend=b)
        out[b] = selective_attention(q, kv, meta, 0, 0.3, None)
    groups = meta.increments
    assert len(groups) >= 2
    assert [g.first for g in groups] == [0, *itertools.accumulate(g.rows for g in groups[:-1])]
    assert sum(g.rows for g in groups) == len(context)
    for g in groups:  # each group as wide as its own longest row
        rows = context[g.first : g.first + g.rows]
        assert g.width == -(-(max(rows) + 1) // block_size) * block_size
    torch.testing.assert_close(out["batched"], out["reference"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("family", [*FAMILIES, "mistral"])
def test_the_model_gives_the_same_hidden_states_with_batched_increments(
    family: str, block_size: int, tmp_path: Path
) -> None:
    """Four increments after cached prefixes of 1, 3, 9 and 12 tokens (past Mistral's window of 8) and a
    prompt in the same iteration, blocks shuffled over the pool: the batched backend's hidden states are the
    reference's (every layer, so every layer's batched increments)."""
    path = make_mistral(tmp_path / "mistral", seed=3) if family == "mistral" else tiny_checkpoint(family)
    prefixes, prompt = (1, 3, 9, 12), 6
    rng = random.Random(block_size)
    tokens = {n: [rng.randrange(0, 190) for _ in range(n)] for n in prefixes}
    new = [rng.randrange(0, 190) for _ in range(len(prefixes) + prompt)]
    num_blocks = 64 if block_size == 1 else 8
    free = list(range(num_blocks))
    rng.shuffle(free)
    sizes = [*(n + 1 for n in prefixes), prompt]
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in sizes]
    hidden = {}
    for backend in ("reference", "batched"):
        worker = Worker(EngineConfig(model=str(path), block_size=block_size, n_slots=num_blocks * block_size,
                                     attention_backend=backend))
        worker.init_kv_pool(num_blocks)
        worker.kv_pool.zero_()  # the model is called directly: no worker zeroes the blocks it hands out
        with torch.inference_mode():
            worker.model(torch.tensor([t for n in prefixes for t in tokens[n]]),
                         torch.tensor([p for n in prefixes for p in range(n)]),
                         AttentionMetadata.build(list(prefixes), [0] * 4, tables[:4], block_size, worker.kv_pool,
                                                 backend=backend))
            meta = AttentionMetadata.build([1, 1, 1, 1, prompt], [*prefixes, 0], tables, block_size,
                                           worker.kv_pool, backend=backend)
            assert bool(meta.increments) == (backend == "batched")
            hidden[backend] = worker.model(torch.tensor(new), torch.tensor([*prefixes, *range(prompt)]), meta)
    torch.testing.assert_close(hidden["batched"], hidden["reference"], atol=1e-4, rtol=0)
    assert hidden["reference"].abs().max() > 0.1


KV_CONFIGS = {
    "slot-exact": dict(n_slots=96, block_size=1, kv_admission="reserve"),
    "paged-chunked-preempting": dict(n_slots=40, block_size=4, kv_admission="on_demand", max_num_batched_tokens=8),
    "block-16": dict(n_slots=96, block_size=16, kv_admission="on_demand", max_num_batched_tokens=16),
}


@pytest.mark.parametrize("backend", ["flex", "batched"])
@pytest.mark.parametrize("kv", list(KV_CONFIGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_generation_with_a_fused_backend_is_transformers_greedy(family: str, kv: str, backend: str) -> None:
    rng = random.Random(2)
    jobs = [([rng.randrange(0, 190) for _ in range(rng.randint(1, 20))], rng.randint(1, 14)) for _ in range(10)]
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint(family)), max_bs=4, attention_backend=backend,
                                    **KV_CONFIGS[kv]))
    for i, (prompt, n) in enumerate(jobs):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    final = drain(engine)
    if kv == "paged-chunked-preempting":
        assert engine.stats().preemptions > 0
    reference = tiny_reference(family)
    for i, (prompt, n) in enumerate(jobs):
        assert final[f"r{i}"].token_ids == hf_greedy(reference, prompt, n), f"r{i}"


@pytest.mark.parametrize("backend", ["reference", "batched"])
def test_what_earlier_requests_left_in_the_pool_harms_no_later_one(backend: str) -> None:
    """The pool filled with NaN between two rounds of requests (what a request whose keys overflowed could
    leave in the blocks it freed): the batched backend reads whole blocks, the slots past a request's
    length weighed 0, so the worker zeroes each block it hands out; the second round is still transformers'
    greedy tokens. (Prefix caching off: the second round repeats the first's prompts, and cached blocks are
    meant to keep what was computed in them, not the NaN this test pours over the whole pool.)"""
    rng = random.Random(9)
    jobs = [([rng.randrange(0, 190) for _ in range(rng.randint(1, 13))], rng.randint(4, 12)) for _ in range(8)]
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), max_bs=4, attention_backend=backend,
                                    n_slots=96, block_size=4, enable_prefix_caching=False))
    reference = tiny_reference("llama")
    for round_ in range(2):
        for i, (prompt, n) in enumerate(jobs):
            engine.add_request(f"{round_}-{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        final = drain(engine)
        for i, (prompt, n) in enumerate(jobs):
            assert final[f"{round_}-{i}"].token_ids == hf_greedy(reference, prompt, n), f"round {round_}, r{i}"
        engine.executor.worker.kv_pool.fill_(float("nan"))


def test_auto_is_the_measured_choice_and_bad_names_are_refused() -> None:
    from orca.worker.resolution import resolve_attention_backend

    assert resolve_attention_backend("auto", torch.device("cpu"), "the device is cpu")[0] == "batched"
    assert resolve_attention_backend("auto", torch.device("cuda"), None)[0] == "flex"  # with its CUDA graphs
    assert resolve_attention_backend("auto", torch.device("cuda"), "cuda_graphs is off")[0] == "batched"
    for device in ("cpu", "cuda"):
        for backend in ("reference", "batched", "flex"):
            assert resolve_attention_backend(backend, torch.device(device), None)[0] == backend
    with pytest.raises(ValueError, match="must be one of auto, reference, batched, flex, got 'fused'"):
        EngineConfig(attention_backend="fused")
    cfg = EngineConfig.from_parameters({"attention_backend": "flex"})
    assert cfg.attention_backend == "flex"


def test_flex_under_tensor_parallelism_is_transformers_greedy() -> None:
    """Two ranks, each with its share of the query and K/V heads and its own pool, each building the same
    layout from the same plan."""
    rng = random.Random(5)
    jobs = [([rng.randrange(0, 190) for _ in range(rng.randint(2, 20))], 8) for _ in range(6)]
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), tensor_parallel_size=2, max_bs=4,
                                    attention_backend="flex", block_size=4, n_slots=256))
    try:
        for i, (prompt, n) in enumerate(jobs):
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        final = drain(engine)
    finally:
        engine.shutdown()
    reference = tiny_reference("llama")
    for i, (prompt, n) in enumerate(jobs):
        assert final[f"r{i}"].token_ids == hf_greedy(reference, prompt, n), f"r{i}"


def _counting_compiled_flex() -> tuple[Any, list[Any]]:
    """flex_attention compiled as CUDA compiles it (compile_flex), with a backend that records each graph
    dynamo makes (its guards decide recompiles; the backend only runs the graph): (compiled, graphs). Dynamo
    reset first, as in a fresh process: graphs an earlier test left on flex_attention would serve calls
    that would otherwise compile (the compact case below passed after the whole one, vacuously)."""
    import torch._dynamo

    from orca.models.attention.flex import compile_flex

    torch._dynamo.reset()
    graphs: list[Any] = []

    def counting(gm, example_inputs):  # noqa: ANN001, ANN202
        graphs.append(gm)
        return gm.forward

    return compile_flex(counting), graphs


def test_auto_is_flex_on_cuda_only_where_its_graphs_serve_the_configuration(tmp_path: Path) -> None:
    """why_not_flex_by_default, from the config and the checkpoint's config.json (nothing is loaded: a
    "cuda" device is only a name here)."""
    cuda = torch.device("cuda")
    dense, moe = make_llama(tmp_path / "dense", head_dim=16), make_mixtral(tmp_path / "moe", head_dim=16)
    assert why_not_flex_by_default(EngineConfig(model=str(dense)), cuda, dense, ranks=1) is None
    reasons = {
        "cpu": why_not_flex_by_default(EngineConfig(model=str(dense)), torch.device("cpu"), dense, 1),
        "graphs off": why_not_flex_by_default(EngineConfig(model=str(dense), cuda_graphs="off"), cuda, dense, 1),
        "ranks": why_not_flex_by_default(EngineConfig(model=str(dense)), cuda, dense, 2),
        "int8 pool": why_not_flex_by_default(EngineConfig(model=str(dense), kv_cache_dtype="int8"), cuda, dense, 1),
        "lora": why_not_flex_by_default(EngineConfig(model=str(dense), enable_lora=True), cuda, dense, 1),
        "head_dim": why_not_flex_by_default(EngineConfig(model=str(tiny_checkpoint("llama"))), cuda,
                                            tiny_checkpoint("llama"), 1),
        "moe": why_not_flex_by_default(EngineConfig(model=str(moe)), cuda, moe, 1),
    }
    for name, words in {"cpu": "the device is cpu", "graphs off": "cuda_graphs is off", "ranks": "parallelism",
                        "int8 pool": "kv_cache_dtype int8", "lora": "enable_lora", "head_dim": "head_dim 8 < 16",
                        "moe": "mixture-of-experts"}.items():
        assert reasons[name] is not None and words in reasons[name], (name, reasons[name])


@pytest.mark.parametrize("pool", ["whole", "compact"])
def test_compiled_flex_makes_a_bounded_number_of_graphs_whatever_the_batch(pool: str) -> None:
    """flex_attention compiled as CUDA runs it (compile_flex), with a counting backend (dynamo's guards are
    what decide recompiles; the backend only runs the graph): a new layout and mask function every
    iteration, token counts from 1 to 47, and two window sizes. Graphs: per window, one for a single query
    row, one for a single query tile, one for more; the worker's warm-up plans run each of those shapes, after
    which nothing compiles again. `compact`: a quantized pool's iterations, each over its own blocks
    (compact_blocks: keys of a length that changes every iteration); with duck sizing 2 graphs more."""
    from orca.models.attention.flex_layout import compact_blocks

    compiled, graphs = _counting_compiled_flex()
    block_size, slots = 4, 512
    whole = torch.zeros(2, 2, slots, 8)
    rng = random.Random(0)
    seen_after_warm_up = None
    warm_up = [([len(pr.token_ids) for pr in plan.requests], [pr.start for pr in plan.requests])
               for plan in flex_warm_up_plans(block_size, 64)]
    for iteration in range(24):
        # The warm-up's shapes first, then random batches (a last request's prompt or a chunk after 13 tokens).
        if iteration < len(warm_up):
            lengths, context = warm_up[iteration]
        elif iteration == len(warm_up):  # (one tile after cached tokens: with duck sizing, compact compiled again)
            lengths, context = [1, 1, 1, 1, 9], [19, 9, 7, 40, 13]
        else:
            increments = rng.randint(0, 5)
            lengths = [1] * increments + [rng.choice([1, 2, 9, 30, 45])]
            context = [rng.randint(1, 40) for _ in range(increments)] + [rng.choice([0, 13])]
        tables, next_block = [], 0
        for n, past in zip(lengths, context):
            used = -(-(n + past) // block_size)
            tables.append(list(range(next_block, next_block + used)))
            next_block += used
        if pool == "compact":
            used, tables = compact_blocks(lengths, context, tables, block_size)
            kv = torch.zeros(2, 2, len(used) * block_size, 8)
        else:
            kv = whole
        layout = FlexLayout.build(lengths, context, tables, block_size, kv.shape[2], torch.device("cpu"))
        q = torch.randn(1, 6, sum(lengths), 8)
        for window in (None, 4):
            compiled(q, kv[0][None], kv[1][None], block_mask=layout.block_mask(window), enable_gqa=True)
        if iteration == len(warm_up) - 1:
            seen_after_warm_up = len(graphs)
    assert seen_after_warm_up == len(graphs) <= 8, "a batch after the warm-up's shapes compiled again"


def test_the_warm_up_runs_its_plans_and_leaves_no_request(tmp_path: Path) -> None:
    """The worker's flex warm-up (run at load on CUDA, where it compiles): its plans are valid iterations
    on any pool large enough, and it leaves the worker holding no request. Its shapes include a prompt
    past FLEX_DECODING_ROWS, where inductor switches from its decoding kernel to its main one."""
    plans = flex_warm_up_plans(4, 128)  # the tiny Llama's positions: the last iteration is two prompts
    rows = [sum(len(pr.token_ids) for pr in plan.requests) for plan in plans]
    assert rows[:2] == [2, 1] and any(FLEX_Q_BLOCK < n < FLEX_DECODING_ROWS for n in rows)
    assert max(rows) > FLEX_DECODING_ROWS
    blocks = sum(len(pr.new_block_ids) for plan in plans for pr in plan.requests)
    worker = Worker(EngineConfig(model=str(tiny_checkpoint("llama")), block_size=4, n_slots=4 * blocks,
                                 attention_backend="flex"))
    worker.init_kv_pool(blocks)  # on a CPU init_kv_pool does not warm up: run it by hand
    warm_up_flex(worker)
    assert worker.num_requests == 0
    assert worker.kv_pool[:, :, :, -4:].any()  # it did run the model into the pool, to its last block


def test_the_reference_masks_are_built_once_per_iteration_and_keep_what_they_should() -> None:
    """A later chunk, a verifying request's tokens and a windowed prompt longer than its window each need an
    (n, past + n) mask: the same at every layer, so built once per iteration (ReferenceMetadata._mask)."""
    lengths, context = [1, 1, 1, 5, 7, 12], [9, 20, 4, 30, 16, 0]
    tables, next_block = [], 0
    for n, past in zip(lengths, context):
        used = -(-(n + past) // 4)
        tables.append(list(range(next_block, next_block + used)))
        next_block += used
    pool = torch.randn(1, 2, 2, next_block * 4, 8)  # (layers, K and V, KV heads, slots, head dim)
    meta = AttentionMetadata.build(lengths, context, tables, 4, pool, backend="reference")
    q = torch.randn(sum(lengths), 4, 8)
    first = selective_attention(q, torch.randn(sum(lengths), 2, 2, 8), meta, 0, 0.3, 6)
    built = dict(meta._masks)
    assert set(built) == {(3, 6), (4, 6), (5, 6)}  # the increments need none; every other request one
    selective_attention(q, torch.randn(sum(lengths), 2, 2, 8), meta, 0, 0.3, 6)
    assert all(meta._masks[key] is mask for key, mask in built.items())  # the second layer built none
    for i in (3, 4, 5):
        n, past = lengths[i], context[i]
        rows, cols = torch.arange(n)[:, None] + past, torch.arange(past + n)[None]
        assert torch.equal(built[(i, 6)], (cols <= rows) & (rows - cols < 6))
    assert first.isfinite().all()
