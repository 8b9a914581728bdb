"""The K/V pool (Orca §3's K/V manager, paged): preallocated once, never reallocated, never copied.

One tensor holds every layer's keys and values for ``num_blocks`` blocks of ``block_size`` slots:

    pool: (num_layers, 2 (k, v), num_kv_heads, num_blocks * block_size, head_dim)

Slot ``s`` = ``block * block_size + offset`` is one token. Heads come before slots so that a request whose
blocks are consecutive reads its keys as the view ``pool[layer, 0, :, s0:s1]`` ([KVH, n, D], the layout
attention consumes) without a copy; other requests are gathered. An iteration writes its new keys and
values with one scatter per layer (orca/models/attention/). Which blocks belong to whom is the driver's
business (orca/core/block_manager.py); the worker only follows the block tables the plans send.

Quantized (EngineConfig.kv_cache_dtype fp8_e4m3 or int8): the pool tensor holds float8 e4m3 or int8
values, same shape, and a second tensor beside it holds their scales, one float32 per token and K/V head:

    scales: (num_layers, 2 (k, v), num_kv_heads, num_blocks * block_size)

Symmetric: a token's head of keys (or values) x is stored as x / scale with scale = amax(|x|) / 448 (the
largest float8 e4m3) or / 127 (int8, rounded), and read back as value x scale (quantize_kv, dequantize_kv
in orca/models/attention/base.py). The scatter that writes an iteration's keys and values quantizes them;
attention dequantizes what it reads, to the model's dtype. A slot costs 2 x num_kv_heads x (head_dim + 4)
bytes per layer instead of 2 x num_kv_heads x head_dim x 2 (bfloat16) or x 4 (float32): at head_dim 64,
1.9x (bfloat16) or 3.8x (float32) the tokens in the same bytes. The scales travel with the pool: the
worker's ``kv_scales`` beside its ``kv_pool``, AttentionMetadata's ``kv_scales`` beside ``kv_pool`` (None
for an unquantized pool, whose path is unchanged).

Every attention backend reads it (flex: its paged decode kernel as it is, flex_attention over the
iteration's blocks dequantized; orca/models/attention/flex.py). What dequantizing costs on a CPU: torch
converts float8 to float32 one element at a time (~5-6 ns each here, 15-18x int8's conversion), so the
attention of a decode iteration (8 increments of 64-176 tokens, 4 layers, head_dim 32, 1 thread) took 5.4 ms
over fp8_e4m3 against 1.5 ms over int8 and 0.93 ms over float32, and a whole decode step of that 4-layer
model 11.0, 7.4 and 6.6 ms (the fastest of 200). int8 is the CPU's choice; float8 is for CUDA (not measured yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orca.config import KV_CACHE_DTYPES
from orca.models.attention.base import KV_QUANTIZED_MAX

# EngineConfig.kv_cache_dtype's quantized values: the dtype of the pool's values.
KV_QUANTIZED_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
KV_SCALE_DTYPE = torch.float32


def resolve_kv_cache_dtype(choice: str, model_dtype: torch.dtype) -> torch.dtype:
    """EngineConfig.kv_cache_dtype to the dtype of the pool's values: "auto" the model's; fp8_e4m3 and int8
    their own, with scales (KVLayout.quantized). Every attention backend reads a quantized pool."""
    if choice not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {choice!r}")
    if choice == "auto":
        return model_dtype
    return KV_QUANTIZED_DTYPES[choice]


@dataclass(frozen=True)
class KVLayout:
    """Shape of one slot (one token's keys and values in every layer) and of one block. `dtype` is the
    pool's: the model's, or float8_e4m3fn / int8 for a quantized pool (`quantized`: with its scales)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @property
    def quantized(self) -> bool:
        return self.dtype in KV_QUANTIZED_MAX

    @property
    def bytes_per_slot(self) -> int:
        """The values, and the scales of a quantized pool."""
        per_head = self.head_dim * self.dtype.itemsize + (KV_SCALE_DTYPE.itemsize if self.quantized else 0)
        return self.num_layers * 2 * self.num_kv_heads * per_head

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_slot * self.block_size

    def blocks_for_budget(self, budget_bytes: int) -> int:
        """How many whole blocks fit in a memory budget."""
        return budget_bytes // self.bytes_per_block

    def allocate(self, num_blocks: int, device: torch.device, zeroed: bool = False) -> torch.Tensor:
        """The pool (its values, when quantized). Uninitialised unless `zeroed`: the reference attention
        reads only slots this pool's iterations wrote, the batched one only blocks the worker zeroed when it
        handed them out (zero_blocks), and on a CPU untouched pages cost no memory until a request's tokens
        land there. The flex backend needs it zeroed: its kernels weigh every slot of a tile they visit,
        the masked ones by 0, and 0 times a NaN left in unwritten memory is NaN."""
        shape = (self.num_layers, 2, self.num_kv_heads, num_blocks * self.block_size, self.head_dim)
        return (torch.zeros if zeroed else torch.empty)(shape, dtype=self.dtype, device=device)

    def allocate_scales(self, num_blocks: int, device: torch.device, zeroed: bool = False) -> torch.Tensor | None:
        """A quantized pool's scales (uninitialised unless `zeroed`, as allocate); None for an unquantized
        pool."""
        if not self.quantized:
            return None
        shape = (self.num_layers, 2, self.num_kv_heads, num_blocks * self.block_size)
        return (torch.zeros if zeroed else torch.empty)(shape, dtype=KV_SCALE_DTYPE, device=device)

    def zero_blocks(self, pool: torch.Tensor, block_ids: torch.Tensor, scales: torch.Tensor | None = None) -> None:
        """Zeroes these blocks in every layer (block_ids: int64 on the pool's device), and their scales. For
        the backends that read whole blocks (batched, flex): the slots of a request's last block past its
        length weigh 0 in its attention, and must hold no NaN or inf, which another request's tokens (or
        unwritten memory: a float8 NaN, a float32 scale) could have left there. A quantized pool is zeroed
        as bytes (CPU torch has no index_fill_ for float8)."""
        if self.quantized:
            pool = pool.view(torch.uint8)
        pool.unflatten(3, (-1, self.block_size)).index_fill_(3, block_ids, 0)
        if scales is not None:
            scales.unflatten(3, (-1, self.block_size)).index_fill_(3, block_ids, 0)


def blocks_from_gpu_memory(
    total_bytes: int, used_after_profile_bytes: int, utilization: float, bytes_per_block: int
) -> int:
    """Blocks for the K/V pool on a GPU, vLLM's way: the pool gets what is left of ``utilization`` x the
    device's memory once the weights and the peak activations of the largest iteration (measured by a
    profiling forward pass: ``used_after_profile_bytes``) are placed."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    available = int(total_bytes * utilization) - used_after_profile_bytes
    return max(0, available // bytes_per_block)
