"""A batched decode iteration's attention on the CPU, the batched backend's way against forms inside an
inductor graph: where its time goes and whether a graph would read the pool more cheaply.

SmolLM2's heads (9 query heads, 3 K/V heads, head size 64), bfloat16, 30 layers, the default pool's size
(2,912 blocks of 16 slots a layer: the pool far beyond the L3 cache, as in the engine, where the weights
stream through it between two layers' attention), `--rows` increments (default 32) with U(33, 190) cached
tokens each, their blocks scattered over the pool. Microseconds a layer, medians of 9 rounds:

- ``batched (write + attend)``: what the opaque attention op runs today (AttentionMetadata.write_and_attend:
  selective_attention's write, then BatchedMetadata.attend over groups built by BatchedMetadata.for_iteration);
- ``  its gathers alone``: read_blocks for each group (the padded copy of the rows' blocks);
- ``graph: gather + bmm``: one compiled function (dynamic sizes) gathering each row's blocks through its
  table inside the graph, two bmm calls and the softmax fused around them, the new keys beside the cached
  ones (as LoneDecode, orca/worker/cpu_graphs/decode_attention.py, does for one row), the pool written after
  every layer in one copy;
- ``graph: multiply + sum``: the same with LoneDecode's multiplies and sums instead of bmm.

    PYTHONPATH=. .venv/bin/python scripts/experiments/batched_attention_forms.py [--rows 32]

Not a test, not a benchmark of record: docs/BENCHMARKS.md quotes its output with the host.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from orca.models.attention.base import read_blocks
from orca.models.attention.batched import BatchedMetadata

LAYERS, KV_HEADS, GROUP, DIM, BLOCK, POOL_BLOCKS = 30, 3, 3, 64, 16, 2912
HEADS, SCALE = KV_HEADS * GROUP, DIM**-0.5


def graph_attend(q: torch.Tensor, kv: torch.Tensor, blocks: torch.Tensor, tables: torch.Tensor, past: torch.Tensor,
                 bmm: bool) -> torch.Tensor:
    """q (n, H, D), kv (n, 2, KVH, D) the new keys and values, blocks (2, KVH, pool blocks, block, D), tables
    (n, width) padded with each row's first block, past (n,) cached tokens -> (n, H * D)."""
    n, _, _ = q.shape
    width = tables.shape[1] * BLOCK
    cached = blocks[:, :, tables]  # (2, KVH, n, width / block, block, D)
    keys, values = cached[0].reshape(KV_HEADS * n, width, DIM), cached[1].reshape(KV_HEADS * n, width, DIM)
    qb = q.view(n, KV_HEADS, GROUP, DIM).transpose(0, 1).reshape(KV_HEADS * n, GROUP, DIM)
    if bmm:
        old = torch.bmm(qb, keys.transpose(1, 2)).float() * SCALE  # (KVH n, G, width)
    else:
        old = (qb.float()[:, :, None, :] * keys[:, None]).sum(-1) * SCALE
    beyond = (torch.arange(width)[None, :] >= past[:, None]).repeat(KV_HEADS, 1)[:, None, :]
    old = old.masked_fill(beyond, float("-inf"))
    new_k = kv[:, 0].transpose(0, 1).reshape(KV_HEADS * n, 1, DIM).float()
    new_v = kv[:, 1].transpose(0, 1).reshape(KV_HEADS * n, 1, DIM).float()
    own = (qb.float() * new_k).sum(-1, keepdim=True) * SCALE  # (KVH n, G, 1)
    top = torch.maximum(old.amax(-1, keepdim=True), own)
    w_old, w_own = torch.exp(old - top), torch.exp(own - top)
    if bmm:
        mixed = torch.bmm(w_old.to(q.dtype), values).float()
    else:
        mixed = (w_old[..., None] * values.masked_fill(beyond[:, 0, :, None], 0)[:, None]).sum(-2)
    out = (mixed + w_own * new_v) / (w_old.sum(-1, keepdim=True) + w_own)
    return out.to(q.dtype).view(KV_HEADS, n, GROUP, DIM).transpose(0, 1).reshape(n, HEADS * DIM)


def timed(f, reps: int = 5) -> float:  # type: ignore[no-untyped-def]
    f()
    rounds = []
    for _ in range(9):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        rounds.append((time.perf_counter() - t0) / reps / LAYERS * 1e6)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    n = parser.parse_args().rows
    rng = random.Random(n)
    torch.manual_seed(0)
    pool = torch.empty(LAYERS, 2, KV_HEADS, POOL_BLOCKS * BLOCK, DIM, dtype=torch.bfloat16).normal_()
    past = sorted(rng.randint(33, 190) for _ in range(n))
    free = list(range(POOL_BLOCKS))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(p + 1) // BLOCK))] for p in past]
    q = torch.randn(LAYERS, n, HEADS, DIM, dtype=torch.bfloat16)
    kv = torch.randn(LAYERS, n, 2, KV_HEADS, DIM, dtype=torch.bfloat16)
    meta = BatchedMetadata.for_iteration([1] * n, past, tables, BLOCK, pool)
    padded = torch.tensor([t + [t[0]] * (max(map(len, tables)) - len(t)) for t in tables])
    past_t = torch.tensor(past)
    slots = meta.slot_mapping
    blocks = pool.unflatten(3, (-1, BLOCK))
    forms = {}
    for name, bmm in (("gather + bmm", True), ("multiply + sum", False)):
        compiled = torch.compile(graph_attend, dynamic=True)

        def in_graph(compiled=compiled, bmm=bmm) -> None:  # type: ignore[no-untyped-def]
            for layer in range(LAYERS):
                compiled(q[layer], kv[layer], blocks[layer], padded, past_t, bmm)
            pool.index_copy_(3, slots, kv.permute(0, 2, 3, 1, 4))

        forms[f"graph: {name}"] = in_graph
    reference = meta.write_and_attend(q[0], kv[0], 0, SCALE, None).float()
    for name, bmm in (("gather + bmm", True), ("multiply + sum", False)):
        got = torch.compile(graph_attend, dynamic=True)(q[0], kv[0], blocks[0], padded, past_t, bmm).float()
        assert (got - reference).abs().max() < 0.05, f"{name} disagrees with the batched backend"
    print(f"{n} increments, cached tokens {min(past)}-{max(past)}, groups (rows, width): "
          f"{[(g.rows, g.width) for g in meta.increments]}; microseconds a layer:")

    def batched() -> None:
        for layer in range(LAYERS):
            meta.write_and_attend(q[layer], kv[layer], layer, SCALE, None)

    def gathers() -> None:
        for layer in range(LAYERS):
            for group in meta.increments:
                read_blocks(pool[layer], None, group.block_size, group.blocks, q.dtype)

    print(f"  batched (write + attend)   {timed(batched):7.1f}")
    print(f"    its gathers alone        {timed(gathers):7.1f}")
    for name, f in forms.items():
        print(f"  {name:26s} {timed(f):7.1f}", flush=True)


if __name__ == "__main__":
    main()
