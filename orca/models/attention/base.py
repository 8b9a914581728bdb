"""What every attention backend shares: the interface the model layers and the worker see.

- ``AttentionMetadata``: the iteration's layout, passed explicitly to every layer. Each backend is a
  subclass (its module: reference.py, batched.py, flex.py) holding what only it needs, built once per
  iteration by its own ``for_iteration`` and read at every layer by its own ``attend``; its class
  attributes tell the worker what the backend needs of the pool and of the load (zeroed memory, a
  compile warm-up, CUDA graphs, the compiled forward pass). A subclass registers under its ``name``, the
  ``attention_backend`` value that selects it (``get_backend``).
- ``selective_attention``: what a layer calls. It writes the iteration's new keys and values into their
  slots of the pool (one scatter for every token of every request, the same for every backend), then runs
  the backend's ``attend`` over this layer's pool. A quantized pool (EngineConfig.kv_cache_dtype;
  orca/worker/kv_cache.py) has a second tensor, its scales (AttentionMetadata.kv_scales): the write
  quantizes (``quantize_kv``) and scatters values and scales alike, and ``attend`` gets this layer's
  scales, with which the backend dequantizes what it reads (``dequantize_kv``).
- ``resolve_attention_backend``: EngineConfig.attention_backend (``auto`` included) to the backend that
  runs.
- ``orca::selective_attention`` and ``iteration_scope``: attention as one opaque op inside a compiled
  forward pass (orca/worker/compiled.py). The pool and its scales reach the op through the metadata in
  scope, not as arguments: its signature is the same for every kv_cache_dtype.
- ``LoneDecode``: a single stream's decode step with attention inside a compiled graph of its own (no
  opaque op; the worker writes the step's keys and values after the graph).
- ``PhaseTimer`` (profiling); the builders' shared helpers ``token_slots`` (pool slots of a request's
  positions) and ``leading_increments``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from orca.config import ATTENTION_BACKENDS

_BACKENDS: dict[str, type[AttentionMetadata]] = {}

# A quantized K/V pool's value dtypes and the largest magnitude each holds: a token's head of keys (or
# values) is scaled so that its largest entry lands there (float8 e4m3's largest finite number; int8's
# symmetric range, -128 unused).
KV_QUANTIZED_MAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
# The smallest scale written: an all-zero head would otherwise divide 0 by 0. A normal float32 far below
# any key or value's magnitude / 448.
KV_MIN_SCALE = 2.0**-100


def resolve_attention_backend(choice: str, device: torch.device, no_flex_reason: str | None = None) -> str:
    """EngineConfig.attention_backend to what runs: "reference", "batched" or "flex". The rule for auto, stated
    here only: flex on CUDA where it runs with its CUDA graphs and serves the configuration (`no_flex_reason`
    None: the worker's why_not_flex_by_default says what it must serve), else batched. Why: on CUDA flex with
    graphs is ahead of batched at every batch size measured (since its paged decode kernel), without graphs
    behind it; on a CPU batched is the fastest measured, and flex's paged mask does not compile there
    (docs/BENCHMARKS.md, "Results: the CUDA path on an H200", its four sessions, and "Results: the fast data
    plane, fourth step: batched increments")."""
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {choice!r}")
    if choice == "auto":
        return "flex" if device.type == "cuda" and no_flex_reason is None else "batched"
    return choice


def get_backend(name: str) -> type[AttentionMetadata]:
    """The backend a resolved attention_backend value names: its metadata class (builder and traits)."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"no attention backend {name!r} (there are {', '.join(_BACKENDS)})") from None


@dataclass
class PhaseTimer:
    """Accumulates seconds per phase; syncs the device around each measured span (profiling only)."""

    device: torch.device
    seconds: dict[str, float] = field(default_factory=dict)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


@dataclass(kw_only=True)
class AttentionMetadata:
    """The iteration's batch layout, passed explicitly to every layer (never a global).

    Requests are laid out increments first (the worker orders the rows so): rows [0, number of increments)
    are one token each after a cached prefix, then each other request's rows follow. Every backend has the
    pool slot of each token row (`slot_mapping`, where selective_attention writes the row's keys and
    values), the pool and the profiling timer; its subclass adds what only it reads. The slot arithmetic is
    done once per iteration (the backend's `for_iteration`), not once per layer.
    """

    slot_mapping: torch.Tensor  # (T,) int64
    kv_pool: torch.Tensor  # (layers, 2, KVH, slots, D): the model's dtype, or a quantized pool's values
    kv_scales: torch.Tensor | None = None  # (layers, 2, KVH, slots) float32: a quantized pool's scales
    timer: PhaseTimer | None = None

    # -- the backend's traits (class attributes; the worker reads them at load and per iteration) ------------
    name: ClassVar[str]  # the attention_backend value that selects this backend
    # The pool must be allocated zeroed (a backend that weighs slots nothing wrote by 0); the worker's eager
    # warm-up then leaves it as allocated.
    zeroed_pool: ClassVar[bool] = False
    # Reads whole blocks, the slots past a request's length masked: the worker zeroes each block it hands to
    # a request (KVLayout.zero_blocks), so that no 0 x NaN an earlier request left reaches a result.
    reads_whole_blocks: ClassVar[bool] = False
    # The compiled forward pass (orca/worker/compiled.py) may run with it, attention as one opaque op.
    in_compiled_forward: ClassVar[bool] = False
    # Its tensors' shapes depend on the token count only: decode iterations padded to a size can replay a
    # CUDA graph (orca/worker/cuda_graphs.py: graph_buffers, head, copy_).
    cuda_graphs: ClassVar[bool] = False
    # Where compiles_at_load: the token rows of the iterations that compile its kernels at load (after a
    # two-token prompt and its increment).
    warm_up_rows: ClassVar[tuple[int, ...]] = ()

    # Which path an iteration takes, for the tests to read: the flex layout (flex.py) and the batched
    # increments (batched.py), None and () on the backends that have none. Never read per layer.
    flex = None
    increments = ()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            _BACKENDS[cls.name] = cls

    @classmethod
    def build(
        cls,
        lengths: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        kv_pool: torch.Tensor,
        timer: PhaseTimer | None = None,
        backend: str = "reference",
        padding: int = 0,
        pad_slot: int = 0,
        kv_scales: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """The iteration's metadata for `backend` (resolved: "reference", "batched" or "flex"): that
        backend's for_iteration."""
        return get_backend(backend).for_iteration(lengths, context_lens, block_tables, block_size, kv_pool, timer,
                                                  padding, pad_slot, kv_scales)

    @classmethod
    def for_iteration(
        cls,
        lengths: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        kv_pool: torch.Tensor,
        timer: PhaseTimer | None = None,
        padding: int = 0,
        pad_slot: int = 0,
        kv_scales: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """This backend's builder. Request i feeds `lengths[i]` new tokens after `context_lens[i]` cached
        ones; block_tables[i] covers its first context_lens[i] + lengths[i] tokens; increments come first.
        `padding` rows follow the requests' (backends with cuda_graphs only: a decode iteration padded to a
        CUDA graph's size): each writes its keys and values to `pad_slot`, a slot no request owns, and
        attends to nothing. `kv_scales`: a quantized pool's scales (None: `kv_pool` holds the model's
        dtype)."""
        raise NotImplementedError

    def attend(
        self, q: torch.Tensor, pool: torch.Tensor, scale: float, window: int | None,
        scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer's attention: q (T, H, D) over `pool` (this layer's, (2, KVH, slots, D), the iteration's
        new keys and values written) -> (T, H * D). `scales`: this layer's (2, KVH, slots) when the pool is
        quantized, to dequantize what it reads to q's dtype (dequantize_kv); None otherwise."""
        raise NotImplementedError

    @classmethod
    def compiles_at_load(cls, device: torch.device) -> bool:
        """Whether the worker runs warm_up_rows' iterations at load on this device, to compile its kernels
        there rather than in a user's request."""
        return False

    @classmethod
    def device_warning(cls, device: torch.device) -> str | None:
        """What the worker logs as a warning when this backend runs on `device`; None: nothing to say."""
        return None

    # -- CUDA graphs (cuda_graphs backends) --------------------------------------------------------------
    @classmethod
    def graph_buffers(cls, kv_pool: torch.Tensor, block_size: int, pad_slot: int, rows: int,
                      max_blocks: int, kv_scales: torch.Tensor | None = None) -> AttentionMetadata:
        """Metadata of `rows` padding rows over static buffers, which a captured graph reads: each
        iteration's values are copied in (copy_) into the head (head) of its size. A request holds at most
        `max_blocks` blocks (the model's longest sequence). `kv_scales`: a quantized pool's."""
        raise NotImplementedError(f"attention backend {cls.name} has no fixed shapes for CUDA graphs")

    def head(self, num_tokens: int) -> AttentionMetadata:
        """The metadata of this one's first `num_tokens` rows, sharing its tensors (views)."""
        raise NotImplementedError(f"attention backend {self.name} has no fixed shapes for CUDA graphs")

    def copy_(self, other: AttentionMetadata) -> None:
        """Takes `other`'s values (an iteration of the same token count over the same pool) into this
        metadata's tensors, in place."""
        raise NotImplementedError(f"attention backend {self.name} has no fixed shapes for CUDA graphs")


def token_slots(table: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """Pool slots of token positions [start, end) for a request with this block table."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def leading_increments(lengths: Sequence[int], context_lens: Sequence[int], most: int = 1) -> int:
    """How many requests, from the first, are increments (one token after a cached prefix); with `most`,
    short requests too: up to that many tokens after a cached prefix (a speculating request verifying its
    proposed tokens)."""
    count = 0
    while count < len(lengths) and 1 <= lengths[count] <= most and context_lens[count] > 0:
        count += 1
    return count


def selective_attention(
    q: torch.Tensor,  # (T, H, D): queries of all tokens of all requests
    kv: torch.Tensor,  # (T, 2, KVH, D): this iteration's new keys and values
    meta: AttentionMetadata | LoneDecode,
    layer: int,
    scale: float,
    window: int | None = None,  # sliding window: a query sees its last `window` keys (itself included)
) -> torch.Tensor:  # (T, H * D)
    if isinstance(meta, LoneDecode):  # a single stream's decode step, in its own compiled graph
        return meta.attend(q, kv, layer, scale, window)
    if torch.compiler.is_compiling():  # inside a compiled forward pass: one opaque op (see iteration_scope)
        return torch.ops.orca.selective_attention(q, kv, layer, scale, window)
    return _write_and_attend(q, kv, meta, layer, scale, window)


def _write_and_attend(
    q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata, layer: int, scale: float, window: int | None
) -> torch.Tensor:
    """selective_attention's work, eager: what the opaque op runs."""
    timer = meta.timer
    if timer is not None:
        timer.sync()
        t0 = time.perf_counter()
    # Write this iteration's keys and values into their slots: one scatter for every token of every request.
    pool = meta.kv_pool[layer]  # (2, KVH, slots, D)
    if meta.kv_scales is None:
        pool.index_copy_(2, meta.slot_mapping, kv.permute(1, 2, 0, 3))
        out = meta.attend(q, pool, scale, window)
    else:  # a quantized pool: the values (as bytes: CPU torch has no float8 index_copy_) and their scales
        values, value_scales = quantize_kv(kv, pool.dtype)  # (T, 2, KVH, D), (T, 2, KVH)
        pool.view(torch.uint8).index_copy_(2, meta.slot_mapping, values.view(torch.uint8).permute(1, 2, 0, 3))
        scales = meta.kv_scales[layer]  # (2, KVH, slots)
        scales.index_copy_(2, meta.slot_mapping, value_scales.permute(1, 2, 0))
        out = meta.attend(q, pool, scale, window, scales)
    if timer is not None:
        timer.sync()
        timer.add("attention", time.perf_counter() - t0)
    return out


class LoneDecode:
    """A single stream's step over its request's cached keys and values (an unquantized pool, no sliding
    window) as the compiled forward pass runs it in a graph of its own (orca/worker/compiled.py, LoneStep):
    attention inside the graph, no opaque op. One query row (a decode step) or a few (a speculating stream
    verifying its proposed tokens: row i sees the cached keys and the new ones up to its own).

    The graph reads the cached keys and values through the request's block table, wherever its blocks
    are (consecutive or not: a prefix from the cache, blocks placed after a preemption): the pool, as
    blocks, is one input, the table another (its length unbacked: one graph for any context), and the
    keys past the cached ones in the table's last block are masked by position. It writes nothing: each
    layer's new keys and values enter its attention beside the cached ones and are collected in
    `written`, which the caller writes into the pool after the graph (one copy for every layer).
    Read-only, the pool aliases nothing the graph mutates, so the graph neither copies it nor orders a
    write against a read.

    Attention as multiplies and sums that inductor fuses into its own loops (float32 scores, softmax
    weights and accumulation, as SDPA's CPU kernels): well under half the opaque op's time at one row,
    through the table too (docs/BENCHMARKS.md, "Results: a single stream's step in a graph of its own"
    and "Results: a single stream through its block table")."""

    def __init__(self, blocks: torch.Tensor, table: torch.Tensor, past: torch.Tensor) -> None:
        self.blocks = blocks  # (layers, 2, KVH, pool blocks, block size, D): the pool
        self.table = table  # (n,) int64: the blocks holding the request's cached tokens, in order
        self.past = past  # () int64: its cached tokens (the first new row's position)
        self.written: list[torch.Tensor] = []  # each layer's new (T, 2, KVH, D), in layer order

    def attend(self, q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float, window: int | None) -> torch.Tensor:
        """q (T, H, D), kv (T, 2, KVH, D) -> (T, H * D): softmax(q k^T * scale) v over the cached keys and
        the new ones, new row i seeing new keys 0..i. (At one row, in a graph specialised to it, inductor
        folds the causal mask away: the one-row formula's numbers and time.)"""
        if window is not None:
            raise ValueError("LoneDecode has no sliding window (the worker runs such layers through the op)")
        self.written.append(kv)
        rows, num_heads, head_dim = q.shape
        num_kv_heads = kv.shape[2]
        cached = self.blocks[layer][:, :, self.table]  # (2, KVH, n, block size, D)
        keys, values = cached.unsqueeze(2).unbind(0)  # (KVH, 1, n, block size, D) each
        new_keys, new_values = kv.permute(1, 2, 0, 3).unsqueeze(2).unbind(0)  # (KVH, 1, T, D) each
        # The `group` query heads sharing a K/V head are rows of that head: (T, KVH, group, 1, D).
        qf = q.view(rows, num_kv_heads, num_heads // num_kv_heads, 1, head_dim).float()
        old = (qf.unsqueeze(-2) * keys).sum(-1) * scale  # (T, KVH, group, n, block size)
        # The last block's slots past the cached keys: never written, or stale (NaN in an uninitialised pool,
        # which a zero weight would not cancel): masked out of the scores and the values alike.
        num_blocks, block_size = keys.shape[2], keys.shape[3]
        beyond = torch.arange(num_blocks * block_size, device=q.device).view(num_blocks, block_size) >= self.past
        old = old.masked_fill(beyond, float("-inf"))
        values = values.masked_fill(beyond.unsqueeze(-1), 0)
        own = (qf * new_keys).sum(-1) * scale  # (T, KVH, group, T): row i sees new keys 0..i
        position = torch.arange(rows, device=q.device)
        later = (position[None, :] > position[:, None]).view(rows, 1, 1, rows)
        own = own.masked_fill(later, float("-inf"))
        top = torch.maximum(old.amax((-2, -1)).unsqueeze(-1), own.amax(-1, keepdim=True))  # (T, KVH, group, 1)
        old_w, own_w = torch.exp(old - top.unsqueeze(-1)), torch.exp(own - top)
        out = (old_w.unsqueeze(-1) * values).sum((-3, -2)) + (own_w.unsqueeze(-1) * new_values).sum(-2)
        out = out / (old_w.sum((-2, -1)).unsqueeze(-1) + own_w.sum(-1, keepdim=True))  # (T, KVH, group, D)
        return out.to(q.dtype).view(rows, num_heads * head_dim)


class FewDecode(LoneDecode):
    """A decode step of a few requests (2 to FEW_MAX_ROWS, orca/tuning.py; FewStep, orca/worker/compiled.py),
    one new token each, as LoneDecode runs one: attention inside the compiled graph, each row over its
    request's cached keys and values read through its block table, then its own new key. `tables` (n, width) holds each
    request's blocks of cached tokens, padded with its first block to the longest table; `past` (n,) its
    cached tokens: a row's slots at or past it (its last block's tail, its padding blocks) are masked out
    of the scores and the values alike (never written, stale or NaN there). Both lengths unbacked in the
    graph: one graph for any such step. The step's keys and values are collected in `written`.

    Why: at a few rows the opaque op's per-request calls (2 rows) or its batch (3-5: the batched backend's
    gathers, two bmm and a softmax) cost more than these loops; at 8 rows they are even, at 32 the
    backend's matmuls win (docs/BENCHMARKS.md, "Results: decode steps of a few requests in a graph of
    their own")."""

    def attend(self, q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float, window: int | None) -> torch.Tensor:
        """q (n, H, D), kv (n, 2, KVH, D), one row per request -> (n, H * D). (`table` is (n, width) here,
        `past` (n,).)"""
        if window is not None:
            raise ValueError("FewDecode has no sliding window (the worker runs such layers through the op)")
        self.written.append(kv)
        rows, num_heads, head_dim = q.shape
        num_kv_heads = kv.shape[2]
        cached = self.blocks[layer][:, :, self.table]  # (2, KVH, n, width, block size, D)
        keys, values = cached.unbind(0)  # (KVH, n, width, block size, D) each
        new_keys, new_values = kv.permute(1, 2, 0, 3).unbind(0)  # (KVH, n, D) each
        # The `group` query heads sharing a K/V head are rows of that head: (KVH, n, group, D).
        qf = q.view(rows, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1).float()
        old = (qf[:, :, :, None, None, :] * keys[:, :, None]).sum(-1) * scale  # (KVH, n, group, width, block size)
        width, block_size = keys.shape[2], keys.shape[3]
        slot = torch.arange(width * block_size, device=q.device).view(1, width, block_size)
        beyond = slot >= self.past.view(-1, 1, 1)  # (n, width, block size)
        old = old.masked_fill(beyond[None, :, None], float("-inf"))
        values = values.masked_fill(beyond[None, :, :, :, None], 0)
        own = (qf * new_keys[:, :, None]).sum(-1) * scale  # (KVH, n, group)
        top = torch.maximum(old.amax((-2, -1)), own)
        old_w, own_w = torch.exp(old - top[..., None, None]), torch.exp(own - top)
        out = (old_w[..., None] * values[:, :, None]).sum((-3, -2)) + own_w[..., None] * new_values[:, :, None]
        out = out / (old_w.sum((-2, -1)) + own_w)[..., None]  # (KVH, n, group, D)
        return out.to(q.dtype).transpose(0, 1).reshape(rows, num_heads * head_dim)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) as `dtype` values (float8_e4m3fn or int8) and float32 scales (...,), one per row:
    symmetric, scale = amax(|x|) / KV_QUANTIZED_MAX[dtype], the values x / scale (int8's rounded to the
    nearest), so that x ~ values x scale (dequantize_kv). Computed in float32 whatever x's dtype."""
    x = x.float()
    scales = (x.abs().amax(-1) / KV_QUANTIZED_MAX[dtype]).clamp_min(KV_MIN_SCALE)
    scaled = x / scales.unsqueeze(-1)
    if dtype == torch.int8:
        scaled = scaled.round()
    return scaled.to(dtype), scales


def dequantize_kv(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values (..., D) x scales (...,), in float32, as `dtype`: what quantize_kv's x reads back as. int8
    values multiply as they are (promoted to float32 in the one pass); torch promotes no float8, so those
    are converted first."""
    if values.dtype != torch.int8:
        values = values.float()
    return (values * scales.unsqueeze(-1)).to(dtype)


def read_blocks(pool: torch.Tensor, scales: torch.Tensor | None, block_size: int, blocks: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """These blocks of one layer's `pool` ((2, KVH, slots, D); `blocks` int64 on its device), gathered ->
    (2, KVH, len(blocks), block_size, D): as stored, or for a quantized pool (`scales` (2, KVH, slots))
    dequantized to `dtype`."""
    kv = pool.unflatten(2, (-1, block_size)).index_select(2, blocks)
    if scales is None:
        return kv
    return dequantize_kv(kv, scales.unflatten(2, (-1, block_size)).index_select(2, blocks), dtype)


# -- attention inside a compiled forward pass (orca/worker/compiled.py) ----------------------------------
# torch.compile turns the model's forward pass into one graph whatever the iteration's composition: every
# op but attention runs on the flat [T, hidden] batch and depends on T only. Attention depends on the
# iteration's layout (requests, lengths, blocks: Python lists the per-request split reads), so inside the
# graph it is one opaque op, orca::selective_attention, that takes only tensors and the layer's constants;
# the layout is the iteration's AttentionMetadata, which the worker puts in scope around the call (as
# vLLM's forward context does for its compiled graphs). The op runs the same selective_attention as the
# eager model, keys and values written into the pool included.
_scope = threading.local()


@contextlib.contextmanager
def iteration_scope(meta: AttentionMetadata) -> Iterator[None]:
    """The iteration whose layout orca::selective_attention reads, for the duration of a compiled call
    (on this thread)."""
    _scope.meta = meta
    try:
        yield
    finally:
        _scope.meta = None


def _attention_op(q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float, window: int | None) -> torch.Tensor:
    meta = getattr(_scope, "meta", None)
    if meta is None:
        raise RuntimeError("orca::selective_attention ran outside iteration_scope: it has no iteration layout")
    return _write_and_attend(q, kv, meta, layer, scale, window).contiguous()


def _attention_shape(q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float, window: int | None) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # (T, H * D), as selective_attention returns


_OPS = torch.library.Library("orca", "FRAGMENT")
_OPS.define("selective_attention(Tensor q, Tensor kv, int layer, float scale, int? window) -> Tensor")
_OPS.impl("selective_attention", _attention_op, "CompositeExplicitAutograd")
torch.library.register_fake("orca::selective_attention", _attention_shape, lib=_OPS)
