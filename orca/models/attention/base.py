"""What every attention backend shares: the interface the model layers and the worker see.

- ``AttentionMetadata``: the iteration's layout, passed explicitly to every layer. Each backend is a
  subclass (its module: reference.py, batched.py, flex.py) holding what only it needs, built once per
  iteration by its own ``for_iteration`` and read at every layer by its own ``attend``; its class
  attributes tell the worker what the backend needs of the pool and of the load (zeroed memory, a
  compile warm-up, CUDA graphs, the compiled forward pass). A subclass registers under its ``name``, the
  ``attention_backend`` value that selects it (``get_backend``).
- ``selective_attention``: what a layer calls: the metadata's ``write_and_attend``, which writes the
  iteration's new keys and values into their slots of the pool (one scatter for every token of every
  request, the same for every backend), then runs the backend's ``attend`` over this layer's pool. A
  quantized pool (EngineConfig.kv_cache_dtype; orca/worker/kv_cache.py) has a second tensor, its scales
  (AttentionMetadata.kv_scales): the write quantizes (``quantize_kv``) and scatters values and scales
  alike, and ``attend`` gets this layer's scales, with which the backend dequantizes what it reads
  (``dequantize_kv``).
- ``IterationLayout``: the iteration's requests (lengths, cached tokens, block tables) over the pool, from
  which a runner (orca/worker/runners.py) builds the backend's metadata when it runs a path that reads it.
- ``PhaseTimer`` (profiling); the builders' shared helpers ``token_slots`` (pool slots of a request's
  positions) and ``leading_increments``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

_BACKENDS: dict[str, type[AttentionMetadata]] = {}

# A quantized K/V pool's value dtypes and the largest magnitude each holds: a token's head of keys (or
# values) is scaled so that its largest entry lands there (float8 e4m3's largest finite number; int8's
# symmetric range, -128 unused).
KV_QUANTIZED_MAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
# The smallest scale written: an all-zero head would otherwise divide 0 by 0. A normal float32 far below
# any key or value's magnitude / 448.
KV_MIN_SCALE = 2.0**-100


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


@dataclass
class IterationLayout:
    """An iteration's requests over the pool, as the worker planned them (increments first): request i feeds
    `lengths[i]` new tokens after `context_lens[i]` cached ones, its keys and values in `block_tables[i]`;
    with `padded_to`, padding rows follow up to that many rows (a CUDA graph's size). `metadata()` builds
    the backend's metadata from it once, when a path that reads it runs (a runner's own graphs read the
    layout instead)."""

    backend: type[AttentionMetadata]
    lengths: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    block_size: int
    kv_pool: torch.Tensor
    kv_scales: torch.Tensor | None = None
    timer: PhaseTimer | None = None
    padded_to: int | None = None
    pad_slot: int = 0  # (where padding rows write)
    _metadata: AttentionMetadata | None = None

    def metadata(self) -> AttentionMetadata:
        if self._metadata is None:
            padding = 0 if self.padded_to is None else self.padded_to - sum(self.lengths)
            self._metadata = self.backend.for_iteration(
                self.lengths, self.context_lens, self.block_tables, self.block_size, self.kv_pool, self.timer,
                padding=padding, pad_slot=self.pad_slot, kv_scales=self.kv_scales)
        return self._metadata


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
    # The CPU graphs (orca/worker/cpu_graphs/) may run with it, its write_and_attend as one opaque op.
    in_compiled_forward: ClassVar[bool] = False
    # Its tensors' shapes depend on the token count only: decode iterations padded to a size can replay a
    # CUDA graph (orca/worker/cuda_graphs.py: graph_buffers, head, copy_).
    cuda_graphs: ClassVar[bool] = False
    # On CUDA: the least head_dim its kernels take; the compute capability a float8 e4m3 pool needs (None: any).
    cuda_min_head_dim: ClassVar[int] = 0
    cuda_fp8_pool_min_capability: ClassVar[tuple[int, int] | None] = None
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

    def write_and_attend(self, q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float,
                         window: int | None) -> torch.Tensor:
        """selective_attention's work: writes the iteration's keys and values into their slots (one scatter
        for every token of every request), then attends over this layer's pool."""
        timer = self.timer
        if timer is not None:
            timer.sync()
            t0 = time.perf_counter()
        pool = self.kv_pool[layer]  # (2, KVH, slots, D)
        if self.kv_scales is None:
            pool.index_copy_(2, self.slot_mapping, kv.permute(1, 2, 0, 3))
            out = self.attend(q, pool, scale, window)
        else:  # a quantized pool: the values (as bytes: CPU torch has no float8 index_copy_) and their scales
            values, value_scales = quantize_kv(kv, pool.dtype)  # (T, 2, KVH, D), (T, 2, KVH)
            pool.view(torch.uint8).index_copy_(2, self.slot_mapping, values.view(torch.uint8).permute(1, 2, 0, 3))
            scales = self.kv_scales[layer]  # (2, KVH, slots)
            scales.index_copy_(2, self.slot_mapping, value_scales.permute(1, 2, 0))
            out = self.attend(q, pool, scale, window, scales)
        if timer is not None:
            timer.sync()
            timer.add("attention", time.perf_counter() - t0)
        return out

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


class LayerAttention(Protocol):
    """What a layer's attention call reads: an AttentionMetadata, or a runner's stand-in for one inside a
    compiled graph (orca/worker/cpu_graphs/)."""

    def write_and_attend(self, q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float,
                         window: int | None) -> torch.Tensor: ...


def selective_attention(
    q: torch.Tensor,  # (T, H, D): queries of all tokens of all requests
    kv: torch.Tensor,  # (T, 2, KVH, D): this iteration's new keys and values
    meta: LayerAttention,
    layer: int,
    scale: float,
    window: int | None = None,  # sliding window: a query sees its last `window` keys (itself included)
) -> torch.Tensor:  # (T, H * D)
    return meta.write_and_attend(q, kv, layer, scale, window)


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
