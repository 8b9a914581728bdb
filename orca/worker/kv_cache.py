"""The K/V pool (Orca §3's K/V manager, paged): preallocated once, never reallocated, never copied.

One tensor holds every layer's keys and values for ``num_blocks`` blocks of ``block_size`` slots:

    pool: (num_layers, 2 (k, v), num_kv_heads, num_blocks * block_size, head_dim)

Slot ``s`` = ``block * block_size + offset`` is one token. Heads come before slots so that a request whose
blocks are consecutive reads its keys as the view ``pool[layer, 0, :, s0:s1]`` ([KVH, n, D], the layout
attention consumes) without a copy; other requests are gathered. An iteration writes its new keys and
values with one scatter per layer (orca/models/attention/). Which blocks belong to whom is the driver's
business (orca/core/block_manager.py); the worker only follows the block tables the plans send.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Shape of one slot (one token's keys and values in every layer) and of one block."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_slot(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_slot * self.block_size

    def blocks_for_budget(self, budget_bytes: int) -> int:
        """How many whole blocks fit in a memory budget."""
        return budget_bytes // self.bytes_per_block

    def allocate(self, num_blocks: int, device: torch.device, zeroed: bool = False) -> torch.Tensor:
        """The pool. Uninitialised unless `zeroed`: the reference attention reads only slots this pool's
        iterations wrote, the batched one only blocks the worker zeroed when it handed them out
        (zero_blocks), and on a CPU untouched pages cost no memory until a request's tokens land there.
        The flex backend needs it zeroed: its kernels weigh every slot of a tile they visit, the masked
        ones by 0, and 0 times a NaN left in unwritten memory is NaN."""
        shape = (self.num_layers, 2, self.num_kv_heads, num_blocks * self.block_size, self.head_dim)
        return (torch.zeros if zeroed else torch.empty)(shape, dtype=self.dtype, device=device)

    def zero_blocks(self, pool: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Zeroes these blocks in every layer (block_ids: int64 on the pool's device). For the backends that
        read whole blocks (batched, flex): the slots of a request's last block past its length weigh 0 in
        its attention, and must hold no NaN or inf, which another request's tokens could have left there."""
        pool.unflatten(3, (-1, self.block_size)).index_fill_(3, block_ids, 0)


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
