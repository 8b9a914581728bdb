"""One decode row's attention inside an inductor graph, three ways of writing it, as LoneStep's graph runs
it (orca/worker/compiled.py; LoneDecode, orca/models/attention/base.py): SmolLM2's heads (9 query heads, 3
K/V heads, head size 64), bfloat16, 30 layers in one graph, the cached keys a view of a pool at an offset,
their number unbacked, each layer's new key and value beside them.

- ``current``: LoneDecode.attend as shipped (multiplies and sums over (K/V head, group, keys, D), float32);
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

from orca.models.attention.base import LoneDecode

LAYERS, KV_HEADS, GROUP, DIM, SLOTS, START = 30, 3, 3, 64, 8192, 100


class KeysMajor(LoneDecode):
    def attend(self, q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float, window: int | None) -> torch.Tensor:
        keys, values = self.cached[layer].unbind(0)  # (KVH, n, D)
        new = kv[0]
        self.written.append(new)
        qf = q.view(KV_HEADS, GROUP, DIM).float()
        old = (keys.transpose(0, 1).unsqueeze(2) * qf.unsqueeze(0)).sum(-1) * scale  # (n, KVH, G)
        own = (qf * new[0].unsqueeze(1)).sum(-1) * scale  # (KVH, G)
        top = torch.maximum(old.amax(0), own)
        old_w, own_w = torch.exp(old - top), torch.exp(own - top)
        out = (old_w.unsqueeze(-1) * values.transpose(0, 1).unsqueeze(2)).sum(0)
        out = out + own_w.unsqueeze(-1) * new[1].unsqueeze(1)
        out = out / (old_w.sum(0) + own_w).unsqueeze(-1)
        return out.to(q.dtype).view(1, -1)


class MatMuls(LoneDecode):
    def attend(self, q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float, window: int | None) -> torch.Tensor:
        keys, values = self.cached[layer].unbind(0)
        new = kv[0]
        self.written.append(new)
        k = torch.cat([keys, new[0].unsqueeze(1)], 1)
        v = torch.cat([values, new[1].unsqueeze(1)], 1)
        scores = torch.bmm(q.view(KV_HEADS, GROUP, DIM), k.transpose(1, 2)).float() * scale
        return torch.bmm(torch.softmax(scores, -1).to(q.dtype), v).view(1, -1)


def graph(cls: type[LoneDecode]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def run(q: torch.Tensor, kv: torch.Tensor, cached: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lone = cls(cached)
        outs = [lone.attend(q[layer], kv[layer], layer, DIM**-0.5, None) for layer in range(LAYERS)]
        return torch.stack(outs), torch.stack(lone.written)

    return run


def main() -> None:
    keys = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    torch.set_num_threads(2)
    pool = torch.randn(LAYERS, 2, KV_HEADS, SLOTS, DIM, dtype=torch.bfloat16)
    q = torch.randn(LAYERS, 1, KV_HEADS * GROUP, DIM, dtype=torch.bfloat16)
    kv = torch.randn(LAYERS, 1, 2, KV_HEADS, DIM, dtype=torch.bfloat16)
    cached = pool[:, :, :, START : START + keys]
    want = graph(LoneDecode)(q, kv, cached)[0].float()
    compiled = {}
    for name, cls in (("current", LoneDecode), ("keysmajor", KeysMajor), ("mm", MatMuls)):
        fn = torch.compile(graph(cls), dynamic=False)
        first = pool[:, :, :, 0:2]
        torch._dynamo.decorators.mark_unbacked(first, 3)
        try:
            fn(q, kv, first)
        except Exception as exc:  # noqa: BLE001 - a form inductor cannot compile: say so, go on
            print(f"{name}: failed to compile ({str(exc).splitlines()[0][:200]})")
            continue
        print(f"{name}: largest difference {(fn(q, kv, cached)[0].float() - want).abs().max().item():.2e}")
        compiled[name] = fn
    times: dict[str, list[float]] = {name: [] for name in compiled}
    for _ in range(7):
        for name, fn in compiled.items():
            t0 = time.perf_counter()
            for _ in range(50):
                fn(q, kv, cached)
            times[name].append((time.perf_counter() - t0) / 50 / LAYERS * 1e6)
    for name, values in times.items():
        print(f"{name}: {statistics.median(values):.1f} us a layer at {keys} cached keys")


if __name__ == "__main__":
    main()
