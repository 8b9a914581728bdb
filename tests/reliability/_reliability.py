"""Helpers of the reliability suite (tests/reliability/): streaming clients that record everything the
server sends (gRPC over tritonclient.grpc.aio, one stream per request; HTTP generate_stream over aiohttp),
the alone references, the engine's gauges, the stub's resident memory, and the server log.

Every wait is bounded; none decides a result by sleeping.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import requests
import tritonclient.grpc.aio as aiogrpc
from orca_client.client import build_inputs, parse_result
from test_server_e2e import IDLE_GAUGES, metrics, wait_for

QUEUE_FULL = "the waiting queue is full"


# -- what one request got ------------------------------------------------------------------------------
@dataclass
class Outcome:
    """Everything the server sent for one request, in order, as the client saw it."""

    index: int
    transport: str  # grpc | http
    tokens: list[int] = field(default_factory=list)
    responses: int = 0  # data responses (gRPC) or events (HTTP)
    finals: int = 0  # responses flagged FINAL (gRPC)
    errors: list[str] = field(default_factory=list)
    after_terminal: int = 0  # responses after the first FINAL or error: must stay 0
    finish_reason: str | None = None
    closed: bool = False  # the server ended the stream (gRPC: end of the call; HTTP: end of the body)
    cancel_point: str | None = None  # where the client meant to cancel (None: it never does)
    cancelled: bool = False  # the client did cancel, before any terminal answer
    transport_error: str | None = None  # the stream broke (server gone, RPC error)
    sent: float = 0.0
    first_token: float | None = None
    done: float | None = None

    @property
    def terminal(self) -> int:
        """FINALs and errors: exactly one for a request that ran to its answer."""
        return self.finals + len(self.errors)

    @property
    def refused(self) -> bool:
        return len(self.errors) == 1 and QUEUE_FULL in self.errors[0]


@dataclass(frozen=True)
class Spec:
    """One request of a pool: a prompt (token ids or text) and its greedy sampling options."""

    key: int
    input_ids: tuple[int, ...] | None = None
    text: str | None = None
    max_tokens: int = 16
    ignore_eos: bool = True

    def sampling(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": self.ignore_eos}

    def grpc_inputs(self, stream: bool) -> list[Any]:
        prompt = {"input_ids": list(self.input_ids)} if self.input_ids is not None else {"text": self.text}
        return build_inputs(**prompt, stream=stream, return_finish_reason=True, **self.sampling())

    def http_body(self) -> dict[str, Any]:
        prompt = {"input_ids": list(self.input_ids)} if self.input_ids is not None else {"text_input": self.text}
        return {**prompt, **self.sampling(), "stream": True, "exclude_input_in_output": True,
                "return_finish_reason": True}


def _final_flag(response: Any) -> bool:
    params = response.infer_response.parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


async def grpc_request(
    client: aiogrpc.InferenceServerClient,
    model: str,
    spec: Spec,
    index: int,
    *,
    stream: bool = True,
    cancel_after_tokens: int | None = None,
    cancel_after_s: float | None = None,
    cancel_point: str | None = None,
    timeout: float = 600.0,
    linger: float | None = None,
) -> Outcome:
    """Sends one request on a stream of its own and reads until the server ends the stream (or `timeout`).
    With cancel_after_tokens / cancel_after_s the client cancels the call once it holds that many tokens
    or that many seconds after sending, unless a FINAL or an error came first. With `linger`, reading stops
    that many seconds after the FINAL or error even if the stream stays open (`closed` says whether it
    ended)."""
    out = Outcome(index, "grpc", cancel_point=cancel_point, sent=time.monotonic())
    request_id = f"rel-{index}"

    async def requests_() -> Any:
        yield {"model_name": model, "inputs": spec.grpc_inputs(stream), "request_id": request_id}

    it = client.stream_infer(requests_())
    call = it._grpc_call  # the raw responses carry the FINAL flag (and errors keep it)
    deadline = out.sent + timeout
    cancel_at = None if cancel_after_s is None else out.sent + cancel_after_s
    try:
        if cancel_after_tokens == 0 and cancel_at is None:
            cancel_at = out.sent
        while True:
            now = time.monotonic()
            if now > deadline:
                if out.terminal and linger is not None:
                    it.cancel()
                    break
                raise AssertionError(f"request {index}: no end of stream within {timeout:.0f} s: {out}")
            wait = deadline - now
            if cancel_at is not None and out.terminal == 0:
                if now >= cancel_at:
                    it.cancel()
                    out.cancelled = True
                    break
                wait = min(wait, cancel_at - now)
            try:
                response = await asyncio.wait_for(call.__aiter__().__anext__(), wait)
            except asyncio.TimeoutError:
                continue
            except StopAsyncIteration:
                out.closed = True
                break
            if out.terminal:
                out.after_terminal += 1
            if response.error_message:
                out.errors.append(response.error_message)
            else:
                out.responses += 1
                chunk = parse_result(aiogrpc.InferResult(response.infer_response))
                if chunk.output_ids and out.first_token is None:
                    out.first_token = time.monotonic()
                out.tokens += chunk.output_ids
                out.finals += _final_flag(response)
                out.finish_reason = chunk.finish_reason or out.finish_reason
            if out.terminal and out.done is None:
                out.done = time.monotonic()
                if linger is not None:
                    deadline = min(deadline, out.done + linger)
            if (cancel_after_tokens is not None and out.terminal == 0
                    and len(out.tokens) >= cancel_after_tokens):
                it.cancel()
                out.cancelled = True
                break
    except grpc.RpcError as exc:
        out.transport_error = f"{exc.code()}: {exc.details()}" if hasattr(exc, "code") else str(exc)
        if out.done is None:
            out.done = time.monotonic()
    except asyncio.CancelledError:
        it.cancel()
        raise
    return out


async def http_request(
    session: Any,
    url: str,
    model: str,
    spec: Spec,
    index: int,
    *,
    cancel_after_tokens: int | None = None,
    cancel_after_s: float | None = None,
    cancel_point: str | None = None,
    timeout: float = 600.0,
) -> Outcome:
    """POSTs generate_stream and reads its server-sent events; cancelling closes the connection."""
    out = Outcome(index, "http", cancel_point=cancel_point, sent=time.monotonic())

    async def read() -> None:
        async with session.post(f"{url}/v2/models/{model}/generate_stream", json=spec.http_body()) as resp:
            if resp.status != 200:
                out.errors.append(f"HTTP {resp.status}: {await resp.text()}")
                out.done = time.monotonic()
                return
            if cancel_after_tokens == 0:
                out.cancelled = True
                resp.close()
                return
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[len("data: "):])
                if out.terminal:
                    out.after_terminal += 1
                if "error" in event:
                    out.errors.append(event["error"])
                    out.done = time.monotonic()
                    continue
                out.responses += 1
                ids = event.get("output_ids", [])
                ids = ids if isinstance(ids, list) else [ids]
                if ids and out.first_token is None:
                    out.first_token = time.monotonic()
                out.tokens += ids
                if event.get("finish_reason") not in (None, "None"):
                    out.finish_reason = event["finish_reason"]
                    out.finals += 1  # generate_stream's FINAL is the event that carries finish_reason
                    out.done = time.monotonic()
                if cancel_after_tokens is not None and out.terminal == 0 and len(out.tokens) >= cancel_after_tokens:
                    out.cancelled = True
                    resp.close()  # hang up mid-stream
                    return
            out.closed = True

    try:
        limit = timeout if cancel_after_s is None else cancel_after_s
        await asyncio.wait_for(read(), limit)
    except aiohttp.ClientError as exc:  # the connection broke (the server went away)
        out.transport_error = f"{type(exc).__name__}: {exc}"
        if out.done is None:
            out.done = time.monotonic()
    except asyncio.TimeoutError:
        if cancel_after_s is None:
            raise AssertionError(f"request {index}: no end of stream within {timeout:.0f} s: {out}") from None
        if out.terminal == 0:
            out.cancelled = True  # wait_for cancelled the read: the connection is closed
    return out


# -- references --------------------------------------------------------------------------------------
async def alone_references(url: str, model: str, pool: list[Spec], timeout: float = 600.0) -> dict[int, list[int]]:
    """Each spec's greedy tokens with the server running nothing else: one request at a time."""
    client = aiogrpc.InferenceServerClient(url)
    refs = {}
    try:
        for spec in pool:
            out = await grpc_request(client, model, spec, -1 - spec.key, timeout=timeout)
            assert out.finals == 1 and not out.errors and out.closed, out
            refs[spec.key] = out.tokens
    finally:
        await client.close()
    return refs


# -- the engine's gauges, the model's state -------------------------------------------------------------
def gauges(m: dict[str, float]) -> dict[str, float | None]:
    return {g: m.get(g) for g in IDLE_GAUGES}


def finished_by_reason(m: dict[str, float]) -> dict[str, float]:
    prefix = "orca_requests_finished_total{reason="
    return {k[len(prefix) + 1:-2]: v for k, v in m.items() if k.startswith(prefix)}


def wait_idle(server: Any, model: str, timeout: float = 120.0) -> dict[str, float]:
    wait_for(lambda: all(v == 0 for v in gauges(metrics(server, model)).values()), f"{model} idle", timeout)
    return metrics(server, model)


def model_ready(http_url: str, model: str) -> bool:
    return requests.get(f"{http_url}/v2/models/{model}/ready", timeout=30).status_code == 200


# -- processes -----------------------------------------------------------------------------------------
def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, ppid, ...), or None: gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields


def group_processes(pgid: int) -> list[tuple[int, str]]:
    """Live processes of a process group (Triton starts in a session of its own: its stubs join it)."""
    return alive([pid for pid in pids() if _pgid(pid) == pgid])


def descendants(root: int) -> list[tuple[int, str]]:
    """Live processes under `root` in the process tree, whatever their group or session (the engine's
    orca.worker processes run in a session of their own, out of Ctrl-C's reach)."""
    parents = {pid: int(fields[1]) for pid in pids() if (fields := _stat(pid)) is not None}
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found.extend(children)
        frontier = children
    return [(pid, _cmdline(pid)) for pid in found]


def alive(pid_list: list[int]) -> list[tuple[int, str]]:
    """Those of `pid_list` still running (not zombies)."""
    return [(pid, _cmdline(pid)) for pid in pid_list if _stat(pid) is not None]


def processes_matching(text: str) -> list[tuple[int, str]]:
    """Live processes whose command line contains `text` (the server's shm prefix, its repository)."""
    return [(pid, cmd) for pid in pids() if text in (cmd := _cmdline(pid)) and pid != os.getpid()]


def stub_pid(server: Any, model: str) -> int:
    """The triton_python_backend_stub serving `model` on this server (its model.py path names the model)."""
    marker = f"/{model}/1/model.py"
    found = [pid for pid, cmd in group_processes(server.pid)
             if "triton_python_backend_stub" in cmd and marker in cmd]
    assert len(found) == 1, f"stubs of {model}: {found}"
    return found[0]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


class Sampler:
    """A thread sampling, every `period` s, the stub's resident memory and the model's waiting gauge."""

    def __init__(self, pid: int, server: Any, model: str, period: float = 1.0) -> None:
        self.pid, self.server, self.model, self.period = pid, server, model, period
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._t0 = time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period)

    def sample(self) -> None:
        sample: dict[str, float] = {"t": round(time.monotonic() - self._t0, 2), "rss_mib": rss_kib(self.pid) / 1024}
        try:
            m = metrics(self.server, self.model)
            sample.update(waiting=m.get("orca_waiting_requests", -1), running=m.get("orca_running_requests", -1),
                          kv_blocks=m.get("orca_kv_allocated_blocks", -1))
        except requests.RequestException:
            pass
        self.samples.append(sample)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.sample()


class LogWatch:
    """The server log from now on: what orca_gpt logged while a test ran."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.offset = self.path.stat().st_size

    def text(self) -> str:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read().decode(errors="replace")

    def problems(self) -> list[str]:
        """Lines that mean the adapter or the engine hit something unexpected."""
        bad = ("Traceback", "failed", "Segmentation", "core dumped", "Stub process", "is not healthy")
        return [line for line in self.text().splitlines() if any(b in line for b in bad)]


# -- load ------------------------------------------------------------------------------------------------
def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def size(name: str, default: float) -> float:
    """A size of the suite, overridable from the environment (e.g. ORCA_STRESS_SOAK_REQUESTS=200)."""
    value = os.environ.get(name)
    return float(value) if value else default


def report(name: str, data: dict[str, Any], fallback_dir: Path) -> Path:
    """Writes a run's figures as JSON under $ORCA_RELIABILITY_REPORT_DIR (make test-stress: docs/reliability/)
    or, by default, the test's own temporary directory."""
    root = Path(os.environ.get("ORCA_RELIABILITY_REPORT_DIR") or fallback_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}.json"
    path.write_text(json.dumps(data, indent=1, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__")
                                else str(o)) + "\n")
    return path
