"""orca-bench: reproduce Orca's evaluation here (docs/BENCHMARKS.md).

``orca-bench trace``: the paper's workload (orca_client.trace) against models of a running Triton server,
over tritonclient gRPC (streaming for decoupled models such as orca_gpt, one plain async infer per request
for request_level_gpt), at a sweep of arrival rates. Per request: end-to-end latency, time to first token,
inter-token latency and normalized latency (end-to-end / generated tokens); per rate: throughput and
median / p90 / p99, and the K/V pool's use read from Triton's metrics endpoint (--metrics-url, sampled
every --metrics-interval seconds during the rate point): the mean of orca_kv_used_tokens /
(orca_kv_allocated_blocks x block size) over the samples with a block allocated, and the
orca_preemptions_total the point added (none for models without these gauges, such as
request_level_gpt). Writes JSON and the paper's Figure 10 (median normalized latency against throughput)
plus the throughput each model sustains within a latency SLO. The engine options (kv_admission,
max_num_batched_tokens, ...) are the served model's config.pbtxt parameters, recorded in the JSON. With
--timeline DIR each model also records its iteration timeline (orca/timeline.py) in DIR/MODEL.jsonl:
orca-bench reloads the model with its config's trace parameter set to that file (Triton's explicit model
control: load_model with a config override), drives it, reloads it with the trace parameter it had, and
then draws the trace (as orca-bench timeline does) when DIR is readable here. DIR is a path on the
server's host: the same directory when the server runs on this machine (make serve).

``orca-bench timeline``: an iteration timeline (a trace file written by the engine: EngineConfig.trace,
LLM(..., trace=path), a Triton model's trace parameter, or orca-bench trace --timeline) as a
Chrome/Perfetto trace JSON (one track per request, one for the iterations: open it in ui.perfetto.dev)
and a PNG: requests as horizontal bars coloured by phase over iterations, as in the Orca paper's Figure
4, with the batch size, the queue and the K/V pool in use below. Reads the rotated files (TRACE.1, ...)
too.

``orca-bench offline``: the same requests through orca's engine (stepped as orca.LLM.generate steps it)
and through transformers' continuous batching on the same weights, in one process, in turn: tokens/s,
model FLOPs utilisation against a matmul peak measured in the same run, whether the greedy tokens are
identical, the K/V pool's use (utilization = used tokens / slots of allocated blocks, averaged over
iterations weighted by their duration; mean and peak allocated blocks; preemptions), and where an
iteration spends its time (a second run with the engine's profiling hook, engine.profile). Engine
options: --kv-admission (reserve, on_demand, or both: one engine per policy on the same requests, side
by side), --block-size, --max-num-batched-tokens, --n-slots, --max-bs, --dtype, --linear-backend,
--attention-backend, --cuda-graphs, --torch-compile. Every
system also gets the single-stream figure: one request alone (a 64-token prompt, 128 new tokens, after a
warm-up), decode tokens/s = 127 / (its time - the time of the same prompt with 1 new token), medians of 3. --peers
vllm,llama_cpp runs CPU peer systems on the same requests (greedy, EOS ignored), each in the venv its
setup script makes (scripts/peers/, docs/PEERS.md), in a subprocess: vLLM's CPU backend on orca's
checkpoint, llama.cpp on GGUFs converted from it (NAME:VARIANT picks vLLM's dtype or llama.cpp's GGUF:
f32, bf16, q8_0, shipped); their tokens/s, orca's ratio to each, single-stream decode tokens/s and the
requests whose greedy tokens equal orca's.

``orca-bench distributed``: the control plane of distributed execution (orca/distributed.py), in this
process: for each layout (--layouts, tp x pp) a fresh engine runs B requests (--batch) at each context
length (--context-lens), decode iterations only measured. Per iteration: the plan's pickled size, the
driver's submit-to-collect time, and the workers' own execute time (the ranks' earliest start to latest
end, engine.profile on); overhead = the first minus the second, the control plane's share (pickling,
socket writes and reads, the result's way back). Medians; n_workers 1 so iterations do not overlap.

``orca-bench linears``: the model's linear layers alone, as one decode iteration meets them: every
layer's projections in order, then the LM head, on --rows token rows (the batch size of a decode
iteration, or a prompt's tokens at 512), with each linear_backend (reference: torch's F.linear on the
checkpoint layout; onednn: the weights packed for oneDNN, orca.models.layers.PackedLinear; hybrid: onednn
below HYBRID_MIN_ROWS rows, F.linear from there), in turn in this process; median of --repeats passes
after a warm-up. Beside them, the memory bandwidth of a sum over as many bytes as the weights (the bound a
pass at one row cannot beat: every weight is read once). Reports ms per pass, the weights' GB/s and
GFLOP/s per backend and rows, and the ratios reference / onednn and onednn / hybrid.

``orca-bench serve``: the servers under guidellm: orca's OpenAI API against vLLM's OpenAI server, each
started and stopped in turn, with orca's per-hop latency at batch 1 (client/orca_client/bench/serve.py).

Benchmarks print numbers; they do not pass or fail.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import re
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tqdm import tqdm
from tritonclient.utils import InferenceServerException

from orca_client.bench.common import cb_generate, machine_info, write_json
from orca_client.client import OrcaClient, parse_result
from orca_client.trace import PRESETS, TraceRequest, TraceSpec, make_trace, parse_range

DEFAULT_MODELS = ("orca_gpt", "request_level_gpt")
DEFAULT_METRICS_URL = "http://localhost:8002/metrics"
# The engine options of a served model that the trace table's header shows (from its config.pbtxt).
ENGINE_OPTIONS_SHOWN = ("max_bs", "kv_admission", "block_size", "max_num_batched_tokens")
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
        self.parameters: dict[str, str] = {}

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
    driver: Driver
    if config.get("model_transaction_policy", {}).get("decoupled", False):
        driver = StreamingDriver(url, model)
    elif int(config.get("max_batch_size", 0)) < 1:
        raise ValueError(f"{model} is neither decoupled nor batching: orca-bench drives orca_gpt-style models")
    else:
        driver = BatchingDriver(url, model)
    # The engine options the model runs with (config.pbtxt's parameters: kv_admission, block_size,
    # max_num_batched_tokens, ...), for the record.
    driver.parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
    return driver


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


# -- K/V pool use from Triton's metrics endpoint -------------------------------------------------------------
# orca_gpt's K/V gauges (model_repository/orca_gpt/1/model.py), labelled model="<name>", version="<n>".
KV_GAUGES = {
    "allocated": "orca_kv_allocated_blocks",
    "used": "orca_kv_used_tokens",
    "total": "orca_kv_total_blocks",
    "slots": "orca_kv_reserved_slots",  # slots in allocated blocks: allocated x block_size
    "preemptions": "orca_preemptions_total",
}
_SAMPLE_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str, model: str) -> dict[str, float]:
    """The samples of one model (label model="<model>") in Prometheus' text format, by metric name; the
    series of several versions of the model are added up."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_LINE.match(line)
        if m is None or dict(_LABEL.findall(m.group(2) or "")).get("model") != model:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def fetch_metrics(url: str, model: str, timeout: float = 5.0) -> dict[str, float] | None:
    """One scrape of the metrics endpoint; None when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode("utf-8", errors="replace")
    except (OSError, ValueError):  # URLError and timeouts are OSErrors; ValueError: a malformed URL
        return None
    return parse_metrics(text, model)


class KVSampler:
    """Samples a model's K/V gauges from Triton's metrics endpoint every `interval` seconds on a background
    thread, from __enter__ to __exit__ (one rate point). summary() is None when there is nothing to report:
    no URL, the endpoint unreachable, or a model without the gauges (request_level_gpt)."""

    def __init__(self, url: str | None, model: str, interval: float = 0.25, block_size: int = 16) -> None:
        self.url, self.model, self.interval, self.block_size = url, model, interval, block_size
        self.samples: list[dict[str, float]] = []
        self.note: str | None = None
        self._first: dict[str, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> KVSampler:
        if not self.url:
            self.note = "no metrics URL"
            return self
        first = fetch_metrics(self.url, self.model)
        if first is None:
            self.note = f"metrics endpoint {self.url} not reachable"
        elif KV_GAUGES["allocated"] not in first:
            self.note = f"{self.model} exports no {KV_GAUGES['allocated']}"
        else:
            self._first = first
            self.samples.append(first)
            self._thread = threading.Thread(target=self._run, name="orca-bench-metrics", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            sample = fetch_metrics(self.url or "", self.model)
            if sample is not None:
                self.samples.append(sample)

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            last = fetch_metrics(self.url or "", self.model)
            if last is not None:
                self.samples.append(last)

    def summary(self) -> dict[str, Any] | None:
        """Mean utilization (used tokens / slots of allocated blocks) and mean allocated blocks over the
        samples with a block allocated, their peak, and the preemptions counted during the point."""
        if self._first is None:
            return None
        g = KV_GAUGES
        busy = [s for s in self.samples if s.get(g["allocated"], 0) > 0]
        utilization: list[float] = []
        for s in busy:
            allocated = s[g["allocated"]]
            slots = s.get(g["slots"], 0.0)
            block_size = slots / allocated if slots > 0 else self.block_size
            utilization.append(s.get(g["used"], 0.0) / (allocated * block_size))
        sizes = {round(s[g["slots"]] / s[g["allocated"]]) for s in busy if s.get(g["slots"], 0) > 0}
        last = self.samples[-1]
        preemptions = None
        if g["preemptions"] in last and g["preemptions"] in self._first:
            preemptions = int(last[g["preemptions"]] - self._first[g["preemptions"]])
        return {
            "utilization": sum(utilization) / len(utilization) if utilization else None,
            "mean_allocated_blocks": sum(s[g["allocated"]] for s in busy) / len(busy) if busy else None,
            "peak_allocated_blocks": int(max((s[g["allocated"]] for s in busy), default=0)),
            "total_blocks": int(last[g["total"]]) if g["total"] in last else None,
            "block_size": sizes.pop() if len(sizes) == 1 else self.block_size,
            "preemptions": preemptions,
            "samples": len(self.samples),
            "busy_samples": len(busy),
            "interval": self.interval,
        }


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
        "metrics_url": args.metrics_url or None,
        "rates": rates,
        "models": models,
        "model_parameters": {m: d.parameters for m, d in drivers.items()},
        "unloaded": {},
        "runs": [],
    }
    notes: dict[str, str] = {}  # why a model has no K/V numbers
    timelines: dict[str, Path] = {}
    own_trace = {m: d.parameters.get("trace", "") for m, d in drivers.items()}  # restored afterwards
    traced: list[str] = []  # reloaded with the timeline on, not yet restored
    if args.timeline:
        if untraceable := [m for m, d in drivers.items() if "trace" not in d.parameters]:
            for driver in drivers.values():
                driver.close()
            raise ValueError(f"{', '.join(untraceable)} has no trace parameter in its config.pbtxt: it cannot "
                             "record a timeline")
        directory = Path(args.timeline).resolve()  # the server resolves a relative path from its own cwd
        directory.mkdir(parents=True, exist_ok=True)
        timelines = {m: directory / f"{m}.jsonl" for m in models}
        result["timelines"] = {m: str(p) for m, p in timelines.items()}
    try:
        with tqdm(total=total, unit="req", desc="orca-bench trace", disable=args.no_progress) as bar:
            lock = threading.Lock()

            def tick() -> None:  # called from the client's threads
                with lock:
                    bar.update(1)
            for model in models:
                if model in timelines:
                    bar.set_postfix_str(f"{model}: reloading with its timeline on")
                    reload_model(args.url, model, str(timelines[model]))
                    traced.append(model)
                if unloaded_trace:
                    bar.set_postfix_str(f"{model} unloaded")
                    records = run_closed_loop(drivers[model], unloaded_trace, args.timeout, tick)
                    result["unloaded"][model] = {
                        "summary": summarize(records, None), "requests": [r.to_json() for r in records]
                    }
                for rate in rates:
                    bar.set_postfix_str(f"{model} {rate:g} req/s")
                    sampler = KVSampler(args.metrics_url, model, args.metrics_interval, args.block_size)
                    with sampler:
                        records = run_open_loop(drivers[model], make_trace(spec, rate), args.timeout, tick)
                    result["runs"].append({
                        "model": model, "rate": rate, "summary": summarize(records, rate),
                        "kv": sampler.summary(), "requests": [r.to_json() for r in records],
                    })
                    if sampler.note and model not in notes:
                        notes[model] = sampler.note
                if model in timelines:
                    bar.set_postfix_str(f"{model}: reloading with its own trace parameter")
                    reload_model(args.url, model, own_trace[model])
                    traced.remove(model)
    finally:
        for model in traced:  # a run that failed half-way: the model must not keep tracing
            with contextlib.suppress(Exception):
                reload_model(args.url, model, own_trace[model])
        for driver in drivers.values():
            driver.close()
    result["kv_notes"] = notes
    add_slo(result, args.slo_multiple)
    print_trace(result)
    if args.json:
        write_json(args.json, result)
    if args.plot:
        plot_trace(result, args.plot)
    for model, path in timelines.items():
        if path.is_file():
            draw_timeline(str(path), str(path.with_suffix(".perfetto.json")), str(path.with_suffix(".png")),
                          title=f"{model}")
        else:
            print(f"{model}: the server wrote its timeline to {path} on its own host (not readable here)")
    return 0


def reload_model(url: str, model: str, trace: str) -> None:
    """Reloads a served model with its trace parameter set to `trace` ("" = off): Triton's load_model with
    a config override, the model's current config with that one parameter changed (a plain load_model
    would keep the loaded config: Triton reloads only what changed). Needs Triton's explicit model
    control, as make serve starts it."""
    client = grpcclient.InferenceServerClient(url)
    try:
        config = client.get_model_config(model, as_json=True)["config"]
        parameters = config.setdefault("parameters", {})
        if "trace" not in parameters:
            raise ValueError(f"{model} has no trace parameter in its config.pbtxt: it cannot record a timeline")
        parameters["trace"] = {"string_value": trace}
        client.load_model(model, config=json.dumps(config))
    finally:
        client.close()


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
    for model, params in result.get("model_parameters", {}).items():
        shown = {k: params[k] or "(default)" for k in ENGINE_OPTIONS_SHOWN if k in params}
        if shown:
            print(f"{model}: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    header = (f"{'model':<22} {'rate':>6} {'done':>5} {'req/s':>7} {'tok/s':>8} {'norm p50':>9} {'norm p90':>9} "
              f"{'e2e p50':>8} {'ttft p50':>8} {'itl p50':>8} {'kv util':>7} {'preempt':>7}")
    print(header)
    print("-" * len(header))
    for run in result["runs"]:
        s = run["summary"]
        kv = run.get("kv") or {}
        util = kv.get("utilization")
        preempt = kv.get("preemptions")
        print(f"{run['model']:<22} {run['rate']:>6g} {s['completed']:>5} {_f(s['throughput_rps'], 7, 3)} "
              f"{_f(s['throughput_tps'], 8, 1)} {_f(s['normalized']['p50'], 9, 4)} {_f(s['normalized']['p90'], 9, 4)} "
              f"{_f(s['e2e']['p50'], 8, 3)} {_f(s['ttft']['p50'], 8, 3)} {_f(s['itl']['p50'], 8, 4)} "
              f"{'-' if util is None else f'{100 * util:.1f}%':>7} {'-' if preempt is None else preempt:>7}")
    for model, note in result.get("kv_notes", {}).items():
        print(f"kv util / preempt of {model}: none ({note})")
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


# -- the timeline command ---------------------------------------------------------------------------------
def draw_timeline(trace: str, perfetto: str | None, png: str | None, title: str | None = None,
                  x: str = "iteration", max_requests: int | None = None) -> dict[str, Any]:
    """Reads a trace (orca.timeline.read_timeline), writes the Perfetto JSON and the PNG
    (orca_client.timeline), prints and returns its summary."""
    from orca.timeline import read_timeline
    from orca_client import timeline as tl

    timeline = read_timeline(trace)
    summary = tl.summarize(timeline)
    print(f"{trace}: {summary['scheduling']} scheduling, {summary['requests']} requests "
          f"({summary['finished']} finished), {summary['iterations']} iterations in {summary['seconds']:.3f} s, "
          f"mean batch size {summary['mean_batch_size']:.2f} (max {summary['max_batch_size']}, max_bs "
          f"{summary['max_bs']}), {summary['tokens_generated']} tokens generated, "
          f"{summary['preemptions']} preemptions, {summary['discarded_tokens']} tokens thrown away")
    if perfetto:
        tl.write_perfetto(timeline, perfetto)
        print(f"wrote {perfetto}")
    if png:
        tl.plot(timeline, png, title=title, x=x, max_requests=max_requests)
        print(f"wrote {png}")
    return summary


def cmd_timeline(args: argparse.Namespace) -> int:
    base = Path(args.trace)
    perfetto = str(base.with_suffix(".perfetto.json")) if args.perfetto is None else args.perfetto
    png = str(base.with_suffix(".png")) if args.png is None else args.png
    summary = draw_timeline(args.trace, perfetto, png, args.title, args.x, args.max_requests)
    if args.json:
        write_json(args.json, summary)
    return 0


# -- the offline command ----------------------------------------------------------------------------------
KV_ADMISSION_CHOICES = ("reserve", "on_demand", "both")
BREAKDOWN_PHASES = ("attention", "batched_ops", "sampling", "prepare", "scheduling")


def offline_policies(choice: str) -> tuple[str, ...]:
    """The K/V admission policies one offline run compares, in run order; the last is the primary one
    (result["orca"], compared with transformers): on_demand, the engine's default, when both run."""
    return ("reserve", "on_demand") if choice == "both" else (choice,)


def cmd_offline(args: argparse.Namespace) -> int:
    import torch

    from orca.loader import read_model_config, resolve_checkpoint

    spec = _spec(args, "offline")
    checkpoint = resolve_checkpoint(args.model)
    # The single stream must fit the model's positions and, when --n-slots is given, the K/V pool.
    context = min(read_model_config(checkpoint)[0].max_position_embeddings, args.n_slots or 1 << 62)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    high = min(spec.token_ids[1], vocab)
    spec = spec.with_options(token_ids=(min(spec.token_ids[0], high - 1), high))
    trace = make_trace(spec, None)
    prompts = [list(r.prompt_token_ids) for r in trace]
    max_new = [r.max_new_tokens for r in trace]
    policies = offline_policies(args.kv_admission)
    single = single_stream_workload(spec, context)
    peers = check_peers(args.peers)
    result: dict[str, Any] = {
        "benchmark": "offline", "machine": machine_info(), "command": sys.argv, "checkpoint": str(checkpoint),
        "trace": asdict(spec), "torch_threads": torch.get_num_threads(), "kv_admission": list(policies),
        "orca_policies": {},
    }
    tokens = {policy: run_orca_offline(args, policy, prompts, max_new, result, single) for policy in policies}
    primary = policies[-1]
    result["orca"] = result["orca_policies"][primary]
    if len(policies) > 1:  # recomputation after a preemption must not change a greedy continuation
        result["same_tokens_across_policies"] = sum(
            all(tokens[p][i] == tokens[primary][i] for p in policies) for i in range(len(prompts))
        )
    if not args.skip_transformers:
        hf_tokens = run_transformers_offline(checkpoint, prompts, max_new, result["orca"]["n_slots"], result)
        result["transformers"]["same_tokens_as_orca"] = _same(hf_tokens, tokens[primary])
        for policy in policies:
            result["orca_policies"][policy]["same_tokens_as_transformers"] = _same(hf_tokens, tokens[policy])
    # In the same process, right after the runs: the peak of the machine the runs just had.
    result["peak_flops"] = measure_matmul_peak(result["dtype"], result["device"], args.peak_seconds)
    runs = [*result["orca_policies"].values(), *([result["transformers"]] if "transformers" in result else [])]
    for run in runs:
        run["mfu"] = run["model_flops"] / run["seconds"] / result["peak_flops"]
    if "transformers" in result:
        hf_tps = result["transformers"]["tokens_per_second"]
        for run in result["orca_policies"].values():
            run["ratio_to_transformers"] = run["tokens_per_second"] / hf_tps
        result["ratio"] = result["orca"]["ratio_to_transformers"]
    if peers:
        run_peers_offline(args, peers, checkpoint, prompts, max_new, tokens[primary], single, result)
    print_offline(result)
    if args.json:
        write_json(args.json, result)
    return 0


def cmd_distributed(args: argparse.Namespace) -> int:
    import torch

    from orca import EngineConfig, LLMEngine, SamplingParams

    layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",")]
    context_lens = [int(x) for x in args.context_lens.split(",")]
    result: dict[str, Any] = {
        "benchmark": "distributed", "machine": machine_info(), "command": sys.argv, "model": args.model,
        "batch": args.batch, "decode_steps": args.decode_steps, "runs": [],
    }
    for tp, pp in layouts:
        engine = LLMEngine(EngineConfig(
            model=args.model, device="cpu", dtype=args.dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp,
            n_workers=1, n_slots=args.batch * (max(context_lens) + args.decode_steps + 16), block_size=16,
        ))
        try:
            vocab = engine.model_config.vocab_size
            for ctx in context_lens:
                for i in range(args.batch):
                    prompt = [(7 * i + j) % vocab for j in range(ctx)]
                    engine.add_request(f"{tp}x{pp}-{ctx}-{i}", prompt, SamplingParams(
                        temperature=0, max_tokens=args.decode_steps, ignore_eos=True))
                engine.profile = True
                plan_bytes, durations, decode = [], [], {}
                while engine.has_unfinished():
                    engine.step()
                    it = engine.last_iteration
                    if it.num_initiation or it.batch_size != args.batch:
                        continue  # decode iterations of the whole batch only
                    durations.append(it.duration)
                    decode[it.batch_id] = it.duration
                    if tp * pp > 1:
                        plan_bytes.append(engine.executor.plan_bytes)
                overheads = []
                if tp * pp > 1:  # a rank's timing may arrive after its iteration's result: match by batch id
                    spans: dict[int, list[Any]] = {}
                    for t in engine.executor.stage_timings:
                        spans.setdefault(t.batch_id, []).append(t)
                    for batch_id, duration in decode.items():
                        if len(spans.get(batch_id, ())) == tp * pp:
                            busy = max(t.end for t in spans[batch_id]) - min(t.start for t in spans[batch_id])
                            overheads.append(duration - busy)
                run = {
                    "tensor_parallel_size": tp, "pipeline_parallel_size": pp, "context_len": ctx,
                    "tokens_held": args.batch * ctx, "iterations": len(durations),
                    "iteration_ms_median": 1e3 * float(np.median(durations)) if durations else None,
                    "plan_bytes_median": float(np.median(plan_bytes)) if plan_bytes else None,
                    "overhead_ms_median": 1e3 * float(np.median(overheads)) if overheads else None,
                    "overhead_ms_p90": 1e3 * float(np.percentile(overheads, 90)) if overheads else None,
                }
                result["runs"].append(run)
                print(f"tp {tp} x pp {pp}  context {ctx:5d}  tokens held {run['tokens_held']:6d}  "
                      f"iteration {run['iteration_ms_median']:.2f} ms  "
                      + (f"plan {run['plan_bytes_median']:.0f} B  control-plane overhead "
                         f"{run['overhead_ms_median']:.3f} ms (p90 {run['overhead_ms_p90']:.3f})"
                         if overheads else "(in-process worker: no control plane)"), flush=True)
        finally:
            engine.shutdown()
    result["torch_threads"] = torch.get_num_threads()
    if args.json:
        write_json(args.json, result)
    return 0


def _same(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> int:
    """Requests whose token lists are identical."""
    return sum(list(x) == list(y) for x, y in zip(a, b))


def run_orca_offline(
    args: argparse.Namespace, policy: str, prompts: list[list[int]], max_new: list[int], result: dict[str, Any],
    single: dict[str, Any],
) -> list[list[int]]:
    """One K/V admission policy on a fresh engine: warm-up, the timed run (tokens/s and the K/V pool's use,
    from engine.last_iteration after every iteration), then the profiled run (iteration_breakdown), then
    the single-stream figure (orca_client.peers.runner_common.single_stream, as every peer measures it).
    Stores the record in result["orca_policies"][policy]; returns each request's tokens."""
    import torch

    from orca import EngineConfig, LLMEngine, SamplingParams
    from orca_client.peers.runner_common import single_stream

    engine = LLMEngine(EngineConfig(
        model=args.model, max_bs=args.max_bs, dtype=args.dtype, kv_admission=policy, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens or None, n_slots=args.n_slots,
        linear_backend=args.linear_backend, attention_backend=args.attention_backend, cuda_graphs=args.cuda_graphs,
        torch_compile=args.torch_compile,
    ))
    try:
        result["dtype"] = str(engine.config.torch_dtype).removeprefix("torch.")
        result["device"] = str(engine.config.torch_device)
        # What auto resolved to (the in-process worker's; the offline engine always has one).
        worker = getattr(engine.executor, "worker", None)
        result["linear_backend"] = getattr(worker, "linear_backend", None)
        result["attention_backend"] = getattr(worker, "attention_backend", None)
        graphs = getattr(worker, "decode_graphs", None)
        result["cuda_graph_sizes"] = list(graphs.sizes) if graphs is not None and graphs.captured else None
        compiled = getattr(worker, "compiled", None)
        result["compiled_forward_seconds"] = compiled.compile_seconds if compiled is not None else None
        result["model"] = model_shape(engine.model_config)
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_new]
        warm = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        drive(engine, prompts[:2], [warm] * len(prompts[:2]), "warmup")
        kv = KVUsage(engine.block_size)
        preemptions = engine.stats().preemptions
        start = time.perf_counter()
        tokens = drive(engine, prompts, params, "bench", lambda it, _: kv.add(it))
        seconds = time.perf_counter() - start
        stats = engine.stats()
        result["orca_policies"][policy] = {
            **run_record(result["model"], prompts, tokens, seconds),
            "kv_admission": policy,
            "max_bs": engine.config.max_bs,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "n_slots": engine.n_slots,
            "iterations": kv.iterations,
            "mean_batch_size": kv.mean_batch_size,
            "kv": {
                **kv.summary(),
                "total_blocks": stats.kv_total_blocks,
                "block_size": engine.block_size,
                "preemptions": stats.preemptions - preemptions,
            },
            "breakdown": iteration_breakdown(engine, prompts, params),
        }
        runs = itertools.count()

        def one(prompt: list[int], n: int, engine: Any = engine) -> list[int]:
            sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            return drive(engine, [prompt], [sp], f"single-{next(runs)}")[0]

        result["orca_policies"][policy]["single_stream"] = single_stream(one, single)
    finally:
        engine.shutdown()
    del engine
    _free_memory(torch)
    return tokens


def drive(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    params: Sequence[Any],
    tag: str,
    on_iteration: Callable[[Any, float], None] | None = None,
) -> list[list[int]]:
    """Runs the requests to completion on an LLMEngine the way orca.LLM.generate does (each request added
    as soon as the waiting queue takes it, then step() until none is left), calling
    ``on_iteration(engine.last_iteration, seconds of that step() call)`` after every step that completed an
    iteration. Returns each request's generated tokens, in input order."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    index = {request_id: i for i, request_id in enumerate(ids)}
    tokens: list[list[int]] = [[] for _ in ids]
    pending = list(range(len(ids)))[::-1]  # a stack: the next request on top
    while pending or engine.has_unfinished():
        while pending and engine.stats().waiting < engine.config.max_queue:
            i = pending.pop()
            engine.add_request(ids[i], list(prompts[i]), params[i])
        before = engine.last_iteration
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        for out in outputs:
            if out.finished:
                if out.error:
                    raise RuntimeError(f"generation failed: {out.error}")
                tokens[index[out.request_id]] = list(out.token_ids)
        if on_iteration is not None and engine.last_iteration is not before:
            on_iteration(engine.last_iteration, seconds)
    return tokens


@dataclass
class KVUsage:
    """The K/V pool's use over a run, from each iteration's engine.last_iteration (the moment after the
    iteration, before finished requests free their blocks), every iteration weighted by its duration.
    Utilization = used tokens / slots of the allocated blocks (kv_used_tokens / (kv_allocated_blocks x
    block_size)): what paging leaves unused inside blocks, and what reserve admission holds for tokens not
    generated yet. Iterations with no block allocated are left out."""

    block_size: int
    iterations: int = 0
    batch_sizes: int = 0
    peak_allocated_blocks: int = 0
    _weight: float = 0.0
    _utilization: float = 0.0
    _allocated: float = 0.0

    def add(self, it: Any) -> None:
        self.iterations += 1
        self.batch_sizes += it.batch_size
        self.peak_allocated_blocks = max(self.peak_allocated_blocks, it.kv_allocated_blocks)
        if it.kv_allocated_blocks > 0:
            self._weight += it.duration
            self._utilization += it.duration * it.kv_used_tokens / (it.kv_allocated_blocks * self.block_size)
            self._allocated += it.duration * it.kv_allocated_blocks

    @property
    def mean_batch_size(self) -> float:
        return self.batch_sizes / self.iterations if self.iterations else 0.0

    def summary(self) -> dict[str, Any]:
        w = self._weight
        return {
            "utilization": self._utilization / w if w > 0 else None,
            "mean_allocated_blocks": self._allocated / w if w > 0 else None,
            "peak_allocated_blocks": self.peak_allocated_blocks,
        }


def iteration_breakdown(engine: Any, prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    """Runs the same requests again with the engine's profiling on (engine.profile: each iteration's
    timings, device-synced on a GPU): attention (the per-request split, timed inside selective_attention),
    the batched ops (every other op of the model, logits included), sampling, input preparation, and
    scheduling (the rest of step(): selection, K/V blocks, plan, stop checks, detokenisation, outputs)."""
    totals = dict.fromkeys(BREAKDOWN_PHASES, 0.0)
    counts = {"iterations": 0, "batch": 0, "timed": 0}

    def on_iteration(it: Any, step: float) -> None:
        t = it.timings
        counts["iterations"] += 1
        counts["batch"] += it.batch_size
        if not t:
            return
        counts["timed"] += 1
        totals["attention"] += t.get("attention", 0.0)
        totals["batched_ops"] += t.get("model", 0.0) - t.get("attention", 0.0)
        totals["sampling"] += t.get("sample", 0.0)
        totals["prepare"] += t.get("prepare", 0.0)
        totals["scheduling"] += step - (t.get("prepare", 0.0) + t.get("model", 0.0) + t.get("sample", 0.0))

    engine.profile = True
    try:
        drive(engine, prompts, params, "breakdown", on_iteration)
    finally:
        engine.profile = False
    total = sum(totals.values())
    iterations = counts["iterations"]
    return {
        "seconds": totals,
        "fraction": {k: v / total for k, v in totals.items()} if total > 0 else {},
        "total_seconds": total,
        "iterations": iterations,
        "mean_batch_size": counts["batch"] / iterations if iterations else 0.0,
        "profiled_iterations": counts["timed"],
        "attention_measured": totals["attention"] > 0,
    }


def run_transformers_offline(
    checkpoint: Path, prompts: list[list[int]], max_new: list[int], n_slots: int, result: dict[str, Any]
) -> list[list[int]]:
    """transformers' continuous batching (its paged-attention manager) with a per-request max_new_tokens,
    EOS disabled and greedy decoding, on the same weights and dtype; its cache within orca's K/V pool of
    n_slots tokens. Stores result["transformers"]; returns each request's tokens."""
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
        num_blocks=max(1, min(pages, n_slots // page)),
        max_batch_tokens=sum(len(p) for p in prompts),
    )
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb_config, workload_hints=hints, timeout=60
    ) as cb:
        cb_generate(cb, prompts[:2], [2, 2], ["warmup-0", "warmup-1"])  # warm-up, as for orca
        start = time.perf_counter()
        tokens = cb_generate(cb, prompts, max_new, [f"bench-{i}" for i in range(len(prompts))])
        seconds = time.perf_counter() - start
        resolved = cb.continuous_batching_config  # what transformers made of cb_config and the hints
    result["transformers"] = {
        **run_record(result["model"], prompts, tokens, seconds),
        "attn_implementation": model.config._attn_implementation,
        "max_requests_per_batch": getattr(resolved, "max_requests_per_batch", None),
        "max_batch_tokens": getattr(resolved, "max_batch_tokens", None),
        "num_blocks": getattr(resolved, "num_blocks", cb_config.num_blocks),
        "page_size": page,
    }
    del model, cb
    _free_memory(torch)
    return tokens


def single_stream_workload(spec: TraceSpec, context: int) -> dict[str, Any]:
    """The single-stream request every system runs: a 64-token prompt drawn like the trace's (same token
    range, the next seed), 128 new tokens, 3 timed repeats; within a shorter `context` (the model's
    positions), half of it for the prompt and the rest for new tokens."""
    prompt_len = min(64, context // 2)
    new = min(128, context - prompt_len)
    one = spec.with_options(num_requests=1, prompt_len=(prompt_len, prompt_len), max_new_tokens=(new, new),
                            seed=spec.seed + 1)
    return {"prompt": list(make_trace(one, None)[0].prompt_token_ids), "max_tokens": new, "repeats": 3}


def check_peers(text: str | None) -> list[Any]:
    """--peers parsed and the peers' venvs found before anything runs (a clear error naming the setup
    script otherwise). The default variants follow orca's dtype, known once its engine exists:
    run_peers_offline parses again then."""
    if not text:
        return []
    from orca_client.peers import PeerUnavailable, parse_peers, peer_python

    specs = parse_peers(text, "float32")
    for spec in specs:
        try:
            peer_python(spec.name)
        except PeerUnavailable as exc:
            raise ValueError(str(exc)) from None
    return specs


def run_peers_offline(
    args: argparse.Namespace, peers: list[Any], checkpoint: Path, prompts: list[list[int]], max_new: list[int],
    orca_tokens: list[list[int]], single: dict[str, Any], result: dict[str, Any],
) -> None:
    """Each peer (orca_client.peers) on the same requests and the same single-stream request, in its own
    venv, one after the other. Stores result["peers"][NAME:VARIANT]: the peer's record (without its
    tokens), orca's tokens/s over the peer's, model FLOPs and MFU against this run's matmul peak, and the
    requests whose greedy tokens equal orca's. A peer that fails is recorded with its error."""
    from orca.loader import default_model_path
    from orca_client.peers import PeerUnavailable, parse_peers, peer_model, run_peer

    model_arg = Path(args.model).expanduser() if args.model else default_model_path()
    source_gguf = model_arg if model_arg.suffix == ".gguf" else None
    orca = result["orca"]
    result["peers"] = {}
    for spec in parse_peers(args.peers, result["dtype"]):
        print(f"running {spec.label} (its setup: {spec.name}) ...", file=sys.stderr, flush=True)
        try:
            peer = run_peer(spec, peer_model(spec, checkpoint, source_gguf), prompts, max_new,
                            result["torch_threads"], args.max_bs, single, args.peer_timeout)
        except (PeerUnavailable, RuntimeError, OSError, ValueError) as exc:
            print(f"error: {spec.label}: {exc}", file=sys.stderr)
            result["peers"][spec.label] = {"error": str(exc)}
            continue
        tokens = peer.pop("tokens")
        peer_single = peer["single_stream"]
        peer["same_tokens_as_orca"] = _same(tokens, orca_tokens)
        peer["single_stream"]["same_tokens_as_orca"] = peer_single.pop("tokens") == orca["single_stream"]["tokens"]
        peer["model_flops"] = workload_flops(result["model"], prompts, [len(t) for t in tokens])
        peer["mfu"] = peer["model_flops"] / peer["seconds"] / result["peak_flops"]
        peer["ratio_orca_to_peer"] = orca["tokens_per_second"] / peer["tokens_per_second"]
        result["peers"][spec.label] = peer


def model_shape(config: Any) -> dict[str, int]:
    """What the FLOP count needs, from the engine's ModelConfig (engine.model_config): the decoder's linear
    weights (every projection of a layer, biases left out; the LM head is counted apart) and the attention
    and head sizes. Per layer: Q, K, V (K and V with num_kv_heads) and the output projection, then the MLP:
    up and down, plus the gate for the gated (llama) MLP."""
    e, i = config.hidden_size, config.intermediate_size
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    mlp_matrices = 3 if config.architecture == "llama" else 2
    per_layer = e * (q + 2 * kv) + q * e + mlp_matrices * e * i
    return {
        "linear_params": config.num_layers * per_layer,
        "num_layers": config.num_layers,
        "attention_width": q,
        "hidden_size": e,
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
    policies = result["orca_policies"]
    first = next(iter(policies.values()))
    budget = first["max_num_batched_tokens"]
    print(f"{result['trace']['num_requests']} requests, prompts "
          f"U{tuple(result['trace']['prompt_len'])}, new tokens U{tuple(result['trace']['max_new_tokens'])}, "
          f"{result['dtype']} on {result['device']} ({result['torch_threads']} threads); orca: max_bs "
          f"{first['max_bs']}, {first['kv']['total_blocks']} K/V blocks of {first['kv']['block_size']} tokens, "
          f"{'no token budget' if budget is None else f'{budget} tokens per iteration'}")
    print(f"matmul peak: {result['peak_flops'] / 1e9:.1f} GFLOP/s")
    rows = [(f"orca {p}", r) for p, r in policies.items()]
    if "transformers" in result:
        rows.append(("transformers", result["transformers"]))
    for name, r in rows:
        line = (f"{name:<16} {r['generated_tokens']:>6} tokens in {r['seconds']:7.2f} s = "
                f"{r['tokens_per_second']:8.1f} tok/s, MFU {100 * r['mfu']:5.1f}%")
        if "ratio_to_transformers" in r:
            line += (f", {r['ratio_to_transformers']:.2f}x transformers (identical greedy tokens for "
                     f"{r['same_tokens_as_transformers']}/{result['trace']['num_requests']} requests)")
        print(line)
    print_single_and_peers(result)
    if "same_tokens_across_policies" in result:
        print(f"identical tokens under every policy: {result['same_tokens_across_policies']}/"
              f"{result['trace']['num_requests']} requests")
    print("K/V pool (time-weighted over iterations; utilization = used tokens / slots of allocated blocks):")
    print(f"  {'policy':<10} {'util':>7} {'mean blocks':>11} {'peak blocks':>11} {'preempt':>8} {'iters':>6} "
          f"{'mean batch':>10}")
    for policy, r in policies.items():
        kv = r["kv"]
        util = "-" if kv["utilization"] is None else f"{100 * kv['utilization']:.1f}%"
        mean = "-" if kv["mean_allocated_blocks"] is None else f"{kv['mean_allocated_blocks']:.1f}"
        print(f"  {policy:<10} {util:>7} {mean:>11} {kv['peak_allocated_blocks']:>11} {kv['preemptions']:>8} "
              f"{r['iterations']:>6} {r['mean_batch_size']:>10.1f}")
    print("orca iteration breakdown (a second, profiled run):")
    print(f"  {'':<12}" + "".join(f" {p + ' (' + str(r['breakdown']['iterations']) + ' it)':>24}"
                                  for p, r in policies.items()))
    for k in BREAKDOWN_PHASES:
        cells = [f"{r['breakdown']['seconds'][k]:8.3f} s {100 * r['breakdown']['fraction'].get(k, 0):5.1f}%"
                 for r in policies.values()]
        print(f"  {k:<12}" + "".join(f" {c:>24}" for c in cells))


def print_single_and_peers(result: dict[str, Any]) -> None:
    """Every system's tokens/s, orca's ratio to it, its single-stream figures and its greedy agreement
    with orca."""
    n = result["trace"]["num_requests"]
    ss = result["orca"]["single_stream"]
    print(f"single stream ({ss['prompt_tokens']}-token prompt, {ss['max_tokens']} new tokens, median of "
          f"{ss['repeats']}; decode = the tokens after the first):")
    print(f"  {'system':<18} {'tok/s':>8} {'orca/peer':>9} {'1-stream tok/s':>14} {'decode tok/s':>12} "
          f"{'same tokens':>11} {'load s':>7}")
    rows = [(f"orca {p}", r) for p, r in result["orca_policies"].items()]
    rows += list(result.get("peers", {}).items())
    for name, r in rows:
        if "error" in r:
            print(f"  {name:<18} failed: {r['error']}")
            continue
        s = r["single_stream"]
        decode = "-" if s["decode_tokens_per_second"] is None else f"{s['decode_tokens_per_second']:.1f}"
        ratio = f"{r['ratio_orca_to_peer']:.2f}x" if "ratio_orca_to_peer" in r else ""
        same = (f"{r['same_tokens_as_orca']}/{n}" + ("" if s.get("same_tokens_as_orca") else "*")
                if "same_tokens_as_orca" in r else "")
        load = f"{r['load_seconds']:.0f}" if "load_seconds" in r else ""
        print(f"  {name:<18} {r['tokens_per_second']:>8.1f} {ratio:>9} {s['tokens_per_second']:>14.1f} "
              f"{decode:>12} {same:>11} {load:>7}")
    if result.get("peers"):
        print("  (same tokens: requests whose greedy tokens equal orca's; * the single-stream tokens differ)")


# -- the linears command ----------------------------------------------------------------------------------
def cmd_linears(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from orca.config import EngineConfig
    from orca.loader import load_model, resolve_checkpoint
    from orca.models.layers import PackedLinear, onednn_packs
    from orca_client.peers.runner_common import timed

    dtype = EngineConfig(dtype=args.dtype, device="cpu").torch_dtype  # validated: a bad name is a ValueError
    if not onednn_packs(dtype):
        raise ValueError(f"oneDNN cannot pack {dtype} on this CPU: nothing to compare")
    model, _ = load_model(resolve_checkpoint(args.model), dtype, torch.device("cpu"))
    # The weights in the order an iteration uses them; the head last (the embedding's when tied).
    weights = [m.weight.detach() for m in model.modules() if type(m) is nn.Linear and m is not model.lm_head]
    head = model.lm_head.weight if model.lm_head is not None else model.input_embedding.weight
    weights.append(head.detach())
    packed = [PackedLinear(w, None) for w in weights]
    hybrid = [PackedLinear(w, None, keep_weight=True) for w in weights]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    params = sum(w.numel() for w in weights)
    rows = [int(r) for r in args.rows.split(",")]
    backends: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        "reference": lambda x, i: F.linear(x, weights[i]),
        "onednn": lambda x, i: packed[i](x),
        "hybrid": lambda x, i: hybrid[i](x),
    }

    def median_seconds(fn: Callable[[], object]) -> float:
        fn()  # warm-up
        return statistics.median(timed(fn)[1] for _ in range(args.repeats))

    with torch.inference_mode():
        buffer = torch.ones(nbytes // 4, dtype=torch.float32)
        bandwidth = nbytes / median_seconds(buffer.sum) / 1e9
        inputs = {n: {w.shape[1]: torch.randn(n, w.shape[1], dtype=dtype) for w in weights} for n in rows}
        runs = []
        for n in rows:
            record: dict[str, Any] = {"rows": n}
            for name, linear in backends.items():
                def one_pass(n: int = n, linear: Callable = linear) -> None:
                    for i, w in enumerate(weights):
                        linear(inputs[n][w.shape[1]], i)
                seconds = median_seconds(one_pass)
                record[name] = {"ms": seconds * 1e3, "weights_gb_per_s": nbytes / seconds / 1e9,
                                "gflop_per_s": 2 * params * n / seconds / 1e9}
            record["ratio_reference_to_onednn"] = record["reference"]["ms"] / record["onednn"]["ms"]
            record["ratio_onednn_to_hybrid"] = record["onednn"]["ms"] / record["hybrid"]["ms"]
            runs.append(record)
    result = {
        "benchmark": "linears", "machine": machine_info(), "command": sys.argv, "dtype": str(dtype),
        "threads": torch.get_num_threads(), "weight_bytes": nbytes, "linears": len(weights),
        "sum_bandwidth_gb_per_s": bandwidth, "runs": runs,
    }
    print(f"{len(weights)} linear weights ({nbytes / 1e6:.0f} MB {str(dtype).removeprefix('torch.')}, the head "
          f"last), {torch.get_num_threads()} threads; memory bandwidth (sum over as many bytes): {bandwidth:.1f} GB/s")
    print(f"{'rows':>5} {'reference ms':>13} {'GB/s':>6} {'onednn ms':>10} {'GB/s':>6} {'GFLOP/s':>8} {'ratio':>6} "
          f"{'hybrid ms':>10} {'GFLOP/s':>8} {'onednn/hybrid':>14}")
    for r in runs:
        ref, one, hyb = r["reference"], r["onednn"], r["hybrid"]
        print(f"{r['rows']:>5} {ref['ms']:>13.1f} {ref['weights_gb_per_s']:>6.1f} {one['ms']:>10.1f} "
              f"{one['weights_gb_per_s']:>6.1f} {one['gflop_per_s']:>8.1f} {r['ratio_reference_to_onednn']:>5.2f}x "
              f"{hyb['ms']:>10.1f} {hyb['gflop_per_s']:>8.1f} {r['ratio_onednn_to_hybrid']:>13.2f}x")
    if args.json:
        write_json(args.json, result)
    return 0


# -- shared ---------------------------------------------------------------------------------------------------
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


def _number(kind: type, low: float, strict: bool) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or (strict and value == low) or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text}")
        return value

    return parse


_positive_int = _number(int, 0, strict=True)
_nonnegative_int = _number(int, 0, strict=False)
_positive_float = _number(float, 0.0, strict=True)


def _doc_paragraph(command: str) -> str:
    """The module docstring's paragraph on one command (its --help description)."""
    for paragraph in (__doc__ or "").split("\n\n"):
        if paragraph.startswith(f"``orca-bench {command}``"):
            return " ".join(paragraph.replace("``", "").split())
    return ""


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

    t = sub.add_parser("trace", help="the Orca workload against a running Triton server, at a sweep of rates",
                       description=_doc_paragraph("trace"))
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
    t.add_argument("--metrics-url", default=DEFAULT_METRICS_URL,
                   help="Triton's Prometheus metrics endpoint, sampled during each rate point for the K/V pool's "
                        "use (orca_kv_* gauges; \"\" turns it off) (default: %(default)s)")
    t.add_argument("--metrics-interval", type=_positive_float, default=0.25, metavar="SECONDS",
                   help="seconds between two samples of the metrics endpoint (default: %(default)s)")
    t.add_argument("--block-size", type=_positive_int, default=16,
                   help="K/V block size assumed when the gauges do not give it (orca_kv_reserved_slots / "
                        "orca_kv_allocated_blocks) (default: %(default)s)")
    t.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for a run's answers")
    t.add_argument("--plot", metavar="PATH", help="write the latency-throughput figure (PNG)")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--timeline", metavar="DIR",
                   help="record each model's iteration timeline in DIR/MODEL.jsonl (reloads the model with its trace "
                        "parameter set, then with the one it had; DIR must be the same path on the server's host) and "
                        "draw it: DIR/MODEL.perfetto.json, DIR/MODEL.png")
    t.set_defaults(func=cmd_trace)

    tl = sub.add_parser("timeline", help="an iteration timeline as a Perfetto trace JSON and a PNG",
                        description=_doc_paragraph("timeline"))
    tl.add_argument("trace", metavar="TRACE", help="the trace file (JSON lines; TRACE.1, TRACE.2, ... are read too)")
    tl.add_argument("--perfetto", metavar="PATH",
                    help="Chrome/Perfetto trace JSON to write (default: TRACE with suffix .perfetto.json; \"\": none)")
    tl.add_argument("--png", metavar="PATH", help="picture to write (default: TRACE with suffix .png; \"\": none)")
    tl.add_argument("--x", choices=("iteration", "time"), default="iteration",
                    help="the picture's horizontal axis: iterations (the paper's Figure 4) or seconds "
                         "(default: %(default)s)")
    tl.add_argument("--title", help="a name put before the scheduling (iteration- or request-level) in the picture's "
                    "heading, e.g. the model (default: none)")
    tl.add_argument("--max-requests", type=_positive_int, metavar="N",
                    help="draw only the first N requests (default: all)")
    tl.add_argument("--json", metavar="PATH", help="write the summary to this JSON file")
    tl.set_defaults(func=cmd_timeline)

    o = sub.add_parser("offline", help="orca's engine against transformers' continuous batching, in this process, "
                       "and optionally CPU peers (vLLM, llama.cpp) in their own venvs",
                       description=_doc_paragraph("offline"))
    o.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    o.add_argument("--max-bs", type=int, default=32, help="orca's max_bs (default: %(default)s)")
    o.add_argument("--dtype", default="auto", help="engine dtype (default: %(default)s)")
    o.add_argument("--linear-backend", default="auto", choices=("auto", "hybrid", "onednn", "reference"),
                   help="EngineConfig.linear_backend (default: %(default)s; hybrid on a CPU where a second copy "
                        "of the weights fits, else onednn)")
    o.add_argument("--attention-backend", default="auto", choices=("auto", "reference", "batched", "flex"),
                   help="EngineConfig.attention_backend (default: %(default)s; batched on a CPU, reference on CUDA)")
    o.add_argument("--cuda-graphs", default="auto", choices=("auto", "off"),
                   help="EngineConfig.cuda_graphs: decode iterations from CUDA graphs where they apply (CUDA, "
                        "attention backend flex) (default: %(default)s)")
    o.add_argument("--torch-compile", default="auto", choices=("auto", "off"),
                   help="EngineConfig.torch_compile: the forward pass compiled at load where that applies (a CPU, "
                        "attention backend reference, one worker) (default: %(default)s)")
    o.add_argument("--kv-admission", choices=KV_ADMISSION_CHOICES, default="on_demand",
                   help="orca's K/V admission policy; both: reserve, then on_demand, on the same requests, side "
                        "by side (default: %(default)s)")
    o.add_argument("--block-size", type=_positive_int, default=16, help="orca's K/V block size in tokens "
                   "(default: %(default)s)")
    o.add_argument("--max-num-batched-tokens", type=_nonnegative_int, default=0, metavar="N",
                   help="orca's token budget per iteration (chunked prefill); 0: no limit (default: %(default)s)")
    o.add_argument("--n-slots", type=_positive_int, default=None, metavar="N",
                   help="orca's K/V pool in tokens (whole blocks; also bounds transformers' cache) (default: the "
                        "engine's: 1 GiB of K/V on a CPU, what gpu_memory_utilization leaves on a GPU)")
    o.add_argument("--skip-transformers", action="store_true", help="no transformers run")
    o.add_argument("--peers", default="", metavar="NAME[:VARIANT],...",
                   help="CPU peer systems run on the same requests, each in the venv its setup script makes "
                        "(docs/PEERS.md): vllm (scripts/peers/setup_vllm_cpu.sh; VARIANT: its dtype, default "
                        "orca's), llama_cpp (scripts/peers/setup_llama_cpp.sh; VARIANT: the GGUF, f32, bf16, "
                        "q8_0 or shipped, default f32, bf16 for a bfloat16 orca); e.g. "
                        "vllm,llama_cpp,llama_cpp:shipped (default: none)")
    o.add_argument("--peer-timeout", type=_positive_float, default=1800.0, metavar="SECONDS",
                   help="seconds one peer may take, its start included (default: %(default)s)")
    o.add_argument("--peak-seconds", type=float, default=4.0, help="time spent measuring the matmul peak")
    workload(o, "offline")
    o.set_defaults(func=cmd_offline)

    li = sub.add_parser("linears", help="the model's linear layers alone at decode's (and a prompt's) row counts, "
                        "per linear_backend", description=_doc_paragraph("linears"))
    li.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    li.add_argument("--dtype", default="float32", help="weights' dtype, or auto (default: %(default)s)")
    li.add_argument("--rows", default="1,2,4,8,16,32,64,128,512", help="token rows per pass, comma-separated "
                    "(default: %(default)s)")
    li.add_argument("--repeats", type=_positive_int, default=9, help="timed passes per point (default: %(default)s)")
    li.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    li.set_defaults(func=cmd_linears)

    from orca_client.bench import decode as decode_sweep

    dc = sub.add_parser("decode", help="decode tokens/s against batch size (1-256) for orca's attention backends and "
                        "CUDA graphs, transformers' continuous batching and the bandwidth roofline (the GPU benchmark)",
                        description=" ".join(decode_sweep.__doc__.split("\n\n")[1].split()))
    decode_sweep.add_arguments(dc)
    dc.set_defaults(func=decode_sweep.cmd_decode)

    d = sub.add_parser("distributed", help="the control plane's cost per iteration for tp / pp layouts, in "
                       "this process (CPU, gloo)", description=_doc_paragraph("distributed"))
    d.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    d.add_argument("--dtype", default="float32", help="engine dtype (default: %(default)s)")
    d.add_argument("--layouts", default="1x1,2x1,1x2", help="tp x pp layouts, comma-separated (default: %(default)s)")
    d.add_argument("--batch", type=_positive_int, default=8, help="requests decoding together (default: %(default)s)")
    d.add_argument("--context-lens", default="32,512", help="prompt lengths, comma-separated: the tokens held grow, "
                   "the plan must not (default: %(default)s)")
    d.add_argument("--decode-steps", type=_positive_int, default=32, help="tokens per request (default: %(default)s)")
    d.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    d.set_defaults(func=cmd_distributed)

    from orca_client.bench import serve as serve_bench

    serve_bench.add_parser(sub)
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
