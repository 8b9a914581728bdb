"""Where a decode iteration's time goes, at steady state, on one engine: the wall time per step(), the
engine's own phase timings (engine.profile: prepare, model, sample, the rest of step() = scheduling and
outputs; device-synced), a cProfile of the host side (functions by own time, per iteration), and torch's
profiler (ops by own host time, the device's busy time per iteration). Not a test, not a benchmark of
record: docs/BENCHMARKS.md quotes its output with the command, the machine and the date.

    PYTHONPATH=.:client python scripts/experiments/decode_host_profile.py --model DIR --json out.json

Every request is in decode for the measured steps (prompts prefilled and 4 steps run first); the batch is
the same at every measured iteration (max_tokens leaves room for all of them).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from pathlib import Path
from typing import Any

from orca_client.bench.decode import ORCA_SYSTEMS, _sync, build_checkpoint

PHASES = ("prepare", "model", "attention", "sample")


def steady_engine(args: argparse.Namespace, system: str, checkpoint: Path, batch: int) -> Any:
    from orca import EngineConfig, LLMEngine, SamplingParams

    per_request = -(-(args.prompt_len + args.max_tokens) // 16) * 16
    slots = {} if args.default_pool else {"n_slots": batch * per_request}
    engine = LLMEngine(EngineConfig(model=str(checkpoint), device=args.device, dtype=args.dtype, max_bs=batch,
                                    block_size=16, **slots, **ORCA_SYSTEMS[system]))
    rng = random.Random(0)
    for i in range(batch):
        prompt = [rng.randrange(3, min(32000, engine.core.model_config.vocab_size)) for _ in range(args.prompt_len)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step() if o.token_ids)
    for _ in range(4):
        engine.step()
    return engine


def profile_batch(args: argparse.Namespace, system: str, checkpoint: Path, batch: int) -> dict[str, Any]:
    import torch

    engine = steady_engine(args, system, checkpoint, batch)
    device = torch.device(engine.config.torch_device)
    n = args.steps
    try:
        walls = []
        for _ in range(n):
            _sync(device)
            start = time.perf_counter()
            engine.step()
            _sync(device)
            walls.append(time.perf_counter() - start)
        sizes = {engine.last_iteration.batch_size}

        engine.core.profile = True
        phases: dict[str, list[float]] = {p: [] for p in (*PHASES, "rest of step")}
        for _ in range(n):
            start = time.perf_counter()
            engine.step()
            step = time.perf_counter() - start
            t = engine.last_iteration.timings or {}
            for p in PHASES:
                phases[p].append(t.get(p, 0.0))
            phases["rest of step"].append(step - t.get("prepare", 0.0) - t.get("model", 0.0) - t.get("sample", 0.0))
            sizes.add(engine.last_iteration.batch_size)
        engine.core.profile = False

        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(n):
            engine.step()
        _sync(device)
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(args.top)
        by_own = _pstats_rows(stats, "tottime", args.top, n)
        by_cum = _pstats_rows(stats, "cumulative", args.top, n)

        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        m = max(4, n // 4)
        with profile(activities=activities) as prof:
            for _ in range(m):
                engine.step()
            _sync(device)
        events = prof.key_averages()
        ops = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
        device_total = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events)
        result = {
            "batch": batch, "system": system, "batch_sizes_seen": sorted(sizes),
            "step_ms_median": 1e3 * statistics.median(walls),
            "tokens_per_second": batch / statistics.median(walls),
            "phases_ms_median": {p: 1e3 * statistics.median(v) for p, v in phases.items()},
            "host_functions_by_own_time": by_own,
            "host_functions_by_cumulative_time": by_cum,
            "torch_ops_by_own_host_time": [
                {"op": e.key, "calls_per_iteration": e.count / m,
                 "self_cpu_us_per_iteration": e.self_cpu_time_total / m,
                 "self_device_us_per_iteration": (getattr(e, "self_device_time_total", 0) or 0) / m}
                for e in ops],
            "device_busy_us_per_iteration": device_total / m,
            "device_kernels_by_time": [
                {"kernel": e.key[:160], "calls_per_iteration": e.count / m,
                 "device_us_per_iteration": (getattr(e, "self_device_time_total", 0) or 0) / m}
                for e in sorted(events, key=lambda e: getattr(e, "self_device_time_total", 0) or 0,
                                reverse=True)[: args.top] if (getattr(e, "self_device_time_total", 0) or 0) > 0],
        }
        print(f"== {system} B={batch}: step {result['step_ms_median']:.2f} ms, "
              f"{result['tokens_per_second']:.0f} tok/s, "
              f"device busy {result['device_busy_us_per_iteration'] / 1e3:.2f} ms;"
              f" phases (ms) " + ", ".join(f"{p} {v:.2f}" for p, v in result["phases_ms_median"].items()), flush=True)
        print(text.getvalue()[-6000:], flush=True)
        for k in result["device_kernels_by_time"][:12]:
            print(f"  device {k['device_us_per_iteration']:8.1f} us/it {k['calls_per_iteration']:6.1f} calls  "
                  f"{k['kernel'][:100]}")
        cum = io.StringIO()
        pstats.Stats(profiler, stream=cum).sort_stats("cumulative").print_stats(40)
        print(cum.getvalue()[-9000:], flush=True)
        return result
    finally:
        engine.shutdown()


def _pstats_rows(stats: pstats.Stats, key: str, top: int, n: int) -> list[dict[str, Any]]:
    rows = []
    for (path, line, name), (_cc, nc, tt, ct, _) in sorted(
            stats.stats.items(), key=lambda kv: kv[1][2 if key == "tottime" else 3], reverse=True)[:top]:
        rows.append({"function": f"{Path(path).name}:{line}:{name}", "calls_per_iteration": nc / n,
                     "own_us_per_iteration": 1e6 * tt / n, "cumulative_us_per_iteration": 1e6 * ct / n})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Llama-shaped checkpoint (default: build --shape into --workdir)")
    p.add_argument("--shape", default="llama-1b", choices=("llama-1b", "tiny"))
    p.add_argument("--workdir", default="/tmp/orca-host-profile")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--systems", default="orca-flex-graphs,orca-batched")
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--default-pool", action="store_true", help="the pool sized from free memory (default: the batch's)")
    p.add_argument("--paged-rows", type=int, help="the most rows per request of an iteration flex hands to the "
                   "paged decode kernel in this run (0: decode iterations through flex_attention, as before the "
                   "paged decode kernel; default: the engine's, orca/tuning.py's VERIFYING_MAX_ROWS)")
    p.add_argument("--json")
    args = p.parse_args()
    args.max_tokens = 4 * args.steps + 32
    if args.paged_rows is not None:
        import orca.models.attention.flex as flex

        # flex's choice alone (VERIFYING_MAX_ROWS bounds the other backends' few-row paths too: they stay)
        def takes_paged_decode(device, lengths, most=args.paged_rows):  # (flex.py's, with this bound)
            return device.type == "cuda" and 0 < max(lengths, default=0) <= most

        flex.takes_paged_decode = takes_paged_decode
    from orca import EngineConfig

    checkpoint = Path(args.model) if args.model else None
    if checkpoint is None:
        c = EngineConfig(device=args.device, dtype=args.dtype)
        checkpoint = build_checkpoint(args.shape, Path(args.workdir) / args.shape, c.torch_dtype, c.torch_device)
    results = []
    for system in args.systems.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            results.append(profile_batch(args, system, checkpoint, batch))
            if args.json:
                Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
