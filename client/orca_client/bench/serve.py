"""``orca-bench serve``: the serving path measured from outside, with guidellm, against vLLM's own server.

Each system is started by this command, measured, and stopped before the next one starts, so they never
share the cores:
  orca   ``python -m orca_server.launcher`` (what ``make serve`` runs) on a repository holding only orca_gpt
         as shipped, with its OpenAI-compatible API (orca-openai) beside Triton;
  vllm   vLLM's OpenAI server (``vllm.entrypoints.openai.api_server``) from the vLLM peer's venv
         (scripts/peers/setup_vllm_cpu.sh) on orca's checkpoint directory, in orca's dtype, max_num_seqs =
         orca's max_bs (32), prefix caching off, a 1 GiB K/V cache, its OpenMP threads on the cores orca uses.
``--orca-url`` / ``--vllm-url`` measure a server that already runs instead (``make serve``'s is
http://localhost:9000).

The load is guidellm's (scripts/peers/setup_guidellm.sh), the same for both: synthetic prompts of
--prompt-tokens tokens and --output-tokens new tokens (its synthetic_text data, tokenized with the model's
tokenizer), streaming /v1/completions, once per --profiles entry (``synchronous``: one request at a time;
``concurrent:N``: N streams, each sending its next request when the last ends), --requests requests each.
Recorded per system and profile: output tokens/s, requests/s, TTFT and ITL (median, p90), end-to-end
latency (median), and the CPU each process of the system used during the run (share of one core, from
/proc; the stub's, tritonserver's and orca-openai's for orca).

For orca, two more views of where a token's time goes:
  - the model's share: Triton's ``orca_iteration_seconds`` histogram (an iteration's time in the worker),
    read before and after each run: its mean beside the ITL the client saw;
  - the hops, at batch 1: inter-token latency of one request (--hop-prompt-tokens / --hop-output-tokens,
    greedy, EOS ignored) through Triton's HTTP generate_stream, through its gRPC stream (tritonclient),
    and through orca-openai's server-sent events, with the iteration time over the same requests.
guidellm cannot drive Triton's generate endpoints (its backends speak OpenAI's API or run vLLM in process),
so those are measured by the hops alone.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]  # the repository root (client/orca_client/bench/serve.py)
SYSTEMS = ("orca", "vllm")


@dataclass(frozen=True)
class Profile:
    kind: str  # synchronous | concurrent
    streams: int = 1

    @property
    def label(self) -> str:
        return self.kind if self.kind == "synchronous" else f"concurrent:{self.streams}"

    @property
    def guidellm(self) -> str:
        return "kind=synchronous" if self.kind == "synchronous" else f"kind=concurrent,streams={self.streams}"


def parse_profiles(text: str) -> list[Profile]:
    """"synchronous,concurrent:16" -> Profiles."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        kind, _, n = item.partition(":")
        if kind == "synchronous" and not n:
            out.append(Profile("synchronous"))
        elif kind == "concurrent" and n.isdigit() and int(n) >= 1:
            out.append(Profile("concurrent", int(n)))
        else:
            raise ValueError(f"unknown profile {item!r}: synchronous or concurrent:N (N >= 1)")
    if not out:
        raise ValueError("give at least one profile")
    return out


# -- CPU use per process, from /proc ------------------------------------------------------------------
def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _process_name(pid: int) -> str:
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return str(pid)
    text = " ".join(args)
    for key, name in (("orca_gpt/1/model.py", "orca_gpt stub"), ("tritonserver", "tritonserver"),
                      ("orca_openai", "orca-openai"), ("api_server", "vllm api server")):
        if key in text:
            return name
    comm = Path(f"/proc/{pid}/comm").read_text().strip() if Path(f"/proc/{pid}/comm").exists() else ""
    return comm or Path(args[0]).name


def cpu_seconds(root: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of `root` and every process below it, by pid."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in _descendants(root):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (_process_name(pid), (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_share(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], seconds: float) -> dict:
    """Share of one core per process name over `seconds` (processes of one name added up)."""
    shares: dict[str, float] = {}
    for pid, (name, used) in after.items():
        spent = used - before.get(pid, (name, 0.0))[1]
        shares[name] = shares.get(name, 0.0) + spent / seconds
    return {name: round(share, 3) for name, share in sorted(shares.items(), key=lambda kv: -kv[1]) if share >= 0.005}


# -- guidellm -----------------------------------------------------------------------------------------
def run_guidellm(python: Path, target: str, model: str, tokenizer: Path, profile: Profile, requests: int,
                 prompt_tokens: int, output_tokens: int, out_json: Path, timeout: float) -> dict[str, Any]:
    """One guidellm benchmark; returns its summary (the figures this command records)."""
    guidellm = python.parent / "guidellm"
    cmd = [
        str(guidellm), "run",
        "--backend", f"kind=openai_http,target={target},model={model},request_format=/v1/completions",
        "--profile", profile.guidellm,
        "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--constraint", f"kind=max_requests,count={requests}",
        "--output", f"kind=json,path={out_json}",
        "--disable-progress", "--disable-console",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not out_json.exists():
        raise RuntimeError(f"guidellm failed ({done.returncode}): {(done.stderr or done.stdout)[-2000:]}")
    return summarize_guidellm(json.loads(out_json.read_text()))


def summarize_guidellm(report: dict[str, Any]) -> dict[str, Any]:
    """The figures of a guidellm JSON report's (first) benchmark."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]

    def stat(key: str, which: str) -> float | None:
        values = m[key]["successful"]
        value = values["percentiles"].get(which) if which.startswith("p") else values.get(which)
        return None if value is None else round(float(value), 2)

    totals = m["request_totals"]
    return {
        "requests": totals.get("successful"), "errored": totals.get("errored"),
        "duration_s": round(float(bench["duration"]), 2),
        "output_tokens_per_second": stat("output_tokens_per_second", "mean"),
        "requests_per_second": stat("requests_per_second", "mean"),
        "ttft_ms": {"median": stat("time_to_first_token_ms", "median"), "p90": stat("time_to_first_token_ms", "p90")},
        "itl_ms": {"median": stat("inter_token_latency_ms", "median"), "p90": stat("inter_token_latency_ms", "p90")},
        "request_latency_s": {"median": stat("request_latency", "median")},
    }


# -- the systems --------------------------------------------------------------------------------------
def _wait_http(url: str, proc: subprocess.Popen, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} while starting; its log: {log}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{what} was not ready within {timeout:g} s; its log: {log}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@dataclass
class Running:
    openai_url: str  # http://host:port, the OpenAI API's root
    model: str
    pid: int | None  # the root of the system's processes (None: not started here)
    http_url: str | None = None  # Triton's, for orca
    grpc_url: str | None = None
    metrics_url: str | None = None
    api_key: str | None = None  # the OpenAI API's, when it wants one


@contextmanager
def orca_server(workdir: Path, startup_timeout: float, params: dict[str, str] | None = None) -> Iterator[Running]:
    """The launcher (make serve's command) on a repository holding only orca_gpt, as shipped, or with the
    config.pbtxt parameters `params` set (scripts/variant_repository.py's make_variant)."""
    from orca_server.server import free_ports

    repo = workdir / "repository"
    shutil.rmtree(repo, ignore_errors=True)  # a second server in the same workdir gets a fresh repository
    if params:
        variant_repository().make_variant(repo, "orca_gpt", params)
    else:
        shutil.copytree(REPO / "model_repository" / "orca_gpt", repo / "orca_gpt")
    http, grpc, metrics, openai = free_ports(4)
    log = workdir / "orca-serve.log"
    cmd = [sys.executable, "-m", "orca_server.launcher", "--model-repository", str(repo), "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(openai),
           "--enable-prompt-tokens-details"]  # the benchmarks read each request's cached_tokens
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{openai}/health", proc, startup_timeout, "orca (make serve's launcher)", log)
        yield Running(f"http://127.0.0.1:{openai}", "orca_gpt", proc.pid, f"http://127.0.0.1:{http}",
                      f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics")
    finally:
        _stop(proc)


def variant_repository() -> Any:
    """scripts/variant_repository.py as a module (a script of the repository, not of a package)."""
    import importlib.util

    path = REPO / "scripts" / "variant_repository.py"
    spec = importlib.util.spec_from_file_location("orca_variant_repository", path)
    if spec is None or spec.loader is None:
        raise OSError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def vllm_server(workdir: Path, checkpoint: Path, dtype: str, max_num_seqs: int, threads: int,
                startup_timeout: float, prefix_caching: bool = False, max_model_len: int = 2048,
                block_size: int | None = None) -> Iterator[Running]:
    """vLLM's OpenAI server from the vLLM peer's venv, on orca's checkpoint (prefix caching off unless
    `prefix_caching`; its K/V block size vLLM's default, 128 on a CPU, unless `block_size`)."""
    from orca_client.peers import peer_python
    from orca_server.server import free_ports

    (port,) = free_ports(1)
    log = workdir / "vllm-serve.log"
    cmd = [str(peer_python("vllm")), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
           "--served-model-name", "orca-checkpoint", "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
           "--kv-cache-memory-bytes", str(1 << 30), "--max-model-len", str(max_model_len),
           "--host", "127.0.0.1", "--port", str(port)]
    if block_size is not None:
        cmd += ["--block-size", str(block_size)]
    if prefix_caching:  # each answer's usage says how many prompt tokens came from the cache
        cmd.append("--enable-prompt-tokens-details")
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/models", proc, startup_timeout, "vLLM's OpenAI server", log)
        yield Running(f"http://127.0.0.1:{port}", "orca-checkpoint", proc.pid)
    finally:
        _stop(proc)


# -- orca's own views: the model's share and the hops -------------------------------------------------
def iteration_seconds(metrics_url: str, model: str) -> tuple[float, float]:
    """(sum, count) of the model's orca_iteration_seconds, from Triton's metrics."""
    from orca_client.bench.trace_cmd import fetch_metrics

    samples = fetch_metrics(metrics_url, model, timeout=10,
                            names=("orca_iteration_seconds_sum", "orca_iteration_seconds_count"))
    if samples is None:
        raise ConnectionError(f"Triton's metrics at {metrics_url} cannot be read")
    return samples.get("orca_iteration_seconds_sum", 0.0), samples.get("orca_iteration_seconds_count", 0.0)


def mean_iteration_ms(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    count = after[1] - before[1]
    return round((after[0] - before[0]) / count * 1e3, 2) if count > 0 else None


def _itl_ms(stamps: list[float]) -> list[float]:
    """Gaps between token arrivals after the first (the first token's wait is the prompt's)."""
    return [(b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:])]


def http_stream_stamps(server: Running, prompt: list[int], n: int) -> list[float]:
    import requests

    body = {"input_ids": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    stamps = []
    with requests.post(f"{server.http_url}/v2/models/{server.model}/generate_stream", json=body, stream=True,
                       timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines(chunk_size=1):
            if line.startswith(b"data:"):
                stamps.append(time.perf_counter())
    return stamps


def grpc_stream_stamps(server: Running, prompt: list[int], n: int) -> list[float]:
    import tritonclient.grpc as grpcclient

    from orca_client.client import build_inputs

    arrivals: queue.Queue[tuple[float, Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    stamps = []
    try:
        client.start_stream(callback=lambda result, error: arrivals.put((time.perf_counter(), result, error)))
        inputs = build_inputs(input_ids=prompt, stream=True, max_tokens=n, temperature=0, ignore_eos=True)
        client.async_stream_infer(server.model, inputs)
        while len(stamps) < n:
            stamp, result, error = arrivals.get(timeout=600)
            if error is not None:
                raise RuntimeError(str(error))
            stamps.append(stamp)
    finally:
        client.stop_stream()
        client.close()
    return stamps


def openai_stream_stamps(server: Running, prompt: list[int], n: int) -> list[float]:
    import requests

    body = {"model": server.model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True}
    stamps = []
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    with requests.post(f"{server.openai_url}/v1/completions", json=body, headers=headers, stream=True,
                       timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines(chunk_size=1):
            if line.startswith(b"data:") and b"[DONE]" not in line:
                stamps.append(time.perf_counter())
    return stamps


HOPS: dict[str, Callable[[Running, list[int], int], list[float]]] = {
    "http_generate_stream": http_stream_stamps, "grpc_stream": grpc_stream_stamps, "openai_sse": openai_stream_stamps,
}


def measure_hops(server: Running, prompt_tokens: int, output_tokens: int, repeats: int) -> dict[str, Any]:
    """Per endpoint: median inter-token latency of one request at a time, and the mean iteration time of
    the same requests (the model's share); the endpoints in turn, `repeats` rounds."""
    prompt = [(7 * i + 11) % 97 + 3 for i in range(prompt_tokens)]  # ids any vocabulary holds
    gaps: dict[str, list[float]] = {name: [] for name in HOPS}
    model_ms: dict[str, list[float]] = {name: [] for name in HOPS}
    openai_stream_stamps(server, prompt, 4)  # warm-up
    for _ in range(repeats):
        for name, stamps_of in HOPS.items():
            before = iteration_seconds(server.metrics_url, server.model)
            gaps[name].extend(_itl_ms(stamps_of(server, prompt, output_tokens)))
            after = iteration_seconds(server.metrics_url, server.model)
            mean = mean_iteration_ms(before, after)
            if mean is not None:
                model_ms[name].append(mean)
    return {
        name: {"itl_ms_median": round(statistics.median(gaps[name]), 2),
               "itl_ms_p90": round(statistics.quantiles(gaps[name], n=10)[-1], 2),
               "iteration_ms_mean": round(statistics.mean(model_ms[name]), 2) if model_ms[name] else None}
        for name in HOPS
    }


# -- the command --------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    import torch

    from orca.checkpoint import resolve_checkpoint
    from orca.config import auto_dtype
    from orca_client.bench.common import machine_info
    from orca_client.peers import PeerUnavailable, peer_python

    profiles = parse_profiles(args.profiles)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for name in systems:
        if name not in SYSTEMS:
            raise SystemExit(f"unknown system {name!r} (systems: {', '.join(SYSTEMS)})")
    try:  # before anything starts: the venvs this run needs
        python = peer_python("guidellm")
        if "vllm" in systems and not args.vllm_url:
            peer_python("vllm")
    except PeerUnavailable as exc:
        raise SystemExit(str(exc)) from None
    checkpoint = resolve_checkpoint(None)
    dtype = str(auto_dtype(torch.device("cpu"))).removeprefix("torch.")
    threads = torch.get_num_threads()
    result: dict[str, Any] = {
        "command": " ".join(["orca-bench", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": machine_info(), "checkpoint": str(checkpoint), "dtype": dtype, "threads": threads,
        "workload": {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
                     "requests": args.requests, "profiles": [p.label for p in profiles]},
        "systems": {},
    }
    with tempfile.TemporaryDirectory(prefix="orca-serve-bench-") as tmp:
        work = Path(tmp)
        for name in systems:
            print(f"== {name}", flush=True)
            record: dict[str, Any] = {"profiles": {}}
            with _system(name, args, work, checkpoint, dtype, threads) as server:
                if name == "orca" and args.hop_repeats > 0 and server.http_url:
                    record["hops"] = measure_hops(server, args.hop_prompt_tokens, args.hop_output_tokens,
                                                  args.hop_repeats)
                    print(f"   hops at batch 1: {json.dumps(record['hops'])}", flush=True)
                for profile in profiles:
                    before_cpu = cpu_seconds(server.pid) if server.pid else {}
                    before_it = iteration_seconds(server.metrics_url, server.model) if server.metrics_url else None
                    start = time.monotonic()
                    summary = run_guidellm(python, server.openai_url, server.model, checkpoint, profile,
                                           args.requests, args.prompt_tokens, args.output_tokens,
                                           work / f"{name}-{profile.label.replace(':', '-')}.json", args.timeout)
                    seconds = time.monotonic() - start
                    if server.pid:
                        summary["cpu_cores_by_process"] = cpu_share(before_cpu, cpu_seconds(server.pid), seconds)
                    if before_it is not None:
                        after_it = iteration_seconds(server.metrics_url, server.model)
                        summary["iteration_ms_mean"] = mean_iteration_ms(before_it, after_it)
                    record["profiles"][profile.label] = summary
                    print(f"   {profile.label}: {json.dumps(summary)}", flush=True)
            result["systems"][name] = record
    print_serve(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


@contextmanager
def _system(name: str, args: argparse.Namespace, work: Path, checkpoint: Path, dtype: str,
            threads: int) -> Iterator[Running]:
    if name == "orca":
        if args.orca_url:
            yield Running(args.orca_url.rstrip("/"), "orca_gpt", None, args.triton_http_url,
                          args.triton_grpc_url, args.triton_metrics_url)
        else:
            with orca_server(work, args.startup_timeout) as server:
                yield server
    elif args.vllm_url:
        yield Running(args.vllm_url.rstrip("/"), args.vllm_model, None)
    else:
        with vllm_server(work, checkpoint, dtype, args.max_num_seqs, threads, args.startup_timeout) as server:
            yield server


def print_serve(result: dict[str, Any]) -> None:
    print(f"\nguidellm, prompts {result['workload']['prompt_tokens']} tokens, {result['workload']['output_tokens']} "
          f"new tokens, {result['dtype']}, {result['machine']['cores']} cores {result['machine']['cpu_flags']}")
    print(f"{'system':8s} {'profile':14s} {'out tok/s':>10s} {'TTFT med':>9s} {'p90':>8s} {'ITL med':>8s} {'p90':>7s} "
          f"{'iter ms':>8s}")
    for name, record in result["systems"].items():
        for label, s in record["profiles"].items():
            it = s.get("iteration_ms_mean")
            print(f"{name:8s} {label:14s} {s['output_tokens_per_second'] or 0:10.1f} "
                  f"{s['ttft_ms']['median'] or 0:9.1f} "
                  f"{s['ttft_ms']['p90'] or 0:8.1f} {s['itl_ms']['median'] or 0:8.1f} {s['itl_ms']['p90'] or 0:7.1f} "
                  f"{'' if it is None else f'{it:.1f}':>8s}")
    systems = result["systems"]
    if "orca" in systems and "vllm" in systems:
        for label in systems["orca"]["profiles"]:
            o, v = systems["orca"]["profiles"][label], systems["vllm"]["profiles"].get(label)
            if v and o["output_tokens_per_second"] and v["output_tokens_per_second"]:
                ratio = o["output_tokens_per_second"] / v["output_tokens_per_second"]
                print(f"orca/vLLM {label}: output tok/s {ratio:.2f}x")


def add_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="guidellm against orca's OpenAI API and vLLM's OpenAI server, one after the "
                       "other, plus orca's per-hop latency at batch 1", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--systems", default="orca,vllm", help="orca, vllm or both, in this order (default: %(default)s)")
    s.add_argument("--profiles", default="synchronous,concurrent:16",
                   help="guidellm profiles: synchronous, concurrent:N (default: %(default)s)")
    s.add_argument("--requests", type=int, default=32, help="requests per profile (default: %(default)s)")
    s.add_argument("--prompt-tokens", type=int, default=128, help="synthetic prompt length (default: %(default)s)")
    s.add_argument("--output-tokens", type=int, default=64, help="new tokens per request (default: %(default)s)")
    s.add_argument("--hop-repeats", type=int, default=3,
                   help="rounds of the batch-1 hop measurement for orca, 0 = none (default: %(default)s)")
    s.add_argument("--hop-prompt-tokens", type=int, default=128, help="(default: %(default)s)")
    s.add_argument("--hop-output-tokens", type=int, default=64, help="(default: %(default)s)")
    s.add_argument("--max-num-seqs", type=int, default=32,
                   help="vLLM's max_num_seqs: orca's max_bs (default: %(default)s)")
    s.add_argument("--orca-url", help="measure the orca-openai at this URL instead of starting one "
                   "(make serve's: http://localhost:9000)")
    s.add_argument("--triton-http-url", default="http://localhost:8000", help="with --orca-url: Triton's HTTP "
                   "(default: %(default)s)")
    s.add_argument("--triton-grpc-url", default="localhost:8001", help="with --orca-url (default: %(default)s)")
    s.add_argument("--triton-metrics-url", default="http://localhost:8002/metrics",
                   help="with --orca-url (default: %(default)s)")
    s.add_argument("--vllm-url", help="measure vLLM's server at this URL instead of starting one")
    s.add_argument("--vllm-model", default="orca-checkpoint", help="with --vllm-url: its served model name")
    s.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server may take to start")
    s.add_argument("--timeout", type=float, default=1800.0, help="seconds one guidellm run may take")
    s.add_argument("--json", help="write the results here")
    s.set_defaults(func=cmd_serve)
