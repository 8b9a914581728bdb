"""The K/V pool (Orca §3's K/V manager, paged): preallocated once, never reallocated, never copied.

One tensor holds every layer's keys and values for ``num_blocks`` blocks of ``block_size`` slots:

    pool: (num_layers, 2 (k, v), num_kv_heads, num_blocks * block_size, head_dim)

Slot ``s`` = ``block * block_size + offset`` is one token. Heads come before slots so that consecutive
blocks read as the view ``pool[layer, 0, :, s0:s1]`` ([KVH, n, D]) without a copy. Which blocks belong to
whom is the driver's (orca/core/block_manager.py); the worker follows the plans' block tables.

Quantized (kv_cache_dtype fp8_e4m3 or int8): the same shape of float8 e4m3 or int8 values, and beside it
one float32 scale per token and K/V head (symmetric; quantize_kv and dequantize_kv in
orca/models/attention/base.py):

    scales: (num_layers, 2 (k, v), num_kv_heads, num_blocks * block_size)

int8 is the CPU's choice (torch converts float8 slowly there); float8 is for CUDA.
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
        """The pool (its values, when quantized). Uninitialised unless `zeroed` (the flex backend's need:
        its kernels weigh masked slots by 0, and 0 x NaN is NaN); on a CPU untouched pages cost no memory."""
        shape = (self.num_layers, 2, self.num_kv_heads, num_blocks * self.block_size, self.head_dim)
        return (torch.zeros if zeroed else torch.empty)(shape, dtype=self.dtype, device=device)

    def allocate_scales(self, num_blocks: int, device: torch.device, zeroed: bool = False) -> torch.Tensor | None:
        """A quantized pool's scales (uninitialised unless `zeroed`); None for an unquantized pool."""
        if not self.quantized:
            return None
        shape = (self.num_layers, 2, self.num_kv_heads, num_blocks * self.block_size)
        return (torch.zeros if zeroed else torch.empty)(shape, dtype=KV_SCALE_DTYPE, device=device)

    def zero_blocks(self, pool: torch.Tensor, block_ids: torch.Tensor, scales: torch.Tensor | None = None) -> None:
        """Zeroes these blocks (block_ids: int64 on the pool's device) and their scales in every layer, for
        the backends that read whole blocks: masked slots must hold no NaN or inf. Zeroed as bytes for a
        quantized pool (CPU torch has no index_fill_ for float8)."""
        if self.quantized:
            pool = pool.view(torch.uint8)
        pool.unflatten(3, (-1, self.block_size)).index_fill_(3, block_ids, 0)
        if scales is not None:
            scales.unflatten(3, (-1, self.block_size)).index_fill_(3, block_ids, 0)


def blocks_from_gpu_memory(
    total_bytes: int, used_after_profile_bytes: int, utilization: float, bytes_per_block: int
) -> int:
    """Blocks for the K/V pool on a GPU, vLLM's way: what is left of ``utilization`` x the device's memory
    once the weights and the profiled peak activations (``used_after_profile_bytes``) are placed."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    available = int(total_bytes * utilization) - used_after_profile_bytes
    return max(0, available // bytes_per_block)
