"""What every attention backend shares: the interface the model layers and the worker see.

``AttentionMetadata`` is the iteration's layout, passed to every layer; each backend (reference.py,
batched.py, flex.py) subclasses it, registers under its ``attention_backend`` name, and declares in class
attributes what it needs of the pool and the load. ``selective_attention`` writes the iteration's keys and
values into the pool (one scatter, quantized for a quantized pool) and runs the backend's ``attend``.
``IterationLayout`` is the requests over the pool, from which a runner builds the metadata when needed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

_BACKENDS: dict[str, type[AttentionMetadata]] = {}

# Quantized pool value dtypes and the magnitude a head's largest entry is scaled to (int8: -128 unused).
KV_QUANTIZED_MAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
# The smallest scale written, so an all-zero head does not divide 0 by 0.
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
    """An iteration's requests over the pool, increments first: request i feeds `lengths[i]` new tokens
    after `context_lens[i]` cached ones, in `block_tables[i]`; with `padded_to`, padding rows follow up to
    that many rows (a CUDA graph's size). `metadata()` builds the backend's metadata once, on first use."""

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

    Rows are laid out increments first (one token each after a cached prefix), then the other requests'.
    `slot_mapping` is each token row's pool slot; subclasses add what only their backend reads.
    """

    slot_mapping: torch.Tensor  # (T,) int64
    kv_pool: torch.Tensor  # (layers, 2, KVH, slots, D): the model's dtype, or a quantized pool's values
    kv_scales: torch.Tensor | None = None  # (layers, 2, KVH, slots) float32: a quantized pool's scales
    timer: PhaseTimer | None = None

    # -- the backend's traits (class attributes; the worker reads them at load and per iteration) ------------
    name: ClassVar[str]  # the attention_backend value that selects this backend
    # The pool must be allocated zeroed (the backend weighs unwritten slots by 0).
    zeroed_pool: ClassVar[bool] = False
    # Reads whole blocks, masked past a request's length: the worker zeroes each block it hands out, so no
    # NaN an earlier request left reaches a result (0 x NaN).
    reads_whole_blocks: ClassVar[bool] = False
    # The CPU graphs (orca/worker/cpu_graphs/) may run with it, its write_and_attend as one opaque op.
    in_compiled_forward: ClassVar[bool] = False
    # Shapes depend on the token count only, so padded decode iterations can replay a CUDA graph.
    cuda_graphs: ClassVar[bool] = False
    # On CUDA: the least head_dim its kernels take; the compute capability a float8 e4m3 pool needs (None: any).
    cuda_min_head_dim: ClassVar[int] = 0
    cuda_fp8_pool_min_capability: ClassVar[tuple[int, int] | None] = None
    # Where compiles_at_load: the token rows of the iterations that compile its kernels at load.
    warm_up_rows: ClassVar[tuple[int, ...]] = ()

    # Which path an iteration took, for the tests (flex.py's layout, batched.py's increments).
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
        """The iteration's metadata for resolved `backend` ("reference", "batched" or "flex")."""
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
        ones, in block_tables[i]; increments come first. `padding` rows follow (cuda_graphs backends only),
        each writing to `pad_slot`, a slot no request owns, and attending to nothing. `kv_scales`: a
        quantized pool's scales (None: `kv_pool` holds the model's dtype)."""
        raise NotImplementedError

    def attend(
        self, q: torch.Tensor, pool: torch.Tensor, scale: float, window: int | None,
        scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One layer's attention: q (T, H, D) over this layer's `pool` (2, KVH, slots, D), new keys and
        values already written -> (T, H * D). `scales`: (2, KVH, slots) for a quantized pool, else None."""
        raise NotImplementedError

    def write_and_attend(self, q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float,
                         window: int | None) -> torch.Tensor:
        """Writes the iteration's keys and values into their slots (one scatter), then attends."""
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
        """Whether the worker runs warm_up_rows' iterations at load, to compile kernels before a request."""
        return False

    @classmethod
    def device_warning(cls, device: torch.device) -> str | None:
        """What the worker logs as a warning when this backend runs on `device`; None: nothing to say."""
        return None

    # -- CUDA graphs (cuda_graphs backends) --------------------------------------------------------------
    @classmethod
    def graph_buffers(cls, kv_pool: torch.Tensor, block_size: int, pad_slot: int, rows: int,
                      max_blocks: int, kv_scales: torch.Tensor | None = None) -> AttentionMetadata:
        """Metadata of `rows` padding rows over static buffers that a captured graph reads (filled per
        iteration by copy_, sized by head). A request holds at most `max_blocks` blocks."""
        raise NotImplementedError(f"attention backend {cls.name} has no fixed shapes for CUDA graphs")

    def head(self, num_tokens: int) -> AttentionMetadata:
        """The metadata of this one's first `num_tokens` rows, sharing its tensors (views)."""
        raise NotImplementedError(f"attention backend {self.name} has no fixed shapes for CUDA graphs")

    def copy_(self, other: AttentionMetadata) -> None:
        """Copies `other`'s values (same token count, same pool) into this metadata's tensors, in place."""
        raise NotImplementedError(f"attention backend {self.name} has no fixed shapes for CUDA graphs")


def token_slots(table: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """Pool slots of token positions [start, end) for a request with this block table."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def leading_increments(lengths: Sequence[int], context_lens: Sequence[int], most: int = 1) -> int:
    """How many requests, from the first, are increments: up to `most` tokens after a cached prefix
    (more than one: a speculating request verifying its proposals)."""
    count = 0
    while count < len(lengths) and 1 <= lengths[count] <= most and context_lens[count] > 0:
        count += 1
    return count


class LayerAttention(Protocol):
    """What a layer's attention call reads: an AttentionMetadata, or a compiled graph's stand-in for one."""

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
    symmetric, scale = amax(|x|) / KV_QUANTIZED_MAX[dtype], so x ~ values x scale. Computed in float32."""
    x = x.float()
    scales = (x.abs().amax(-1) / KV_QUANTIZED_MAX[dtype]).clamp_min(KV_MIN_SCALE)
    scaled = x / scales.unsqueeze(-1)
    if dtype == torch.int8:
        scaled = scaled.round()
    return scaled.to(dtype), scales


def dequantize_kv(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values (..., D) x scales (...,), in float32, as `dtype`. Float8 is converted first (torch does not
    promote it); int8 multiplies as is."""
    if values.dtype != torch.int8:
        values = values.float()
    return (values * scales.unsqueeze(-1)).to(dtype)


def read_blocks(pool: torch.Tensor, scales: torch.Tensor | None, block_size: int, blocks: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """These blocks of one layer's `pool` (2, KVH, slots, D), gathered -> (2, KVH, len(blocks),
    block_size, D); dequantized to `dtype` when `scales` (2, KVH, slots) is given."""
    kv = pool.unflatten(2, (-1, block_size)).index_select(2, blocks)
    if scales is None:
        return kv
    return dequantize_kv(kv, scales.unflatten(2, (-1, block_size)).index_select(2, blocks), dtype)
