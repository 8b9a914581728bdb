"""attention_backend ``flex``: one ``flex_attention`` call per layer for every token of the iteration,
reading keys and values straight from the whole pool, so shapes depend only on the token count (what CUDA
graphs need). A mask keeps each query's request's blocks up to its position (and window); the block-sparse
structure (FlexLayout, flex_layout.py) skips blocks no query of a tile needs. Compiled with dynamic token
counts on CUDA and warmed up at load; PyTorch's unfused implementation on a CPU. When `auto` picks it:
orca/worker/resolution.py. On CUDA, iterations of at most VERIFYING_MAX_ROWS rows per request run the
paged decode kernel (paged_decode.py) instead (docs/BENCHMARKS.md, "The paged decode kernel"). The pool is
zeroed and blocks are zeroed when handed out (masked slots weigh 0; 0 x NaN would poison a row). A
quantized pool is read as is by the paged kernel, and gathered and dequantized per layer into a compact
pool (compact_blocks) for flex_attention.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from orca import tuning
from orca.models.attention.base import AttentionMetadata, PhaseTimer, read_blocks, token_slots
from orca.models.attention.flex_layout import FLEX_KV_BLOCK, FLEX_Q_BLOCK, FlexLayout, compact_blocks
from orca.models.attention.paged_decode import paged_decode_attention
from orca.models.device import upload
from orca.models.quantization import FP8_MIN_CAPABILITY

# Inductor lowers flex_attention to its decoding kernel below this many query rows (a guard on the row count).
FLEX_DECODING_ROWS = 128
FLEX_RECOMPILE_LIMIT = 64  # graphs of compiled flex_attention per process (see _flex_function)
# Inductor's flex kernels' least head dimension; the worker refuses flex on CUDA below it, at load.
FLEX_MIN_HEAD_DIM = 16


def takes_paged_decode(device: torch.device, lengths: Sequence[int]) -> bool:
    """Whether an iteration whose requests feed `lengths` rows attends with the paged decode kernel (on
    CUDA, at most tuning.VERIFYING_MAX_ROWS rows each) rather than flex_attention, whose packed query tiles
    read every block of every request in them."""
    return device.type == "cuda" and 0 < max(lengths, default=0) <= tuning.VERIFYING_MAX_ROWS


@dataclass(kw_only=True)
class FlexMetadata(AttentionMetadata):
    """The iteration's slots and its FlexLayout (`flex`), which every layer's call reads."""

    name = "flex"
    zeroed_pool = True
    reads_whole_blocks = True
    cuda_graphs = True
    # On CUDA (resolution.py refuses the rest at load): inductor's least head dimension; a float8 e4m3 pool
    # from the compute capability Triton converts float8 at.
    cuda_min_head_dim = FLEX_MIN_HEAD_DIM
    cuda_fp8_pool_min_capability = FP8_MIN_CAPABILITY
    # Dynamo specialises a few token counts (tests/test_attention_backend.py counts the graphs): after the
    # prompt and its increment, one tile of more than VERIFYING_MAX_ROWS rows, more than two tiles, and
    # more than FLEX_DECODING_ROWS.
    warm_up_rows = (tuning.VERIFYING_MAX_ROWS + 1, 2 * FLEX_Q_BLOCK + 1, FLEX_DECODING_ROWS + 1)

    flex: FlexLayout = field()  # (required: the base's None is for the other backends)
    # A quantized pool's flex_attention iteration: the pool blocks its tables number 0, 1, ... (compact_blocks).
    gather_blocks: torch.Tensor | None = None

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
        """Padding rows write to `pad_slot` and attend to nothing. A quantized pool (`kv_scales`) is read as
        is by the paged kernel, dequantized (compact_blocks) by flex_attention."""
        slots: list[int] = []
        for n, past, table in zip(lengths, context_lens, block_tables):
            slots.extend(token_slots(table, block_size, past, past + n))
        slots.extend([pad_slot] * padding)
        device = kv_pool.device
        paged, gather_blocks, num_slots = takes_paged_decode(device, lengths), None, kv_pool.shape[3]
        if kv_scales is not None and not paged:
            used, block_tables = compact_blocks(lengths, context_lens, block_tables, block_size)
            gather_blocks, num_slots = upload(used, torch.int64, device), len(used) * block_size
        layout = FlexLayout.build(lengths, context_lens, block_tables, block_size, num_slots, device, padding,
                                  paged=paged)
        return cls(slot_mapping=upload(slots, torch.int64, device), kv_pool=kv_pool, kv_scales=kv_scales,
                   timer=timer, flex=layout, gather_blocks=gather_blocks)

    def attend(self, q: torch.Tensor, pool: torch.Tensor, scale: float, window: int | None,
               scales: torch.Tensor | None = None) -> torch.Tensor:
        """One flex_attention call over this layer's `pool` (new keys and values written), or one paged
        decode kernel launch for a paged layout. `scales`: this layer's, for a quantized pool."""
        num_tokens, num_heads, head_dim = q.shape
        layout = self.flex
        if layout.paged:
            out = paged_decode_attention(q, pool, layout.q_request, layout.q_position, layout.tables,
                                         layout.block_size, scale, window, scales=scales)
            return out.reshape(num_tokens, num_heads * head_dim)
        if scales is not None:  # the iteration's blocks of this layer, dequantized, as compact_blocks numbers them
            pool = read_blocks(pool, scales, layout.block_size, self.gather_blocks, q.dtype).flatten(2, 3)
        options = {"BLOCK_M": FLEX_Q_BLOCK, "BLOCK_N": FLEX_KV_BLOCK} if q.device.type == "cuda" else None
        with warnings.catch_warnings():  # the unfused CPU path warns that it is unfused, at every call
            warnings.simplefilter("ignore", UserWarning)
            out = _flex_function(q.device.type)(
                q.transpose(0, 1)[None], pool[0][None], pool[1][None], block_mask=layout.block_mask(window),
                scale=scale, enable_gqa=num_heads != pool.shape[1], kernel_options=options,
            )  # (1, H, T, D)
        return out[0].transpose(0, 1).reshape(num_tokens, num_heads * head_dim)

    @classmethod
    def compiles_at_load(cls, device: torch.device) -> bool:
        return device.type == "cuda"

    @classmethod
    def device_warning(cls, device: torch.device) -> str | None:
        if device.type == "cuda":
            return None
        return (f"attention_backend flex on {device} runs PyTorch's unfused flex_attention, which evaluates its "
                "mask over the whole K/V pool at every layer: correct, slow (reference is the fast choice here)")

    @classmethod
    def graph_buffers(cls, kv_pool: torch.Tensor, block_size: int, pad_slot: int, rows: int,
                      max_blocks: int, kv_scales: torch.Tensor | None = None) -> AttentionMetadata:
        """An all-padding layout of `rows` rows of up to `max_blocks` blocks each; every size reads its head."""
        device = kv_pool.device
        paged = takes_paged_decode(device, [1])
        if kv_scales is not None and not paged:
            raise ValueError("static buffers over a quantized pool are paged only (the paged decode kernel)")
        return cls(
            slot_mapping=torch.full((rows,), pad_slot, dtype=torch.int64, device=device), kv_pool=kv_pool,
            kv_scales=kv_scales, flex=FlexLayout.static(rows, max_blocks, block_size, kv_pool.shape[3], device,
                                                        paged=paged),
        )

    def head(self, num_tokens: int) -> AttentionMetadata:
        return FlexMetadata(slot_mapping=self.slot_mapping[:num_tokens], kv_pool=self.kv_pool,
                            kv_scales=self.kv_scales, flex=self.flex.head(num_tokens))

    def copy_(self, other: AttentionMetadata) -> None:
        self.slot_mapping.copy_(other.slot_mapping, non_blocking=True)
        self.flex.copy_(other.flex)


@functools.cache
def _flex_function(device_type: str) -> Callable:
    """flex_attention as it runs on this device: compiled on CUDA (dynamic token counts, warmed up at
    load), PyTorch's unfused implementation elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        return compile_flex()
    return flex_attention


def compile_flex(backend: str | Callable = "inductor") -> Callable:
    """flex_attention compiled as CUDA runs it: every size dynamic, traced without duck sizing (which tied
    the compact pool's changing length to a view's offset and recompiled: tests/test_attention_backend.py).
    `backend`: the tests count dynamo's graphs with one of their own (under the same recompile limit)."""
    import torch._dynamo
    import torch.fx.experimental._config as fx_config
    from torch.nn.attention.flex_attention import flex_attention

    # Specialised shapes, windows and models add graphs: past dynamo's default limit of 8 it silently runs
    # flex unfused (minutes per iteration, and no CUDA graph capture).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, FLEX_RECOMPILE_LIMIT)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           4 * FLEX_RECOMPILE_LIMIT)
    compiled = torch.compile(flex_attention, backend=backend, dynamic=True)

    def call(*args: Any, **kwargs: Any) -> torch.Tensor:
        # Set and restored by hand: config.patch is slower.
        duck = fx_config.use_duck_shape
        fx_config.use_duck_shape = False
        try:
            return compiled(*args, **kwargs)
        finally:
            fx_config.use_duck_shape = duck

    return call
