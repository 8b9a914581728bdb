"""The paged decode kernel's launch parameters swept on a GPU: tile size (slots per step of a program's
loop), warps per program and split count, per (batch, context length), against the time its reads take at
the device's copy bandwidth (keys and values of every row once). Not a test, not a benchmark of record:
docs/BENCHMARKS.md quotes its output with the command, the machine and the date.

    PYTHONPATH=. python scripts/experiments/paged_decode_tiles.py --json tiles.json

The layout is the 1.1B Llama's (32 query and 8 K/V heads of 64, bf16, blocks of 16 scattered over a pool);
every row a request at the given context length. `--smoke` runs a tiny sweep anywhere (on a CPU under
TRITON_INTERPRET=1: a check of the script, no timing worth reading).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from pathlib import Path

import torch

from orca.models.attention import paged_decode


def case(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
         dtype: torch.dtype, device: torch.device, seed: int = 0) -> tuple:
    """q, the layer's pool, rows and tables: `batch` requests of `context` tokens in scattered blocks."""
    per_request = -(-context // block_size)
    num_blocks = batch * per_request + 8
    rng = random.Random(seed)
    blocks = rng.sample(range(num_blocks), batch * per_request)
    tables = torch.tensor(blocks, dtype=torch.int32).view(batch, per_request).to(device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    pool = torch.randn(2, kv_heads, num_blocks * block_size, head_dim, generator=g).to(device, dtype)
    q = torch.randn(batch, heads, head_dim, generator=g).to(device, dtype)
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    positions = torch.full((batch,), context - 1, dtype=torch.int32, device=device)
    return q, pool, rows, positions, tables


def timed(fn, device: torch.device, repeats: int) -> float:  # noqa: ANN001
    """Median seconds of `fn` (after two warm-up calls; device-synced)."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 1 GiB device copy (read + write), the roofline's bandwidth."""
    if device.type != "cuda":
        return float("nan")
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    seconds = timed(lambda: b.copy_(a), device, 5)
    return 2 * a.numel() / seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--contexts", default="160,1024,4096")
    p.add_argument("--block-n", default="16,32,64,128")
    p.add_argument("--warps", default="2,4,8")
    p.add_argument("--splits", default="auto,1,2,4,8,16", help="'auto' is num_splits' choice")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="a tiny sweep (any device)")
    p.add_argument("--json")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    heads, kv_heads, head_dim, block_size, dtype = 32, 8, 64, 16, torch.bfloat16
    if args.smoke:
        args.batches, args.contexts, args.block_n, args.warps = "2", "40", "16", "2"
        args.splits, args.repeats = "auto,2", 1
        heads, kv_heads, head_dim = 4, 2, 16
        dtype = torch.float32
    bandwidth = copy_bandwidth(device)
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            q, pool, rows, positions, tables = case(batch, context, heads, kv_heads, head_dim, block_size, dtype,
                                                    device)
            read_bytes = 2 * batch * context * kv_heads * head_dim * pool.element_size()
            best = None
            for split_choice in args.splits.split(","):
                auto = split_choice == "auto"
                splits = paged_decode.num_splits(batch, kv_heads, device) if auto else int(split_choice)
                for block_n in (int(n) for n in args.block_n.split(",")):
                    for warps in (int(w) for w in args.warps.split(",")):
                        call = functools.partial(
                            paged_decode.paged_decode_attention, q, pool, rows, positions, tables, block_size,
                            head_dim ** -0.5, None, splits=splits, block_n=block_n, num_warps=warps)
                        seconds = timed(call, device, args.repeats)
                        row = {"batch": batch, "context": context, "splits": splits, "auto": auto,
                               "block_n": block_n, "num_warps": warps, "us": seconds * 1e6,
                               "read_us": read_bytes / bandwidth * 1e6}
                        results.append(row)
                        if best is None or row["us"] < best["us"]:
                            best = row
            default = next(r for r in results if r["batch"] == batch and r["context"] == context and r["auto"]
                           and r["block_n"] == paged_decode.BLOCK_N and r["num_warps"] == paged_decode.NUM_WARPS) \
                if not args.smoke else None
            print(f"batch {batch:4d} context {context:5d}: best {best['us']:8.1f} us (splits {best['splits']}, "
                  f"block_n {best['block_n']}, warps {best['num_warps']}); default "
                  f"{default['us'] if default else float('nan'):8.1f} us; reads at copy bandwidth "
                  f"{best['read_us']:6.1f} us", flush=True)
    if args.json:
        info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "copy_bandwidth_bytes_per_second": bandwidth}
        Path(args.json).write_text(json.dumps({"args": vars(args), "info": info, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
