"""One decode row's attention inside an inductor graph, reading its keys and values four ways, to see
whether attention could leave its opaque op (orca::selective_attention) for the compiled forward pass:
SmolLM2's heads (9 query heads, 3 K/V heads, head size 64), bfloat16, 30 layers, a pool of 16,384 slots
per layer and K/V head, the context dynamic. The graph holds the whole pool as one flat (slots, 64) input.

- ``slice``: the request's keys as a slice of the pool (consecutive slots at a fixed offset);
- ``gather``: its keys gathered slot by slot through an index (a block table's slots);
- ``blocks``: gathered block by block (16 slots each) through its block ids;
- ``+write``: the iteration's new key and value written into the pool first, inside the graph
  (``index_put_`` on the flat input: in place; through a per-layer view of the pool, functionalization
  copied the whole pool every layer instead, ~22 ms a layer here).

Median microseconds per layer, 15 rounds of 10 calls (all 30 layers' attention in one call, so inductor
may fuse across layers: a lower bound on what each costs between the real graph's matmuls). The same
row's SDPA call, as the opaque op makes it, took ~30-40 us here. Not a test, not a benchmark of record:
docs/BENCHMARKS.md quotes its output with the command and the host.

    .venv/bin/python scripts/experiments/graph_attention_gather.py
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

LAYERS, KV_HEADS, GROUP, DIM, SLOTS, BLOCK, START, CONTEXT = 30, 3, 3, 64, 16384, 16, 800, 150
SCALE = DIM**-0.5


def attention(mode: str):  # noqa: ANN201 - a function for torch.compile
    def run(q: torch.Tensor, kv: torch.Tensor, flat: torch.Tensor, slot: torch.Tensor, index: torch.Tensor,
            mask: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        heads = torch.arange(2 * KV_HEADS).view(2, KV_HEADS, 1) * SLOTS
        for layer in range(LAYERS):
            base = layer * 2 * KV_HEADS * SLOTS
            if "write" in mode:
                flat.index_put_((base + heads + slot,), kv[layer].permute(1, 2, 0, 3))
            if mode.startswith("blocks"):
                blocks, per_layer = flat.view(-1, BLOCK, DIM), SLOTS // BLOCK
                first = layer * 2 * KV_HEADS * per_layer
                keys = blocks[first + torch.arange(KV_HEADS)[:, None] * per_layer + index[0]].flatten(1, 2)
                values = blocks[first + (KV_HEADS + torch.arange(KV_HEADS))[:, None] * per_layer + index[0]]
                values = values.flatten(1, 2)
            elif mode.startswith("gather"):
                keys = flat[base + heads[0][:, :, None] + index][:, 0]  # (KVH, keys, D)
                values = flat[base + heads[1][:, :, None] + index][:, 0]
            else:
                pool = flat.view(LAYERS, 2, KV_HEADS, SLOTS, DIM)
                keys = pool[layer, 0, :, START : START + index.shape[1]]
                values = pool[layer, 1, :, START : START + index.shape[1]]
            qq = q[layer].view(KV_HEADS, GROUP, DIM).float()
            scores = (qq[:, :, None, :] * keys[:, None].float()).sum(-1) * SCALE + mask[None]  # (KVH, G, keys)
            probs = torch.softmax(scores, -1)
            outs.append((probs[..., None] * values[:, None].float()).sum(2).to(q.dtype))
        return outs

    return run


def inputs(mode: str, context: int) -> tuple[torch.Tensor, ...]:
    q = torch.randn(LAYERS, 1, KV_HEADS * GROUP, DIM, dtype=torch.bfloat16)
    kv = torch.randn(LAYERS, 1, 2, KV_HEADS, DIM, dtype=torch.bfloat16)
    slot = torch.tensor([START + context - 1])
    if mode.startswith("blocks"):
        width = -(-context // BLOCK) * BLOCK
        index = torch.arange(START // BLOCK, START // BLOCK + width // BLOCK)[None]
    else:
        width = context
        index = torch.arange(START, START + context)[None]
    mask = torch.zeros(1, width)
    mask[:, context:] = float("-inf")
    return q, kv, slot, index, mask


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    flat = torch.randn(LAYERS * 2 * KV_HEADS * SLOTS, DIM, dtype=torch.bfloat16)
    print("mode | us a layer")
    for mode in sys.argv[1:] or ("slice", "gather", "blocks", "slice+write", "gather+write"):
        compiled = torch.compile(attention(mode), dynamic=True)
        with torch.inference_mode():
            for context in (150, 151, 170):  # compiles (the context an unbacked size)
                q, kv, slot, index, mask = inputs(mode, context)
                torch._dynamo.decorators.mark_unbacked(index, 1)
                torch._dynamo.decorators.mark_unbacked(mask, 1)
                compiled(q, kv, flat, slot, index, mask)
            q, kv, slot, index, mask = inputs(mode, CONTEXT)
            times = []
            for _ in range(15):
                t0 = time.perf_counter()
                for _ in range(10):
                    compiled(q, kv, flat, slot, index, mask)
                times.append((time.perf_counter() - t0) / 10 / LAYERS * 1e6)
        print(f"{mode} | {statistics.median(times):.1f}", flush=True)
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
