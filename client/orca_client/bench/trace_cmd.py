"""``orca-bench trace``: the paper's workload (orca_client.trace) against models of a running Triton server,
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
--timeline DIR each model also records its iteration timeline (orca/core/timeline.py) in DIR/MODEL.jsonl:
orca-bench reloads the model with its config's trace parameter set to that file (Triton's explicit model
control: load_model with a config override), drives it, reloads it with the trace parameter it had, and
then draws the trace (as orca-bench timeline does) when DIR is readable here. DIR is a path on the
server's host: the same directory when the server runs on this machine (make serve).

This module is the subcommand (the workload itself is orca_client.trace): the drivers (a gRPC stream per
request for decoupled models, one async infer for batching ones), the open and closed loops, the K/V
gauges read from Triton's metrics endpoint (parse_metrics, fetch_metrics, KVSampler), the throughput
within the SLO, the table and the figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
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

from orca_client.admin import ADMIN_KEY_ENV, admin_key, grpc_headers
from orca_client.bench.common import machine_info, write_json
from orca_client.bench.options import (
    add_workload_options,
    doc_description,
    positive_float,
    positive_int,
    trace_spec,
)
from orca_client.bench.timeline_cmd import draw_timeline
from orca_client.client import OrcaClient, parse_result
from orca_client.trace import TraceRequest, make_trace

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
    dimension in front; the single response carries every token, so TTFT equals the end-to-end latency.
    Each request carries its send time (the ``client_send_time`` parameter), from which the model dates its
    arrival: the wait in Triton's queue before its batch starts shows in the model's timeline."""

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
            # The send time lets the model count the wait in Triton's queue (its timeline's "waiting").
            self._client.async_infer(self.model, batch_member_inputs(req), on_result,
                                     parameters={"client_send_time": time.time()})
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
        "return_finish_reason": ("BOOL", np.asarray([[True]])),  # RequestRecord.finish_reason
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
_KV_NAMES = tuple(KV_GAUGES.values())
_SAMPLE_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str, model: str, names: Sequence[str] | None = None) -> dict[str, float]:
    """The samples of one model (label model="<model>") in Prometheus' text format, by metric name; the
    series of several versions of the model are added up. `names`: only these metrics. A server's text
    runs to hundreds of kilobytes (every model's histograms), parsed while the benchmark's streams compete
    for the interpreter: lines are screened by plain substring tests before any regular expression."""
    tag = f'model="{model}"'
    prefixes = None if names is None else tuple(p for n in names for p in (n + "{", n + " "))
    out: dict[str, float] = {}
    for line in text.splitlines():
        if tag not in line or (prefixes is not None and not line.startswith(prefixes)) or line.startswith("#"):
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


def fetch_metrics(url: str, model: str, timeout: float = 5.0,
                  names: Sequence[str] | None = None) -> dict[str, float] | None:
    """One scrape of the metrics endpoint (parse_metrics: the model's samples, of `names` only if given);
    None when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode("utf-8", errors="replace")
    except (OSError, ValueError):  # URLError and timeouts are OSErrors; ValueError: a malformed URL
        return None
    return parse_metrics(text, model, names)


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
        first = self._scrape()
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

    def _scrape(self) -> dict[str, float] | None:
        return fetch_metrics(self.url or "", self.model, names=_KV_NAMES)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            sample = self._scrape()
            if sample is not None:
                self.samples.append(sample)

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            last = self._scrape()
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
    spec = trace_spec(args, preset)
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
                    reload_model(args.url, model, str(timelines[model]), args.admin_key)
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
                    reload_model(args.url, model, own_trace[model], args.admin_key)
                    traced.remove(model)
    finally:
        for model in traced:  # a run that failed half-way: the model must not keep tracing
            with contextlib.suppress(Exception):
                reload_model(args.url, model, own_trace[model], args.admin_key)
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


def reload_model(url: str, model: str, trace: str, key: str | None = None) -> None:
    """Reloads a served model with its trace parameter set to `trace` ("" = off): Triton's load_model with
    a config override, the model's current config with that one parameter changed (a plain load_model
    would keep the loaded config: Triton reloads only what changed). Needs Triton's explicit model
    control, as make serve starts it, and the admin key `key` (README "Security")."""
    client = grpcclient.InferenceServerClient(url)
    try:
        config = client.get_model_config(model, as_json=True)["config"]
        parameters = config.setdefault("parameters", {})
        if "trace" not in parameters:
            raise ValueError(f"{model} has no trace parameter in its config.pbtxt: it cannot record a timeline")
        parameters["trace"] = {"string_value": trace}
        client.load_model(model, config=json.dumps(config), headers=grpc_headers(key))
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
    """Figure 10 of the paper (median normalized latency, a curve per model) beside each model's throughput
    within the SLO. The curves are drawn against the rate offered, each point annotated with the
    throughput achieved: past saturation the achieved throughput stalls or falls back, and drawn against
    it a curve would double back on itself."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (curve, bars) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    for i, model in enumerate(result["models"]):
        pts = sorted((r["rate"], r["summary"]["normalized"]["p50"], r["summary"]["throughput_rps"])
                     for r in result["runs"] if r["model"] == model)
        pts = [(x, y * 1000, tput) for x, y, tput in pts if y is not None]
        if pts:
            xs, ys, tputs = zip(*pts)
            curve.plot(xs, ys, marker="o", label=model, color=f"C{i}")
            for x, y, tput in pts:
                if tput is not None:
                    curve.annotate(f"{tput:.2f}", (x, y), textcoords="offset points", xytext=(4, -10),
                                   fontsize=7, color=f"C{i}")
    slo = result["slo"]["slo"]
    if slo is not None:
        curve.axhline(slo * 1000, color="grey", linestyle="--", label=f"SLO ({result['slo']['multiple']:g}x unloaded)")
    curve.set_xlabel("request rate offered (req/s); beside each point: the throughput achieved (req/s)")
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
    never = result.get("slo_never_crossed", {})
    for i, v in enumerate(values):  # ">=": within the SLO at every rate of the sweep (a lower bound)
        bars.annotate(f"{'>= ' if never.get(names[i]) else ''}{v:.2f}", (i, v), ha="center", va="bottom")
    bars.set_ylabel("throughput within SLO (req/s achieved)")
    bars.set_title(f"throughput within SLO ({slo * 1000:.0f} ms/token)" if slo is not None else "throughput within SLO")
    bars.tick_params(axis="x", labelrotation=15)
    fig.suptitle(f"orca-bench trace ({result['machine']['cpu']}, {result['machine']['cores']} cores)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def add_parser(sub: Any) -> None:
    t = sub.add_parser("trace", help="the Orca workload against a running Triton server, at a sweep of rates",
                       description=doc_description(__doc__))
    t.add_argument("--url", default="localhost:8001", help="Triton gRPC address (default: %(default)s)")
    t.add_argument("--admin-key", default=admin_key(), help="the admin key --timeline's reloads need (default: "
                   f"${ADMIN_KEY_ENV})")
    t.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated (default: %(default)s)")
    t.add_argument("--rates", help="arrival rates in req/s, comma-separated (default: "
                   + "; with --paper: ".join(",".join(f"{r:g}" for r in DEFAULT_RATES[p]) for p in ("default", "paper"))
                   + ")")
    t.add_argument("--paper", action="store_true", help="the paper's lengths: prompts U(32,512), new tokens U(1,128)")
    add_workload_options(t, "default")
    t.add_argument("--unloaded-requests", type=int, default=8,
                   help="requests sent one at a time first, per model, for the unloaded latency (default: %(default)s;"
                        " 0 uses the lowest rate instead)")
    t.add_argument("--slo-multiple", type=float, default=4.0,
                   help="SLO = this x the unloaded median normalized latency (default: %(default)s)")
    t.add_argument("--metrics-url", default=DEFAULT_METRICS_URL,
                   help="Triton's Prometheus metrics endpoint, sampled during each rate point for the K/V pool's "
                        "use (orca_kv_* gauges; \"\" turns it off) (default: %(default)s)")
    t.add_argument("--metrics-interval", type=positive_float, default=0.25, metavar="SECONDS",
                   help="seconds between two samples of the metrics endpoint (default: %(default)s)")
    t.add_argument("--block-size", type=positive_int, default=16,
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
