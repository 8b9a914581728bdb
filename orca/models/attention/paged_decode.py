"""Paged attention for decode iterations on CUDA: a Triton kernel that reads each query row's keys and
values straight from the pool through its request's block table, a program per (row, K/V head, split).

Why its own kernel: flex_attention's packed query tiles read and mask every block of every request in
them (docs/BENCHMARKS.md, "The paged decode kernel"), and PyTorch has no paged attention op. A program
loads the row's query heads sharing K/V head h (padded to a tl.dot tile) and walks the row's positions in
tiles of BLOCK_N slots with an online softmax; with `splits` > 1 a second kernel combines the shares
(flash decoding). The split count depends only on the row count and the GPU, so a CUDA graph captures one
launch configuration. Rows at position -1 (padding) come out as zeros. A quantized pool is read as stored,
its scales applied to scores and weights. Tested under TRITON_INTERPRET=1 (tests/test_paged_decode.py).
"""

from __future__ import annotations

import functools
import math

import torch

BLOCK_N = 64  # pool slots per tile of a program's loop
MIN_DOT = 16  # tl.dot's smallest tile side: the query heads of a K/V head and the head dimension pad to it
MAX_SPLITS = 16
NUM_WARPS = 4


def num_splits(rows: int, kv_heads: int, device: torch.device) -> int:
    """How many shares of its positions each (row, K/V head) pair is split into: enough programs for two
    per streaming multiprocessor, at most MAX_SPLITS, 1 when the pairs alone fill the GPU."""
    if device.type != "cuda":
        return 1 if rows * kv_heads >= 64 else min(MAX_SPLITS, 4)
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(MAX_SPLITS, -(-2 * sms // max(1, rows * kv_heads))))


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def paged_decode_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    q_request: torch.Tensor,
    q_position: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None,
    splits: int | None = None,
    block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (T, H, D) over one layer's `pool` (2, KVH, slots, D): row t reads request q_request[t]'s blocks
    (its row of `tables`, (requests, width)) at positions up to q_position[t] (and within `window`) ->
    (T, H, D) in q's dtype. `scales`: a quantized pool's (2, KVH, slots) float32. `splits`, `block_n` (a
    power of 2, at least 16) and `num_warps`: the launch's; by default num_splits' and the module's."""
    num_rows, num_heads, head_dim = q.shape
    kv_heads = pool.shape[1]
    group = num_heads // kv_heads
    if num_heads % kv_heads or pool.shape[3] != head_dim:
        raise ValueError(f"{num_heads} query heads of {head_dim} over {kv_heads} K/V heads of {pool.shape[3]}")
    if scales is not None and (scales.shape != pool.shape[:3] or scales.stride(2) != 1):
        raise ValueError(f"scales of shape {tuple(scales.shape)} (slots strided {scales.stride(2)}) do not "
                         f"match a pool of {tuple(pool.shape[:3])} slots, one apart")
    if scales is None and pool.dtype.itemsize == 1:  # int8 or float8 values
        raise ValueError(f"a pool of {pool.dtype} needs its scales")
    splits = splits or num_splits(num_rows, kv_heads, q.device)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits {splits} is outside [1, {MAX_SPLITS}]")
    if block_n < MIN_DOT or block_n & (block_n - 1):
        raise ValueError(f"block_n {block_n} is not a power of 2 of at least {MIN_DOT}")
    if q.stride(2) != 1:  # the kernel steps through a head's values one element apart (the pool's are)
        q = q.contiguous()
    out = torch.empty((num_rows, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_rows == 0:
        return out
    keys, values = pool[0], pool[1]
    key_scales, value_scales = (keys, values) if scales is None else (scales[0], scales[1])  # (unread if None)
    block_g = max(MIN_DOT, _next_power_of_2(group))
    block_d = max(MIN_DOT, _next_power_of_2(head_dim))
    # Dots on float32 tiles: exact for bf16/fp16 values under tf32, and Triton's CPU interpreter computes
    # 16-bit dots wrongly (triton 3.9).
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    stage, combine = _kernels()
    log2_scale = scale * math.log2(math.e)
    # One compilation per kernel whatever the split count (a launch argument); one split writes no partials.
    shape = (splits, num_rows, num_heads, head_dim) if splits > 1 else (1, 1, 1, 1)
    acc = torch.empty(shape, dtype=torch.float32, device=q.device)
    maxes = torch.empty(shape[:3], dtype=torch.float32, device=q.device)  # (a tensor each: both 16-byte aligned,
    sums = torch.empty(shape[:3], dtype=torch.float32, device=q.device)  # as Triton's specialisation assumes)
    stage[(num_rows, kv_heads, splits)](
        q, keys, values, key_scales, value_scales, q_request, q_position, tables,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        key_scales.stride(0), value_scales.stride(0), tables.stride(0),
        block_size, window or 0, log2_scale, group, head_dim, splits,
        out, out.stride(0), out.stride(1), acc, maxes, sums, acc.stride(0), acc.stride(1), acc.stride(2),
        maxes.stride(0), maxes.stride(1),
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, PRECISION=precision, QUANTIZED=scales is not None,
        num_warps=num_warps,
    )
    if splits > 1:
        combine[(num_rows, num_heads)](
            acc, maxes, sums, out, splits, acc.stride(0), acc.stride(1), acc.stride(2), maxes.stride(0),
            maxes.stride(1), out.stride(0), out.stride(1), head_dim,
            BLOCK_S=_next_power_of_2(MAX_SPLITS), BLOCK_D=block_d, num_warps=num_warps,
        )
    return out


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _kernels():  # noqa: ANN202 - two triton.JITFunction
    """The stage and combine kernels, imported at first use: only CUDA and the tests need Triton (whose
    interpreter mode is fixed at import: tests/test_paged_decode.py runs it in its own process)."""
    from orca.models.attention import paged_decode_kernels

    return paged_decode_kernels.stage, paged_decode_kernels.combine
