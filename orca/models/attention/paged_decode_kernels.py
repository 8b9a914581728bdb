"""The Triton kernels of paged decode attention (paged_decode.py says what they do): `stage`, a program
per (query row, K/V head, split), and `combine`, which merges the splits. A module of its own, imported
only where they run: Triton's interpreter patches the language in the defining module's globals."""

import triton
import triton.language as tl


# Triton specialises integer arguments equal to 1 or multiples of 16: not those that change per iteration
# or layer, so one compilation serves every batch size and layer.
# QUANTIZED: K and V hold int8 or float8 values, KS and VS their float32 scales per slot and K/V head,
# applied to each score and each value's weight.
@triton.jit(do_not_specialize=["window", "splits", "stride_table", "stride_as", "stride_at", "stride_ah",
                               "stride_ss", "stride_st"])
def stage(Q, K, V, KS, VS, q_request, q_position, tables,
          stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_ksh, stride_vsh, stride_table,
          block_size, window, log2_scale, group, head_dim, splits,
          Out, stride_ot, stride_oh, Acc, Max, Sum, stride_as, stride_at, stride_ah, stride_ss, stride_st,
          BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
          QUANTIZED: tl.constexpr):
    row = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)  # x a head's stride: past int32 in a large pool
    split = tl.program_id(2)
    request = tl.load(q_request + row)
    position = tl.load(q_position + row)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g
    g_ok = g < group
    d_ok = d < head_dim
    q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    # The row's positions [low, position] (none for a padding row, position -1), in tiles of BLOCK_N
    low = tl.where(window > 0, tl.maximum(position - window + 1, 0), 0)
    first = low // BLOCK_N
    end = tl.where(position >= 0, position // BLOCK_N + 1, first)
    share = (end - first + splits - 1) // splits
    start = first + split * share
    stop = tl.minimum(start + share, end)
    running_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)
    for tile in range(start, stop):
        p = tile * BLOCK_N + n
        keep = (p >= low) & (p <= position)
        block = tl.load(tables + request * stride_table + p // block_size, mask=keep, other=0)
        slot = block.to(tl.int64) * block_size + p % block_size
        kv_ok = keep[:, None] & d_ok[None, :]
        k = tl.load(K + kv_head * stride_kh + slot[:, None] * stride_ks + d[None, :], mask=kv_ok,
                    other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * log2_scale  # (BLOCK_G, BLOCK_N), log2 units
        if QUANTIZED:
            s = s * tl.load(KS + kv_head * stride_ksh + slot, mask=keep, other=0.0)[None, :]
        s = tl.where(keep[None, :], s, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(s, 1))
        alpha = tl.exp2(running_max - new_max)
        weights = tl.exp2(s - new_max[:, None])
        running_sum = running_sum * alpha + tl.sum(weights, 1)
        v = tl.load(V + kv_head * stride_vh + slot[:, None] * stride_vs + d[None, :], mask=kv_ok,
                    other=0.0).to(tl.float32)
        if QUANTIZED:
            weights = weights * tl.load(VS + kv_head * stride_vsh + slot, mask=keep, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(weights, v, input_precision=PRECISION)
        running_max = new_max
    out_ok = g_ok[:, None] & d_ok[None, :]
    if splits == 1:  # the output; else this share's partial result, for `combine`
        result = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
        tl.store(Out + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 result.to(Out.dtype.element_ty), mask=out_ok)
    else:
        tl.store(Acc + split * stride_as + row * stride_at + heads[:, None] * stride_ah + d[None, :], acc,
                 mask=out_ok)
        at = split * stride_ss + row * stride_st + heads
        tl.store(Max + at, running_max, mask=g_ok)
        tl.store(Sum + at, running_sum, mask=g_ok)


@triton.jit(do_not_specialize=["splits", "stride_as", "stride_at", "stride_ah", "stride_ss", "stride_st"])
def combine(Acc, Max, Sum, Out, splits, stride_as, stride_at, stride_ah, stride_ss, stride_st,
            stride_ot, stride_oh, head_dim, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < splits
    at = s * stride_ss + row * stride_st + head
    maxes = tl.load(Max + at, mask=s_ok, other=float("-inf"))
    sums = tl.load(Sum + at, mask=s_ok, other=0.0)
    top = tl.max(maxes, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # no share read anything: a padding row
    weights = tl.where(s_ok, tl.exp2(maxes - top), 0.0)
    total = tl.sum(weights * sums, 0)
    parts = tl.load(Acc + s[:, None] * stride_as + row * stride_at + head * stride_ah + d[None, :],
                    mask=s_ok[:, None] & (d < head_dim)[None, :], other=0.0)
    result = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + row * stride_ot + head * stride_oh + d, result.to(Out.dtype.element_ty), mask=d < head_dim)
