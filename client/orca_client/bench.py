"""orca-bench: reproduce Orca's evaluation here (docs/BENCHMARKS.md).

``orca-bench trace``: the paper's workload (orca_client.trace) against models of a running Triton server,
over tritonclient gRPC (streaming for decoupled models such as orca_gpt, one plain async infer per request
for request_level_gpt), at a sweep of arrival rates. Per request: end-to-end latency, time to first token,
inter-token latency and normalized latency (end-to-end / generated tokens); per rate: throughput and
median / p90 / p99. Writes JSON and the paper's Figure 10 (median normalized latency against throughput)
plus the throughput each model sustains within a latency SLO.

``orca-bench offline``: the same requests through orca.LLM.generate and through transformers' continuous
batching on the same weights, in one process, in turn: tokens/s, model FLOPs utilisation against a matmul
peak measured in the same run, and where an Orca iteration spends its time.

Benchmarks print numbers; they do not pass or fail.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tqdm import tqdm
from tritonclient.utils import InferenceServerException

from orca_client.client import OrcaClient, parse_result
from orca_client.trace import PRESETS, TraceRequest, TraceSpec, make_trace, parse_range

DEFAULT_MODELS = ("orca_gpt", "request_level_gpt")
# Rates (req/s) per preset: from well below to above what orca_gpt sustains with SmolLM2-135M on 2 CPU
# cores (about 3 req/s on the default preset, 4x fewer with the paper's 4x longer requests).
DEFAULT_RATES = {"default": (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0), "paper": (0.1, 0.2, 0.3, 0.4, 0.6, 0.8, 1.0)}
PERCENTILES = (50, 90, 99)


# -- per-request records and summaries ----------------------------------------------------------------
@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds; `sent` is relative to the run's start."""

    index: int
    prompt_tokens: int
    max_new_tokens: int
    sent: float = 0.0
    e2e: float | None = None
    ttft: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    gaps: list[float] = field(default_factory=list)  # inter-token gaps (streaming only)

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e is not None

    @property
    def normalized(self) -> float | None:
        """End-to-end latency per generated token: the paper's metric."""
        return self.e2e / self.output_tokens if self.ok and self.output_tokens else None

    @property
    def itl(self) -> float | None:
        """Mean inter-token latency; None when the tokens came in one response (not streamed)."""
        return sum(self.gaps) / len(self.gaps) if self.gaps else None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        del d["gaps"]
        d["normalized"], d["itl"] = self.normalized, self.itl
        return d


def stats(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(records: Sequence[RequestRecord], rate: float | None) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    summary: dict[str, Any] = {
        "rate": rate,
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "generated_tokens": sum(r.output_tokens for r in ok),
    }
    if ok:
        # From the first request sent to the last answer: the rate the server actually sustained.
        duration = max(r.sent + (r.e2e or 0.0) for r in ok) - min(r.sent for r in records)
        summary["duration"] = duration
        summary["throughput_rps"] = len(ok) / duration if duration > 0 else None
        summary["throughput_tps"] = summary["generated_tokens"] / duration if duration > 0 else None
    else:
        summary.update(duration=None, throughput_rps=None, throughput_tps=None)
    summary["e2e"] = stats([r.e2e for r in ok if r.e2e is not None])
    summary["ttft"] = stats([r.ttft for r in ok if r.ttft is not None])
    summary["itl"] = stats([g for r in ok for g in r.gaps])  # over every token gap of every request
    summary["normalized"] = stats([n for r in ok if (n := r.normalized) is not None])
    return summary


# -- driving a model -----------------------------------------------------------------------------------
def sampling_parameters(req: TraceRequest) -> dict[str, Any]:
    """The paper's requests: greedy, EOS ignored, exactly max_new_tokens tokens each."""
    return {"max_tokens": req.max_new_tokens, "temperature": 0, "ignore_eos": True}


class Driver:
    """Sends one trace request and calls `done` on the client's threads when its answer is complete."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model

    def submit(self, req: TraceRequest, record: RequestRecord, done: Callable[[], None]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        return None


class StreamingDriver(Driver):
    """Decoupled models (orca_gpt): one gRPC stream per request (orca_client.OrcaClient), a response per
    iteration, so time to first token and inter-token gaps are what the client really saw."""

    def submit(self, req: TraceRequest, record: RequestRecord, done: Callable[[], None]) -> None:
        threading.Thread(target=self._run, args=(req, record, done), daemon=True).start()

    def _run(self, req: TraceRequest, record: RequestRecord, done: Callable[[], None]) -> None:
        start = time.perf_counter()
        last = start
        try:
            client = OrcaClient(self.url, self.model)
            for chunk in client.generate(input_ids=list(req.prompt_token_ids), stream=True,
                                         **sampling_parameters(req)):
                n = len(chunk.output_ids)
                if n:
                    if record.ttft is None:
                        record.ttft = chunk.time - start
                    else:
                        record.gaps.extend([(chunk.time - last) / n] * n)
                    last = chunk.time
                    record.output_tokens += n
                if chunk.final:
                    record.finish_reason = chunk.finish_reason
                    record.e2e = chunk.time - start
        except Exception as exc:  # noqa: BLE001 - a failed request (OrcaError or other) is a data point
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            done()


class BatchingDriver(Driver):
    """Models with Triton's dynamic batcher (request_level_gpt): one async infer per request, the batch
    dimension in front; the single response carries every token, so TTFT equals the end-to-end latency."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(url, model)
        self._client = grpcclient.InferenceServerClient(url)

    def submit(self, req: TraceRequest, record: RequestRecord, done: Callable[[], None]) -> None:
        start = time.perf_counter()

        def on_result(result: Any, error: Any) -> None:
            now = time.perf_counter()
            try:
                if error is not None:
                    record.error = f"{type(error).__name__}: {error}"
                    return
                chunk = parse_result(result)
                record.e2e = record.ttft = now - start
                record.output_tokens = len(chunk.output_ids)
                record.finish_reason = chunk.finish_reason
            except Exception as exc:  # noqa: BLE001
                record.error = f"{type(exc).__name__}: {exc}"
            finally:
                done()

        try:
            self._client.async_infer(self.model, batch_member_inputs(req), on_result)
        except Exception as exc:  # noqa: BLE001
            record.error = f"{type(exc).__name__}: {exc}"
            done()

    def close(self) -> None:
        self._client.close()


def batch_member_inputs(req: TraceRequest) -> list[grpcclient.InferInput]:
    """request_level_gpt's tensors: orca_gpt's, with Triton's batch dimension (one member) in front."""
    values = {
        "input_ids": ("INT32", np.asarray([req.prompt_token_ids], dtype=np.int32)),
        "stream": ("BOOL", np.asarray([[False]])),
        "exclude_input_in_output": ("BOOL", np.asarray([[True]])),
        "sampling_parameters": (
            "BYTES", np.asarray([[json.dumps(sampling_parameters(req)).encode()]], dtype=np.object_)
        ),
    }
    inputs = []
    for name, (dtype, value) in values.items():
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def make_driver(url: str, model: str) -> Driver:
    """Streaming for decoupled models, async infer for the others (read from the model's config)."""
    client = grpcclient.InferenceServerClient(url)
    try:
        config = client.get_model_config(model, as_json=True)["config"]
    finally:
        client.close()
    if config.get("model_transaction_policy", {}).get("decoupled", False):
        return StreamingDriver(url, model)
    if int(config.get("max_batch_size", 0)) < 1:
        raise ValueError(f"{model} is neither decoupled nor batching: orca-bench drives orca_gpt-style models")
    return BatchingDriver(url, model)


class _Countdown:
    """Counts answered requests; wait() returns when all are in or the deadline passes."""

    def __init__(self, total: int, on_done: Callable[[], None]) -> None:
        self._left = total
        self._cond = threading.Condition()
        self._on_done = on_done

    def done(self) -> None:
        with self._cond:
            self._left -= 1
            self._cond.notify_all()
        self._on_done()

    def wait(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._left <= 0, timeout=timeout)


def run_open_loop(
    driver: Driver, trace: Sequence[TraceRequest], timeout: float, on_done: Callable[[], None]
) -> list[RequestRecord]:
    """Sends each request at its arrival time (open loop: arrivals never wait for answers)."""
    records = [RequestRecord(r.index, len(r.prompt_token_ids), r.max_new_tokens) for r in trace]
    countdown = _Countdown(len(trace), on_done)
    start = time.perf_counter()
    for req, record in zip(trace, records):
        delay = start + req.arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # pacing the Poisson arrivals
        record.sent = time.perf_counter() - start
        driver.submit(req, record, countdown.done)
    if not countdown.wait(timeout):
        for record in records:
            if record.e2e is None and record.error is None:
                record.error = f"no answer within {timeout:.0f}s"
    return records


def run_closed_loop(
    driver: Driver, trace: Sequence[TraceRequest], timeout: float, on_done: Callable[[], None]
) -> list[RequestRecord]:
    """One request at a time: the unloaded latency."""
    records = []
    start = time.perf_counter()
    for req in trace:
        record = RequestRecord(req.index, len(req.prompt_token_ids), req.max_new_tokens)
        record.sent = time.perf_counter() - start
        countdown = _Countdown(1, on_done)
        driver.submit(req, record, countdown.done)
        if not countdown.wait(timeout):
            record.error = f"no answer within {timeout:.0f}s"
        records.append(record)
    return records


# -- SLO --------------------------------------------------------------------------------------------------
def throughput_within_slo(runs: Sequence[dict[str, Any]], slo: float) -> float:
    """The highest throughput (req/s) the model sustains before its median normalized latency first
    exceeds `slo`: walking its latency-throughput curve in rate order, linearly interpolated between the
    last point within the SLO and the first one beyond it. 0 when even the lowest rate misses the SLO."""
    best = 0.0
    previous: tuple[float, float] | None = None
    for summary in (run["summary"] for run in sorted(runs, key=lambda r: r["rate"])):
        tput, lat = summary["throughput_rps"], summary["normalized"]["p50"]
        if tput is None or lat is None:
            break
        if lat > slo:
            if previous is not None:
                prev_tput, prev_lat = previous
                best = max(best, prev_tput + (tput - prev_tput) * (slo - prev_lat) / (lat - prev_lat))
            break
        best = max(best, tput)
        previous = (tput, lat)
    return best


# -- the trace command ----------------------------------------------------------------------------------
def cmd_trace(args: argparse.Namespace) -> int:
    preset = "paper" if args.paper else "default"
    spec = _spec(args, preset)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    rates = sorted(float(r) for r in args.rates.split(",")) if args.rates else list(DEFAULT_RATES[preset])
    drivers = {m: make_driver(args.url, m) for m in models}
    unloaded_trace = make_trace(spec, None)[: args.unloaded_requests]
    total = len(models) * (len(unloaded_trace) + len(rates) * spec.num_requests)
    result: dict[str, Any] = {
        "benchmark": "trace",
        "machine": machine_info(),
        "command": sys.argv,
        "url": args.url,
        "trace": asdict(spec),
        "rates": rates,
        "models": models,
        "unloaded": {},
        "runs": [],
    }
    try:
        with tqdm(total=total, unit="req", desc="orca-bench trace", disable=args.no_progress) as bar:
            lock = threading.Lock()

            def tick() -> None:  # called from the client's threads
                with lock:
                    bar.update(1)
            for model in models:
                if unloaded_trace:
                    bar.set_postfix_str(f"{model} unloaded")
                    records = run_closed_loop(drivers[model], unloaded_trace, args.timeout, tick)
                    result["unloaded"][model] = {
                        "summary": summarize(records, None), "requests": [r.to_json() for r in records]
                    }
                for rate in rates:
                    bar.set_postfix_str(f"{model} {rate:g} req/s")
                    records = run_open_loop(drivers[model], make_trace(spec, rate), args.timeout, tick)
                    result["runs"].append({
                        "model": model, "rate": rate, "summary": summarize(records, rate),
                        "requests": [r.to_json() for r in records],
                    })
    finally:
        for driver in drivers.values():
            driver.close()
    add_slo(result, args.slo_multiple)
    print_trace(result)
    if args.json:
        write_json(args.json, result)
    if args.plot:
        plot_trace(result, args.plot)
    return 0


def add_slo(result: dict[str, Any], multiple: float) -> None:
    """SLO = multiple x the unloaded per-token latency (the best model's median normalized latency with one
    request at a time; without an unloaded pass, at the lowest rate of the sweep)."""
    if result["unloaded"]:
        base = [u["summary"]["normalized"]["p50"] for u in result["unloaded"].values()]
        source = "unloaded"
    else:
        low = min(result["rates"])
        base = [r["summary"]["normalized"]["p50"] for r in result["runs"] if r["rate"] == low]
        source = f"lowest rate ({low:g} req/s)"
    base = [b for b in base if b is not None]
    reference = min(base) if base else None
    slo = None if reference is None else multiple * reference
    result["slo"] = {"multiple": multiple, "per_token_latency": reference, "source": source, "slo": slo}
    result["throughput_within_slo"] = {
        m: (None if slo is None else throughput_within_slo([r for r in result["runs"] if r["model"] == m], slo))
        for m in result["models"]
    }
    # A model still within the SLO at the sweep's highest rate: its number is only a lower bound.
    result["slo_never_crossed"] = {
        m: slo is not None and all(
            r["summary"]["normalized"]["p50"] is not None and r["summary"]["normalized"]["p50"] <= slo
            for r in result["runs"] if r["model"] == m
        )
        for m in result["models"]
    }


def print_trace(result: dict[str, Any]) -> None:
    header = (f"{'model':<22} {'rate':>6} {'done':>5} {'req/s':>7} {'tok/s':>8} {'norm p50':>9} {'norm p90':>9} "
              f"{'e2e p50':>8} {'ttft p50':>8} {'itl p50':>8}")
    print(header)
    print("-" * len(header))
    for run in result["runs"]:
        s = run["summary"]
        print(f"{run['model']:<22} {run['rate']:>6g} {s['completed']:>5} {_f(s['throughput_rps'], 7, 3)} "
              f"{_f(s['throughput_tps'], 8, 1)} {_f(s['normalized']['p50'], 9, 4)} {_f(s['normalized']['p90'], 9, 4)} "
              f"{_f(s['e2e']['p50'], 8, 3)} {_f(s['ttft']['p50'], 8, 3)} {_f(s['itl']['p50'], 8, 4)}")
    slo = result["slo"]
    if slo["slo"] is not None:
        print(f"\nSLO: {slo['multiple']:g} x {slo['per_token_latency']:.4f} s/token ({slo['source']}) = "
              f"{slo['slo']:.4f} s/token median normalized latency")
        for model, tput in result["throughput_within_slo"].items():
            never = result["slo_never_crossed"][model]
            bound = " (at least: within the SLO at every rate of the sweep)" if never else ""
            print(f"  throughput within SLO, {model}: {tput:.3f} req/s{bound}")
        values = list(result["throughput_within_slo"].values())
        if len(values) >= 2 and values[1]:
            print(f"  ratio {result['models'][0]} / {result['models'][1]}: {values[0] / values[1]:.1f}x")


def _f(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def plot_trace(result: dict[str, Any], path: str) -> None:
    """Figure 10 of the paper (median normalized latency against throughput, a curve per model) beside
    each model's throughput within the SLO."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (curve, bars) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for model in result["models"]:
        pts = [(r["summary"]["throughput_rps"], r["summary"]["normalized"]["p50"])
               for r in result["runs"] if r["model"] == model]
        pts = [(x, y * 1000) for x, y in pts if x is not None and y is not None]
        if pts:
            xs, ys = zip(*pts)
            curve.plot(xs, ys, marker="o", label=model)
    slo = result["slo"]["slo"]
    if slo is not None:
        curve.axhline(slo * 1000, color="grey", linestyle="--", label=f"SLO ({result['slo']['multiple']:g}x unloaded)")
    curve.set_xlabel("throughput (req/s)")
    curve.set_ylabel("median normalized latency (ms/token)")
    curve.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    curve.yaxis.set_major_formatter(plain)
    curve.yaxis.set_minor_formatter(plain)
    spec = result["trace"]
    curve.set_title(f"prompts U{tuple(spec['prompt_len'])}, new tokens U{tuple(spec['max_new_tokens'])}, EOS ignored")
    curve.grid(True, which="both", alpha=0.3)
    curve.legend()
    names = list(result["throughput_within_slo"])
    values = [result["throughput_within_slo"][m] or 0.0 for m in names]
    bars.bar(names, values, color=[f"C{i}" for i in range(len(names))])
    for i, v in enumerate(values):
        bars.annotate(f"{v:.2f}", (i, v), ha="center", va="bottom")
    bars.set_ylabel("throughput within SLO (req/s)")
    bars.set_title(f"throughput within SLO ({slo * 1000:.0f} ms/token)" if slo is not None else "throughput within SLO")
    bars.tick_params(axis="x", labelrotation=15)
    fig.suptitle(f"orca-bench trace ({result['machine']['cpu']}, {result['machine']['cores']} cores)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


# -- the offline command ----------------------------------------------------------------------------------
def cmd_offline(args: argparse.Namespace) -> int:
    import torch

    from orca.loader import resolve_checkpoint

    spec = _spec(args, "offline")
    checkpoint = resolve_checkpoint(args.model)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    high = min(spec.token_ids[1], vocab)
    spec = spec.with_options(token_ids=(min(spec.token_ids[0], high - 1), high))
    trace = make_trace(spec, None)
    prompts = [list(r.prompt_token_ids) for r in trace]
    max_new = [r.max_new_tokens for r in trace]
    result: dict[str, Any] = {
        "benchmark": "offline", "machine": machine_info(), "command": sys.argv, "checkpoint": str(checkpoint),
        "trace": asdict(spec), "torch_threads": torch.get_num_threads(),
    }
    orca_tokens = run_orca_offline(args, prompts, max_new, result)
    if not args.skip_transformers:
        run_transformers_offline(checkpoint, prompts, max_new, orca_tokens, result)
    # In the same process, right after the runs: the peak of the machine the runs just had.
    result["peak_flops"] = measure_matmul_peak(result["dtype"], result["device"], args.peak_seconds)
    for name in ("orca", "transformers"):
        if name in result:
            run = result[name]
            run["mfu"] = run["model_flops"] / run["seconds"] / result["peak_flops"]
    if "transformers" in result:
        result["ratio"] = result["orca"]["tokens_per_second"] / result["transformers"]["tokens_per_second"]
    print_offline(result)
    if args.json:
        write_json(args.json, result)
    return 0


def run_orca_offline(
    args: argparse.Namespace, prompts: list[list[int]], max_new: list[int], result: dict[str, Any]
) -> list[list[int]]:
    import torch

    from orca import LLM, SamplingParams

    llm = LLM(args.model, max_bs=args.max_bs, dtype=args.dtype)
    engine = llm.engine
    result["dtype"] = str(engine.config.torch_dtype).removeprefix("torch.")
    result["device"] = str(engine.device)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_new]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [o.token_ids for o in outputs]
    result["model"] = model_shape(engine.runner.model, engine.model_config)
    result["orca"] = {
        **run_record(result["model"], prompts, tokens, seconds),
        "max_bs": args.max_bs,
        "n_slots": engine.n_slots,
    }
    result["breakdown"] = iteration_breakdown(engine, prompts, params)
    del llm, engine
    _free_memory(torch)
    return tokens


def iteration_breakdown(engine: Any, prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    """Runs the same requests again, timing every iteration: attention (the per-request split), the batched
    ops (every other op of the model, logits included), sampling, input preparation, and scheduling (the
    rest of step(): selection, K/V allocation, stop checks, detokenisation, outputs)."""
    totals = dict.fromkeys(("attention", "batched_ops", "sampling", "prepare", "scheduling"), 0.0)
    iterations = 0
    batch_sizes = 0
    engine.runner.profile = True
    with attention_timer(engine.runner.model, engine.device) as attention:
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"breakdown-{i}", prompt, p)
        while engine.has_unfinished():
            attention.seconds = 0.0
            start = time.perf_counter()
            engine.step()
            step = time.perf_counter() - start
            t = engine.runner.last_timings
            totals["attention"] += attention.seconds
            totals["batched_ops"] += t.model - attention.seconds
            totals["sampling"] += t.sample
            totals["prepare"] += t.prepare
            totals["scheduling"] += step - (t.prepare + t.model + t.sample)
            iterations += 1
            batch_sizes += engine.last_iteration.batch_size
    engine.runner.profile = False
    total = sum(totals.values())
    return {
        "seconds": totals,
        "fraction": {k: v / total for k, v in totals.items()} if total > 0 else {},
        "total_seconds": total,
        "iterations": iterations,
        "mean_batch_size": batch_sizes / iterations if iterations else 0.0,
        "attention_measured": attention.hooked,
    }


class _AttentionClock:
    def __init__(self) -> None:
        self.seconds = 0.0
        self.hooked = False


@contextlib.contextmanager
def attention_timer(model: Any, device: Any) -> Iterator[_AttentionClock]:
    """Times every call of the model module's selective_attention (the one op Orca does not batch), by
    wrapping the name the model's module calls (on a GPU with a device sync on each side, as the runner's
    profile flag does). If the model calls no such function, attention stays 0 and counts as batched ops."""
    import importlib

    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    module = importlib.import_module(type(model).__module__)
    clock = _AttentionClock()
    original = getattr(module, "selective_attention", None)
    if original is None:
        yield clock
        return

    def timed(*a: Any, **kw: Any) -> Any:
        sync()
        start = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            sync()
            clock.seconds += time.perf_counter() - start

    module.selective_attention = timed
    clock.hooked = True
    try:
        yield clock
    finally:
        module.selective_attention = original


def run_transformers_offline(
    checkpoint: Path,
    prompts: list[list[int]],
    max_new: list[int],
    orca_tokens: list[list[int]],
    result: dict[str, Any],
) -> None:
    """transformers' continuous batching (its paged-attention manager) with a per-request max_new_tokens,
    EOS disabled and greedy decoding, on the same weights and dtype."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    dtype = getattr(torch, result["dtype"])
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="sdpa")
    model = model.to(result["device"]).eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(max_new), eos_token_id=-1, pad_token_id=0)
    hints = WorkloadHints(max(len(p) for p in prompts), max(max_new), len(prompts))
    # Sized like orca's engine for this workload: room for every request at once (orca admits them all in
    # its first iteration) within orca's K/V budget, and every prompt in one step. The defaults would size
    # the cache, and its attention masks, from the free memory: on a CPU most of the machine's RAM.
    page = ContinuousBatchingConfig().page_size
    pages = sum(math.ceil((len(p) + n) / page) for p, n in zip(prompts, max_new))
    cb_config = ContinuousBatchingConfig(
        num_blocks=max(1, min(pages, result["orca"]["n_slots"] // page)),
        max_batch_tokens=sum(len(p) for p in prompts),
    )
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb_config, workload_hints=hints, timeout=60
    ) as cb:
        _cb_generate(cb, prompts[:2], [2, 2], "warmup")  # warm-up, as for orca
        start = time.perf_counter()
        tokens = _cb_generate(cb, prompts, max_new, "bench")
        seconds = time.perf_counter() - start
        resolved = cb.continuous_batching_config  # what transformers made of cb_config and the hints
    result["transformers"] = {
        **run_record(result["model"], prompts, tokens, seconds),
        "attn_implementation": model.config._attn_implementation,
        "max_requests_per_batch": getattr(resolved, "max_requests_per_batch", None),
        "max_batch_tokens": getattr(resolved, "max_batch_tokens", None),
        "num_blocks": getattr(resolved, "num_blocks", cb_config.num_blocks),
        "page_size": page,
        "same_tokens_as_orca": sum(a == b for a, b in zip(tokens, orca_tokens)),
    }
    del model, cb
    _free_memory(torch)


def _cb_generate(manager: Any, prompts: list[list[int]], max_new: list[int], tag: str) -> list[list[int]]:
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt, n in zip(ids, prompts, max_new):
        manager.add_request(prompt, request_id=request_id, max_new_tokens=n, eos_token_id=-1)
    finished: dict[str, Any] = {}
    while len(finished) < len(ids):
        out = manager.get_result(timeout=600)
        if out is None:
            raise RuntimeError(f"transformers' continuous batching stopped with {len(ids) - len(finished)} left")
        if out.is_finished():
            if out.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed {out.request_id}: {out.error}")
            finished[out.request_id] = out
    return [list(finished[i].generated_tokens) for i in ids]


def model_shape(model: Any, config: Any) -> dict[str, int]:
    """What the FLOP count needs: the decoder's linear weights (every nn.Linear of orca's model but the LM
    head; the same architecture as transformers' model) and the attention and head sizes."""
    from torch import nn

    linear = sum(
        m.weight.numel() for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"
    )
    return {
        "linear_params": linear,
        "num_layers": config.num_layers,
        "attention_width": config.num_heads * config.head_dim,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
    }


def workload_flops(shape: dict[str, int], prompts: Sequence[Sequence[int]], generated: Sequence[int]) -> float:
    """Model FLOPs of the workload, counted the usual way (2 per multiply-add, nothing recomputed):
    - the decoder's linear layers for each token that goes through them: the prompt and every generated
      token but the last;
    - the LM head (hidden x vocab) once per generated token: logits are needed for the last row only;
    - attention scores and the weighted sum of values: 4 x layers x (heads x head_dim) per causal
      (query, key) pair.
    """
    per_pair = 4 * shape["num_layers"] * shape["attention_width"]
    head = 2 * shape["hidden_size"] * shape["vocab_size"]
    total = 0.0
    for prompt, n in zip(prompts, generated):
        m = len(prompt) + n - 1  # tokens through the layers
        total += 2 * shape["linear_params"] * m + head * n + per_pair * m * (m + 1) / 2
    return total


def run_record(model: dict[str, Any], prompts: list[list[int]], tokens: list[list[int]], seconds: float) -> dict:
    """What every timed offline run reports: time, generated tokens, tokens/s and the model FLOPs done."""
    generated = sum(len(t) for t in tokens)
    return {
        "seconds": seconds,
        "generated_tokens": generated,
        "tokens_per_second": generated / seconds,
        "model_flops": workload_flops(model, prompts, [len(t) for t in tokens]),
    }


def measure_matmul_peak(dtype: str, device: str, seconds: float) -> float:
    """FLOP/s of the best square matmul the device sustains (the usual stand-in for peak)."""
    import torch

    best = 0.0
    for n in (1024, 2048):
        a = torch.randn(n, n, dtype=getattr(torch, dtype), device=device)
        b = torch.randn(n, n, dtype=getattr(torch, dtype), device=device)
        a @ b  # warm-up
        deadline = time.perf_counter() + seconds / 2
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            for _ in range(3):
                a @ b
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            best = max(best, 3 * 2 * n**3 / (time.perf_counter() - start))
    return best


def _free_memory(torch: Any) -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def print_offline(result: dict[str, Any]) -> None:
    print(f"{result['trace']['num_requests']} requests, prompts "
          f"U{tuple(result['trace']['prompt_len'])}, new tokens U{tuple(result['trace']['max_new_tokens'])}, "
          f"{result['dtype']} on {result['device']} ({result['torch_threads']} threads)")
    print(f"matmul peak: {result['peak_flops'] / 1e9:.1f} GFLOP/s")
    for name in ("orca", "transformers"):
        if name in result:
            r = result[name]
            print(f"{name:<13} {r['generated_tokens']:>6} tokens in {r['seconds']:7.2f} s = "
                  f"{r['tokens_per_second']:8.1f} tok/s, MFU {100 * r['mfu']:5.1f}%")
    if "ratio" in result:
        same = result["transformers"]["same_tokens_as_orca"]
        print(f"orca / transformers: {result['ratio']:.2f}x (identical greedy tokens for {same}/"
              f"{result['trace']['num_requests']} requests)")
    b = result["breakdown"]
    print(f"orca iteration breakdown ({b['iterations']} iterations, mean batch {b['mean_batch_size']:.1f}):")
    for k, v in b["seconds"].items():
        print(f"  {k:<12} {v:8.3f} s  {100 * b['fraction'].get(k, 0):5.1f}%")


# -- shared ---------------------------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(path: str, result: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1, allow_nan=False, default=_json_default) + "\n")
    print(f"wrote {path}")


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _spec(args: argparse.Namespace, preset: str) -> TraceSpec:
    return PRESETS[preset].with_options(
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        max_new_tokens=args.max_new_tokens,
        token_ids=args.token_ids,
        seed=args.seed,
    )


def _range(text: str) -> tuple[int, int]:
    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orca-bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def workload(sp: argparse.ArgumentParser, preset: str) -> None:
        spec = PRESETS[preset]
        sp.add_argument("--num-requests", type=int, help=f"requests per run (default: {spec.num_requests})")
        sp.add_argument("--prompt-len", type=_range, metavar="A:B",
                        help=f"prompt tokens ~ U(A, B) (default: {spec.prompt_len[0]}:{spec.prompt_len[1]})")
        sp.add_argument("--max-new-tokens", type=_range, metavar="C:D",
                        help=f"new tokens ~ U(C, D) (default: {spec.max_new_tokens[0]}:{spec.max_new_tokens[1]})")
        sp.add_argument("--token-ids", type=_range, metavar="LOW:HIGH",
                        help=f"prompt token ids ~ U[LOW, HIGH) (default: {spec.token_ids[0]}:{spec.token_ids[1]})")
        sp.add_argument("--seed", type=int, help="trace seed (default: 0)")
        sp.add_argument("--json", metavar="PATH", help="write every number to this JSON file")

    t = sub.add_parser("trace", help="the Orca workload against a running Triton server, at a sweep of rates")
    t.add_argument("--url", default="localhost:8001", help="Triton gRPC address (default: %(default)s)")
    t.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated (default: %(default)s)")
    t.add_argument("--rates", help="arrival rates in req/s, comma-separated (default: "
                   + "; with --paper: ".join(",".join(f"{r:g}" for r in DEFAULT_RATES[p]) for p in ("default", "paper"))
                   + ")")
    t.add_argument("--paper", action="store_true", help="the paper's lengths: prompts U(32,512), new tokens U(1,128)")
    workload(t, "default")
    t.add_argument("--unloaded-requests", type=int, default=8,
                   help="requests sent one at a time first, per model, for the unloaded latency (default: %(default)s;"
                        " 0 uses the lowest rate instead)")
    t.add_argument("--slo-multiple", type=float, default=4.0,
                   help="SLO = this x the unloaded median normalized latency (default: %(default)s)")
    t.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for a run's answers")
    t.add_argument("--plot", metavar="PATH", help="write the latency-throughput figure (PNG)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.set_defaults(func=cmd_trace)

    o = sub.add_parser("offline", help="orca.LLM against transformers' continuous batching, in this process")
    o.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    o.add_argument("--max-bs", type=int, default=32, help="orca's max_bs (default: %(default)s)")
    o.add_argument("--dtype", default="auto", help="engine dtype (default: %(default)s)")
    o.add_argument("--skip-transformers", action="store_true", help="run orca only")
    o.add_argument("--peak-seconds", type=float, default=4.0, help="time spent measuring the matmul peak")
    workload(o, "offline")
    o.set_defaults(func=cmd_offline)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, InferenceServerException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
