"""Stalled streams: many SSE clients that stop reading, against orca-openai in front of the real Triton.

N raw sockets (a tiny receive window and segment size) each send a long streaming /v1/completions and never
read a byte. orca-openai's sends fill their sockets' buffers and then wait; past --stream-write-timeout
(Guard._timed) each response is cut off, its connection dropped and its Triton request cancelled. A few
clients that do read stream the same model meanwhile.

Checked: every stalled request is cancelled in the engine (Triton's orca_requests_finished_total
{reason="cancelled"} grows by N; "length" only by the readers' requests: none ran to max_tokens) and logged
by orca-openai; orca-openai holds none of their connections afterwards; the resident memory of orca-openai,
of tritonserver and of the model's Python stub grows within a bound per stalled stream (or per token the
engine generated for them); every reading stream completes in full; the same stub serves throughout.

Printed (with -s), never asserted as wall-clock windows: the readers' inter-token latency (ITL) alone, beside
N clients that read (the control: the same batch, the same streams' events to serialize), beside the N
stalled clients, and after they are gone, with the engine's mean iteration time and each process's CPU time
per token in each phase; the time until all are cancelled; the tokens the engine generated for each stalled
request and the bytes that reached its socket; the memory growth.

The model: orca_tiny_stall, a copy of orca_tiny added to the session's repository for this test (unloaded
and removed after), whose batch (max_bs) holds every stream at once and whose K/V pool (n_slots) holds them
all at full length: the stallers all stall together, as N clients doing so at once would, and no reader
waits behind them.

CI size: 16 stalled streams (ORCA_CI_STALLED_STREAMS). Full size (``stress``, make test-stress): 200
(ORCA_STRESS_STALLED_STREAMS), on the same tiny model: what is tested is orca-openai's handling of the
streams, not the model's speed.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import shutil
import socket
import statistics
import struct
import termios
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests
from _reliability import model_ready, processes_matching, report, rss_kib, size, stub_pid, wait_idle
from _server import orca_openai, stalled_stream
from test_server_e2e import metrics, wait_for

from orca_openai.app import DEFAULT_MAX_CONCURRENT_REQUESTS

MODEL = "orca_tiny_stall"
API_KEY = "sk-stalled-streams"
CANCELLED = 'orca_requests_finished_total{reason="cancelled"}'
LENGTH = 'orca_requests_finished_total{reason="length"}'
STOP = 'orca_requests_finished_total{reason="stop"}'
GENERATED = "orca_generated_tokens_total"
STALL_LOG = "(--stream-write-timeout); its request is cancelled"
READER_PROMPT = [11, 12, 13, 14]
BLOCK = 16  # the shipped block_size
MIB = 1024  # KiB


@dataclass(frozen=True)
class StallSize:
    stalled: int  # sockets that never read
    timeout: float  # the bound on every wait (eventual completion, not a window)
    readers: int = 4  # clients that read, meanwhile
    reader_tokens: int = 48  # max_tokens of each reader's request (ignore_eos: exactly that many)
    # max_tokens of each of the control's N reading clients: as many as a stalled request generates (~1,100)
    # compares the two at the same contexts; fewer keeps the CI run short
    control_tokens: int = 256
    # max_tokens of each stalled request. Its events (~250 bytes each) fill the client's 4 KiB window, the
    # server's socket buffer (autotuned to ~200 KiB on Linux) and uvicorn's transport buffer (64 KiB) after
    # ~900; the gRPC responses in flight and the write timeout's worth come on top. 2000 + the 4-token
    # prompt: within orca_tiny's 2048 positions.
    stall_tokens: int = 2000
    write_timeout: float = 1.0  # orca-openai's --stream-write-timeout


def ci_size() -> StallSize:
    return StallSize(int(size("ORCA_CI_STALLED_STREAMS", 16)), timeout=600)


def stress_size() -> StallSize:
    return StallSize(int(size("ORCA_STRESS_STALLED_STREAMS", 200)), timeout=3600, control_tokens=1024)


# -- the model ---------------------------------------------------------------------------------------------
def _set_parameter(config: str, key: str, value: str) -> str:
    config, n = re.subn(rf'^parameters {{ key: "{key}" value: {{ string_value: "[^"]*" }} }}$',
                        f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}', config, flags=re.M)
    assert n == 1, f"orca_tiny's config.pbtxt has no parameter {key}"
    return config


class StallModel:
    """orca_tiny copied to MODEL in the session's repository with room for `streams` requests of `tokens`
    at once; loaded on enter, unloaded and removed on exit."""

    def __init__(self, server: Any, streams: int, tokens: int) -> None:
        self.server, self.dir = server, Path(server.model_repository) / MODEL
        self.max_bs = streams
        self.n_slots = streams * (-(-tokens // BLOCK) * BLOCK + BLOCK)  # max_tokens and the prompt, in blocks

    def __enter__(self) -> StallModel:
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.copytree(self.dir.parent / "orca_tiny", self.dir)
        config = (self.dir / "config.pbtxt").read_text()
        config = re.sub(r'^name: "orca_tiny"$', f'name: "{MODEL}"', config, flags=re.M)
        config = _set_parameter(config, "max_bs", str(self.max_bs))
        config = _set_parameter(config, "n_slots", str(self.n_slots))
        (self.dir / "config.pbtxt").write_text(config)
        try:
            r = requests.post(f"{self.server.http_url}/v2/repository/models/{MODEL}/load", timeout=600,
                              headers=self.server.admin_headers)
            assert r.status_code == 200, r.text
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            requests.post(f"{self.server.http_url}/v2/repository/models/{MODEL}/unload", timeout=300,
                          headers=self.server.admin_headers)
            wait_for(lambda: not [pid for pid, cmd in processes_matching(f"/{MODEL}/1/model.py")
                                  if "triton_python_backend_stub" in cmd], f"{MODEL}'s stub gone", timeout=120)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


# -- clients that read -------------------------------------------------------------------------------------
@dataclass
class Read:
    """One streaming request as its client saw it: the arrival time of each event (one a token)."""

    start: float
    times: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    done: bool = False  # data: [DONE] came
    error: str | None = None

    def gaps(self) -> list[tuple[float, float]]:
        """(arrival, time since the previous token) of every token after the first."""
        return [(b, b - a) for a, b in zip(self.times, self.times[1:])]


async def read_stream(session: aiohttp.ClientSession, url: str, max_tokens: int,
                      prompt: list[int] = READER_PROMPT) -> Read:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    out = Read(time.monotonic())
    async with session.post(f"{url}/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {await resp.text()}"
            return out
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                out.done = True
                continue
            event = json.loads(data)
            if event.get("usage"):
                out.completion_tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                out.times.append(time.monotonic())
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
    return out


def _session(s: StallSize) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=s.timeout),
                                 connector=aiohttp.TCPConnector(limit=0))


async def read_rounds(url: str, s: StallSize, rounds: int | None, halt: threading.Event | None = None) -> list[Read]:
    """s.readers clients, each sending its requests one after another: `rounds` each, or until `halt`."""
    async with _session(s) as session:

        async def reader() -> list[Read]:
            reads: list[Read] = []
            while len(reads) < rounds if rounds is not None else not halt.is_set():  # type: ignore[union-attr]
                reads.append(await read_stream(session, url, s.reader_tokens))
            return reads

        return [r for reads in await asyncio.gather(*(reader() for _ in range(s.readers))) for r in reads]


async def read_many(url: str, s: StallSize) -> list[Read]:
    """The control: as many clients as there are stalled ones, all at once, reading everything."""
    async with _session(s) as session:
        return list(await asyncio.gather(*(read_stream(session, url, s.control_tokens, _stall_prompt(i))
                                           for i in range(s.stalled))))


class Readers(threading.Thread):
    """read_rounds until stop(), on an event loop of its own (the test's thread sends and waits)."""

    def __init__(self, url: str, s: StallSize) -> None:
        super().__init__(name="readers", daemon=True)
        self.url, self.s, self.halt = url, s, threading.Event()
        self.reads: list[Read] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.reads = asyncio.run(read_rounds(self.url, self.s, None, self.halt))
        except BaseException as exc:  # raised in the test's thread by stop()
            self.error = exc

    def __enter__(self) -> Readers:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        self.join(self.s.timeout)

    def stop(self) -> list[Read]:
        self.__exit__()
        assert not self.is_alive(), "the readers did not finish"
        if self.error is not None:
            raise self.error
        return self.reads


def check_reads(reads: list[Read], tokens: int) -> list[str]:
    """Each stream complete: every token, finish_reason length, the usage, [DONE]."""
    return [f"{i}: {r}" for i, r in enumerate(reads)
            if r.error or not r.done or r.finish_reason != "length" or len(r.times) != tokens
            or r.completion_tokens != tokens]


def itl(reads: list[Read], start: float = 0.0, end: float = float("inf")) -> dict[str, Any]:
    """The inter-token latency of `reads` between `start` and `end`: over every gap between two tokens
    (median, p90), and over each request's mean gap in the window (its time per output token; a request
    counts with 8 gaps or more there), which a client's bursts of buffered events do not skew."""
    within = [[g for t, g in r.gaps() if start <= t <= end] for r in reads]
    gaps = sorted(g for w in within for g in w)
    means = sorted(sum(w) / len(w) for w in within if len(w) >= 8)
    if not gaps:
        return {"gaps": 0}

    def ms(ordered: list[float], q: float) -> float:
        return round(1000 * ordered[int(q * (len(ordered) - 1))], 2)

    out = {"gaps": len(gaps), "median_ms": round(1000 * statistics.median(gaps), 2), "p90_ms": ms(gaps, 0.9)}
    if means:
        out.update(requests=len(means), per_request_median_ms=round(1000 * statistics.median(means), 2),
                   per_request_p90_ms=ms(means, 0.9))
    return out


def engine(m0: dict[str, float], m1: dict[str, float]) -> dict[str, Any]:
    """The engine's mean iteration time and batch between two snapshots of the model's metrics."""
    n = m1.get("orca_iteration_seconds_count", 0) - m0.get("orca_iteration_seconds_count", 0)
    if not n:
        return {"iterations": 0}
    seconds = m1["orca_iteration_seconds_sum"] - m0.get("orca_iteration_seconds_sum", 0)
    batch = m1["orca_iteration_batch_size_sum"] - m0.get("orca_iteration_batch_size_sum", 0)
    return {"iterations": int(n), "mean_iteration_ms": round(1000 * seconds / n, 2), "mean_batch": round(batch / n, 1)}


# Each look reads Triton's metrics (~250 KB of text): on a 2-core host reading them 20 times a second takes CPU
# time from the streams being measured, so the waits below look every POLL_S.
POLL_S = 0.5


# -- clients that stop reading -----------------------------------------------------------------------------
def _stall_prompt(index: int) -> list[int]:
    return [5 + index % 150, 6, 7, 8]


def stall(url: str, index: int, s: StallSize) -> socket.socket:
    """A socket that sends one long streaming request and never reads (tests/_server.py stalled_stream)."""
    return stalled_stream(url, API_KEY, {"model": MODEL, "prompt": _stall_prompt(index), "max_tokens": s.stall_tokens,
                                         "stream": True, "ignore_eos": True, "temperature": 0})


def unread(sock: socket.socket) -> int:
    """Bytes waiting in the socket's receive queue (what reached the client), without reading them."""
    return struct.unpack("i", fcntl.ioctl(sock, termios.FIONREAD, b"\0\0\0\0"))[0]


# -- processes -----------------------------------------------------------------------------------------------
def openai_pid(url: str) -> int:
    port = url.rsplit(":", 1)[1]
    found = [pid for pid, cmd in processes_matching(f"--port {port} ") if "orca_openai" in cmd]
    assert len(found) == 1, f"orca-openai on port {port}: {found}"
    return found[0]


def connections(pid: int, port: int) -> int:
    """TCP connections to `port` that process `pid` holds open: its sockets in /proc/PID/net/tcp with that
    local port and a remote end."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = str(fd.readlink())
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    count = 0
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        _, local, remote, *rest = line.split()
        if int(local.rsplit(":", 1)[1], 16) == port and remote != "00000000:0000" and rest[6] in inodes:
            count += 1
    return count


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU time (user + system) each process has used, and this test's own process ("client")."""
    out = {}
    for name, pid in pids.items():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    times = os.times()
    out["client"] = times.user + times.system
    return out


def cpu_per_token(c0: dict[str, float], c1: dict[str, float], m0: dict[str, float],
                  m1: dict[str, float]) -> dict[str, float]:
    tokens = max(1.0, m1.get(GENERATED, 0) - m0.get(GENERATED, 0))
    return {k: round(1000 * (c1[k] - c0[k]) / tokens, 3) for k in c0}


class Peaks(threading.Thread):
    """Peak resident memory (KiB) of some processes, sampled every `period` s until stop()."""

    def __init__(self, pids: dict[str, int], period: float = 0.2) -> None:
        super().__init__(name="rss-peaks", daemon=True)
        self.pids, self.period, self.halt = pids, period, threading.Event()
        self.first = {name: rss_kib(pid) for name, pid in pids.items()}
        self.peak = dict(self.first)

    def run(self) -> None:
        while not self.halt.wait(self.period):
            self.sample()

    def sample(self) -> None:
        for name, pid in self.pids.items():
            try:
                self.peak[name] = max(self.peak[name], rss_kib(pid))
            except OSError:  # gone (the test is failing): its last sample stands
                pass

    def __enter__(self) -> Peaks:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        self.join(30)
        self.sample()


# -- the test ------------------------------------------------------------------------------------------------
def run_stalled(server: Any, s: StallSize, tmp_path: Path, name: str) -> None:
    log = tmp_path / "orca-openai.log"
    streams = s.stalled + s.readers
    limit = max(DEFAULT_MAX_CONCURRENT_REQUESTS, streams + 16)
    with StallModel(server, streams, max(s.stall_tokens, s.control_tokens)) as model, \
            orca_openai(server, log, API_KEY, "--stream-write-timeout", f"{s.write_timeout:g}",
                        "--max-concurrent-requests", str(limit)) as url:
        assert model_ready(server.http_url, MODEL)
        port = int(url.rsplit(":", 1)[1])
        pids = {"orca-openai": openai_pid(url), "tritonserver": server.pid, "stub": stub_pid(server, MODEL)}

        # 1. The readers alone (a first round warms orca-openai and the engine up; it is not counted).
        asyncio.run(read_rounds(url, s, 1))
        m0, cpu0 = wait_idle(server, MODEL), cpu_seconds(pids)
        alone = asyncio.run(read_rounds(url, s, 3))
        m1, cpu1 = wait_idle(server, MODEL), cpu_seconds(pids)

        # 2. The control: N clients that read, the readers streaming meanwhile. It also brings each process's
        # memory up to what N streams at once take, so that phase 3's growth is what stalling adds.
        with Readers(url, s) as readers:
            wait_for(lambda: running(server) >= s.readers, "the readers streaming", s.timeout)
            c0 = time.monotonic()
            control = asyncio.run(read_many(url, s))
            c1 = time.monotonic()
            beside_control = readers.stop()

        # 3. The stalled clients, the readers streaming meanwhile.
        before, cpu2 = wait_idle(server, MODEL, timeout=s.timeout), cpu_seconds(pids)
        assert log.read_text().count(STALL_LOG) == 0
        socks: list[socket.socket] = []
        first_cancel: list[float] = []

        def cancelled() -> float:
            n = metrics(server, MODEL).get(CANCELLED, 0) - before.get(CANCELLED, 0)
            if n and not first_cancel:
                first_cancel.append(time.monotonic())
            return n

        with Peaks(pids) as peaks, Readers(url, s) as readers:
            wait_for(lambda: running(server) >= s.readers, "the readers streaming", s.timeout)
            try:
                t0 = time.monotonic()
                socks = [stall(url, i, s) for i in range(s.stalled)]
                sent = time.monotonic()
                wait_for(lambda: cancelled() >= s.stalled, f"all {s.stalled} stalled streams cancelled", s.timeout,
                         period=POLL_S)
                t_all = time.monotonic()
                received = [unread(sock) for sock in socks]  # what reached each stalled client
                wait_for(lambda: log.read_text().count(STALL_LOG) >= s.stalled,
                         "orca-openai logging every stalled stream", s.timeout, period=POLL_S)
                beside_stalled = readers.stop()
                # orca-openai lets go of every stalled connection (the readers' are closed by now)
                held_at_cancel = connections(pids["orca-openai"], port)
                wait_for(lambda: connections(pids["orca-openai"], port) == 0,
                         f"orca-openai letting go of the stalled connections (held {held_at_cancel} once all were "
                         "cancelled)", min(s.timeout, 120))
                t_released = time.monotonic()
            finally:
                for sock in socks:
                    sock.close()
        after_stall, cpu3 = wait_idle(server, MODEL, timeout=s.timeout), cpu_seconds(pids)
        rss_after_stall = {k: rss_kib(pid) for k, pid in pids.items()}

        # 4. The readers alone again, the stalled clients gone.
        after = asyncio.run(read_rounds(url, s, 3))
        end = wait_idle(server, MODEL, timeout=s.timeout)
        assert stub_pid(server, MODEL) == pids["stub"] and model_ready(server.http_url, MODEL)
        text = log.read_text()
        n_slots = model.n_slots

    # -- what happened
    for reads, tokens in ((alone, s.reader_tokens), (beside_control, s.reader_tokens), (control, s.control_tokens),
                          (beside_stalled, s.reader_tokens), (after, s.reader_tokens)):
        assert not check_reads(reads, tokens), "\n".join(check_reads(reads, tokens)[:20])
    stall_delta = {k: after_stall.get(k, 0) - before.get(k, 0) for k in (CANCELLED, LENGTH, STOP, GENERATED)}
    # every stalled request cancelled in the engine; none ran to max_tokens (the readers' requests did)
    assert stall_delta[CANCELLED] == s.stalled, stall_delta
    assert stall_delta[LENGTH] == len(beside_stalled) and stall_delta[STOP] == 0, stall_delta
    assert end.get(CANCELLED, 0) == after_stall.get(CANCELLED, 0)  # phase 4 cancelled nothing
    logged = text.count(f"the client read nothing for {s.write_timeout:g} s {STALL_LOG}")
    assert logged == s.stalled, logged
    assert "Traceback" not in text, text[-3000:]

    # Tokens the engine generated for the stalled requests before they were cancelled: phase 3's growth of
    # the counter less the readers' tokens.
    stall_tokens = stall_delta[GENERATED] - s.reader_tokens * len(beside_stalled)
    # Memory: phase 3's growth of each process's resident set (its peak or what it keeps), beyond phase 2's N
    # reading streams. orca-openai: 64 MiB (allocator arenas) and 512 KiB a stalled stream (its connection, the
    # 64 KiB transport buffer uvicorn fills before its send waits, the gRPC responses it has not read for the
    # write timeout's length). tritonserver: 64 MiB and 1 KiB for each token generated for the stalled
    # requests (the responses its gRPC frontend queues while orca-openai reads none). The stub: 64 MiB and
    # 8 KiB a token (its K/V, 1.5 KiB, and the batch's attention inputs over every context, as any request's;
    # a stalled request's tokens are bounded by its cancellation). What grows with how long clients stall or
    # how many have stalled (connections never let go, responses of cancelled requests) exceeds these.
    growth = {k: max(peaks.peak[k], rss_after_stall[k]) - peaks.first[k] for k in pids}
    bound = {"orca-openai": 64 * MIB + 512 * s.stalled, "tritonserver": 64 * MIB + 1 * stall_tokens,
             "stub": 64 * MIB + 8 * stall_tokens}

    t_first = (first_cancel or [t_all])[0]
    itls = {"alone": itl(alone), "beside_n_reading_clients": itl(beside_control, c0, c1),
            "beside_n_stalled_clients": itl(beside_stalled, sent, t_all),
            # the stall phase's first seconds, as many as the control took: contexts as short as the control's
            "beside_n_stalled_clients_first_seconds": itl(beside_stalled, sent, sent + (c1 - c0)),
            "after": itl(after)}
    engines = {"alone": engine(m0, m1), "beside_n_reading_clients": engine(m1, before),
               "beside_n_stalled_clients": engine(before, after_stall), "after": engine(after_stall, end)}

    def ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
        return round(a[key] / b[key], 2) if a.get(key) and b.get(key) else None

    figures: dict[str, Any] = {
        "stalled_streams": s.stalled, "readers": s.readers, "write_timeout_s": s.write_timeout,
        "stall_max_tokens": s.stall_tokens, "max_bs": streams, "n_slots": n_slots,
        "seconds_to_send_the_stalled_requests": round(sent - t0, 2),
        "seconds_to_first_cancel": round(t_first - sent, 2),
        "seconds_to_all_cancelled": round(t_all - sent, 2),
        "seconds_from_first_to_last_cancel": round(t_all - t_first, 2),
        "connections_held_once_all_cancelled": held_at_cancel,
        "seconds_from_all_cancelled_to_all_connections_released": round(t_released - t_all, 2),
        "engine_finished_in_the_stall_phase": {k: v for k, v in stall_delta.items() if k != GENERATED},
        "tokens_generated_per_stalled_request": round(stall_tokens / s.stalled, 1),
        "bytes_reaching_each_stalled_socket": {"min": min(received), "median": statistics.median(received),
                                               "max": max(received)},
        "itl": itls,
        "engine": engines,
        # CPU seconds each process used per 1,000 tokens the engine generated, by phase
        "cpu_seconds_per_1000_tokens": {"alone": cpu_per_token(cpu0, cpu1, m0, m1),
                                        "beside_n_reading_clients": cpu_per_token(cpu1, cpu2, m1, before),
                                        "beside_n_stalled_clients": cpu_per_token(cpu2, cpu3, before, after_stall)},
        "itl_per_request_median_ratio_vs_alone": {
            k: ratio(v, itls["alone"], "per_request_median_ms") for k, v in itls.items() if k != "alone"},
        "itl_per_request_median_ratio_stalled_vs_reading_clients": ratio(
            itls["beside_n_stalled_clients"], itls["beside_n_reading_clients"], "per_request_median_ms"),
        "itl_gap_median_ratio_stalled_vs_reading_clients": ratio(
            itls["beside_n_stalled_clients"], itls["beside_n_reading_clients"], "median_ms"),
        "rss_mib_at_stall_start": {k: round(v / MIB, 1) for k, v in peaks.first.items()},
        "rss_growth_mib": {k: round(v / MIB, 1) for k, v in growth.items()},
        "rss_bound_mib": {k: round(v / MIB, 1) for k, v in bound.items()},
    }
    path = report(name, figures, tmp_path)
    print(f"\nstalled-streams figures: {path}\n" + "\n".join(f"  {k}: {v}" for k, v in figures.items()))
    assert all(growth[k] <= bound[k] for k in pids), (growth, bound)


def running(server: Any) -> float:
    return metrics(server, MODEL).get("orca_running_requests", 0)


def test_stalled_streams_ci(orca_server: Any, tmp_path: Path) -> None:
    run_stalled(orca_server, ci_size(), tmp_path, "stalled_ci")


@pytest.mark.stress
@pytest.mark.timeout(7200)
def test_stalled_streams_stress(orca_server: Any, tmp_path: Path) -> None:
    run_stalled(orca_server, stress_size(), tmp_path, "stalled_stress")
