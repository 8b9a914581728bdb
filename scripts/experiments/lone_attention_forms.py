"""One decode row's attention inside an inductor graph, three ways of writing it, as the lone step's graph
runs it (CPUGraphs.lone, orca/worker/cpu_graphs/steps.py; LoneDecode, orca/worker/cpu_graphs/decode_attention.py):
SmolLM2's heads (9 query heads, 3 K/V heads, head size 64), bfloat16, 30 layers in one graph, the cached keys
read from a pool (as blocks of 16 slots) through a block table of consecutive blocks at an offset, their
number unbacked (the table's length; the last block's slots past them masked), each layer's new key and
value beside them.

- ``current``: LoneDecode.write_and_attend as shipped (multiplies and sums over (K/V head, group, blocks,
  block size, D), float32);
- ``keysmajor``: the same with the keys the outer dimension (the loops inductor parallelises);
- ``mm``: the new key and value concatenated to the cached ones, then two bmm calls and a softmax.

Printed: each form's largest difference from the shipped one's eager output, and its median microseconds
a layer (7 rounds of 50 calls). Not a test, not a benchmark of record: docs/BENCHMARKS.md quotes its output
with the command and the host.

    PYTHONPATH=. .venv/bin/python scripts/experiments/lone_attention_forms.py [KEYS]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch

from orca.worker.cpu_graphs.decode_attention import LoneDecode

LAYERS, KV_HEADS, GROUP, DIM, SLOTS, BLOCK, START_BLOCK = 30, 3, 3, 64, 8192, 16, 6


class KeysMajor(LoneDecode):
    def write_and_attend(self, q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float,
                         window: int | None) -> torch.Tensor:
        self.written.append(kv)
        keys, values = self.blocks[layer][:, :, self.table].flatten(2, 3).unbind(0)  # (KVH, n, D)
        beyond = torch.arange(keys.shape[1], device=q.device) >= self.past  # (n,): past the cached keys
        new = kv[0]
        qf = q.view(KV_HEADS, GROUP, DIM).float()
        old = (keys.transpose(0, 1).unsqueeze(2) * qf.unsqueeze(0)).sum(-1) * scale  # (n, KVH, G)
        old = old.masked_fill(beyond.view(-1, 1, 1), float("-inf"))
        values = values.masked_fill(beyond.view(1, -1, 1), 0)
        own = (qf * new[0].unsqueeze(1)).sum(-1) * scale  # (KVH, G)
        top = torch.maximum(old.amax(0), own)
        old_w, own_w = torch.exp(old - top), torch.exp(own - top)
        out = (old_w.unsqueeze(-1) * values.transpose(0, 1).unsqueeze(2)).sum(0)
        out = out + own_w.unsqueeze(-1) * new[1].unsqueeze(1)
        out = out / (old_w.sum(0) + own_w).unsqueeze(-1)
        return out.to(q.dtype).view(1, -1)


class MatMuls(LoneDecode):
    def write_and_attend(self, q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float,
                         window: int | None) -> torch.Tensor:
        self.written.append(kv)
        keys, values = self.blocks[layer][:, :, self.table].flatten(2, 3).unbind(0)  # (KVH, n, D)
        beyond = torch.arange(keys.shape[1], device=q.device) >= self.past
        new = kv[0]
        k = torch.cat([keys, new[0].unsqueeze(1)], 1)
        v = torch.cat([values.masked_fill(beyond.view(1, -1, 1), 0), new[1].unsqueeze(1)], 1)
        scores = torch.bmm(q.view(KV_HEADS, GROUP, DIM), k.transpose(1, 2)).float() * scale
        scores = scores.masked_fill(torch.cat([beyond, beyond.new_zeros(1)]), float("-inf"))
        return torch.bmm(torch.softmax(scores, -1).to(q.dtype), v).view(1, -1)


def graph(cls: type[LoneDecode]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def run(q: torch.Tensor, kv: torch.Tensor, blocks: torch.Tensor, table: torch.Tensor,
            past: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lone = cls(blocks, table, past)
        outs = [lone.write_and_attend(q[layer], kv[layer], layer, DIM**-0.5, None) for layer in range(LAYERS)]
        return torch.stack(outs), torch.stack(lone.written)

    return run


def main() -> None:
    keys = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    torch.set_num_threads(2)
    pool = torch.randn(LAYERS, 2, KV_HEADS, SLOTS, DIM, dtype=torch.bfloat16)
    blocks = pool.unflatten(3, (-1, BLOCK))  # (layers, 2, KVH, blocks, block size, D), as GraphStep passes it
    q = torch.randn(LAYERS, 1, KV_HEADS * GROUP, DIM, dtype=torch.bfloat16)
    kv = torch.randn(LAYERS, 1, 2, KV_HEADS, DIM, dtype=torch.bfloat16)
    table = torch.arange(START_BLOCK, START_BLOCK + -(-keys // BLOCK))
    past = torch.tensor(keys)
    cached = (blocks, table, past)
    want = graph(LoneDecode)(q, kv, *cached)[0].float()
    compiled = {}
    for name, cls in (("current", LoneDecode), ("keysmajor", KeysMajor), ("mm", MatMuls)):
        fn = torch.compile(graph(cls), dynamic=False)
        first = table[:2].clone()  # (any table length: one graph)
        torch._dynamo.decorators.mark_unbacked(first, 0)
        try:
            fn(q, kv, blocks, first, torch.tensor(min(keys, 2 * BLOCK)))
        except Exception as exc:  # noqa: BLE001 - a form inductor cannot compile: say so, go on
            print(f"{name}: failed to compile ({str(exc).splitlines()[0][:200]})")
            continue
        print(f"{name}: largest difference {(fn(q, kv, *cached)[0].float() - want).abs().max().item():.2e}")
        compiled[name] = fn
    times: dict[str, list[float]] = {name: [] for name in compiled}
    for _ in range(7):
        for name, fn in compiled.items():
            t0 = time.perf_counter()
            for _ in range(50):
                fn(q, kv, *cached)
            times[name].append((time.perf_counter() - t0) / 50 / LAYERS * 1e6)
    for name, values in times.items():
        print(f"{name}: {statistics.median(values):.1f} us a layer at {keys} cached keys")


if __name__ == "__main__":
    main()
