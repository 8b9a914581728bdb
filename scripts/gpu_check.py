"""The whole GPU verification in one run: ``scripts/gpu_check.sh [OUT_DIR]`` (``make gpu-check``).

Made for a bare GPU machine with torch, transformers and triton but no package registry and no install of
this repository: everything runs from the tree (PYTHONPATH), with that machine's python. The stages, in
order, each in its own process under its own time limit, inside one overall budget (--budget seconds):

1. env: nvidia-smi; torch, CUDA, cuDNN, triton and transformers versions; the device's properties; a
   large device-to-device copy's bandwidth and a bf16 matrix product's rate (the two ceilings); which of
   PyTorch's SDPA kernels (flash, efficient, cuDNN, math) run in bf16 here.
2. tests: ``pytest -m gpu tests/test_gpu.py`` (the engine on CUDA against transformers), with a JUnit XML.
3. checkpoint: the random-weight ~1B Llama of ``orca-bench decode`` (--shape llama-1b), built once.
4. decode: ``orca-bench decode`` on it, one process per system (orca's attention backends with and
   without CUDA graphs, transformers' continuous batching), bf16, batch 1-256, against the bandwidth
   roofline; merged into decode.json (a system cut off by its time limit keeps the batch sizes it ran).
5. offline: ``orca-bench offline`` on the same model with the fastest orca system of the decode sweep at
   batch 64, against transformers; its iteration breakdown is the host's share of an iteration (input
   preparation and scheduling) beside the device's.
6. quantized: ``orca-bench decode`` with flex and CUDA graphs on the same model, unquantized and with its
   weights quantized at load (int8, int4, fp8; one process each), and the float weights over a quantized
   K/V pool (kv-fp8_e4m3, kv-int8: the paged decode kernel reading values and scales; batched beside it),
   at batch 1, 16 and 64, against the roofline of the quantized bytes (quantized-<kind>.json).
7. speculative: ``orca-bench speculative`` on the same model, random-token prompts, off against n-gram
   lookup and a draft model made of the model's first two layers (--draft-layers 2), with batched
   attention and with flex and CUDA graphs (speculative-<backend>.json).
8. lora: ``orca-bench lora`` on the same model, 1, 4 and 16 random rank-8 adapters against the base
   model, with batched attention and with flex and CUDA graphs (lora-<backend>.json).
9. prefix: ``orca-bench prefix --mode offline`` on the same model (its token ids: it has no tokenizer),
   prefix caching on and off on the shared-prefix and multi-turn workloads, with batched attention and
   with flex and CUDA graphs (prefix-<backend>.json).
10. host: scripts/experiments/decode_host_profile.py on the same model, flex with CUDA graphs over the
    default pool at batch 1, 64 and 256 (host.json): each decode iteration's step, the device's busy
    time, the engine's phases and the host's costliest functions (the host and the device run in series).

Where torch sees no GPU the same stages run on the CPU as a smoke check of the script (a tiny model, small
batches; the tests skip): its figures mean nothing, and the summary says the GPU parts were skipped.
Written under OUT_DIR (default $OUT, else ./gpu_check_out): gpu_check.log (everything printed),
gpu_check.json (the summary: each stage's status, seconds and results), tests.xml, decode.json,
offline.json, and the feature stages' JSON. The last lines printed are a short table. --stages picks and
orders the stages (default: all; the tests first, then the feature stages, then decode and offline).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DECODE_SYSTEMS_CUDA = ("orca-flex-graphs", "orca-flex", "orca-batched", "transformers", "orca-reference")
DECODE_SYSTEMS_CPU = ("orca-batched", "transformers")
STAGES = ("env", "tests", "quantized", "speculative", "lora", "prefix", "host", "decode", "offline")
ORCA_OPTIONS = {  # orca-bench decode's systems as orca-bench offline options
    "orca-reference": ["--attention-backend", "reference", "--cuda-graphs", "off"],
    "orca-batched": ["--attention-backend", "batched", "--cuda-graphs", "off"],
    "orca-flex": ["--attention-backend", "flex", "--cuda-graphs", "off"],
    "orca-flex-graphs": ["--attention-backend", "flex", "--cuda-graphs", "auto"],
}


class Check:
    def __init__(self, out: Path, budget: float, python: str) -> None:
        self.out, self.python = out, python
        self.start = time.monotonic()
        self.deadline = self.start + budget
        self.log = (out / "gpu_check.log").open("a", buffering=1)
        self.summary: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "budget_seconds": budget,
                                        "python": python, "stages": {}}
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "client"), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.env = env

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        self.summary["elapsed_seconds"] = round(time.monotonic() - self.start, 1)
        (self.out / "gpu_check.json").write_text(json.dumps(self.summary, indent=1, default=str) + "\n")

    def run(self, name: str, argv: list[str], limit: float) -> dict[str, Any]:
        """`argv` in a subprocess (its output into the log, as it comes), stopped after `limit` seconds."""
        limit = max(1.0, min(limit, self.left()))
        self.say(f"\n=== {name} (limit {limit:.0f} s): {' '.join(argv)}")
        started = time.monotonic()
        proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
        tail: list[str] = []
        timed_out = False

        def kill() -> None:
            nonlocal timed_out
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(limit, kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.log.write(line)
                sys.stdout.write(line)
                tail = (tail + [line.rstrip()])[-25:]
            rc = proc.wait()
        finally:
            timer.cancel()
        seconds = time.monotonic() - started
        status = "timeout" if timed_out else ("ok" if rc == 0 else "failed")
        self.say(f"=== {name}: {status} (rc {rc}, {seconds:.0f} s)")
        return {"status": status, "rc": rc, "seconds": round(seconds, 1), "tail": tail if status != "ok" else []}


# -- the stages ------------------------------------------------------------------------------------------------
def stage_env(check: Check) -> dict[str, Any]:
    smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True) if _which("nvidia-smi") else None
    check.say(smi.stdout if smi else "nvidia-smi: not found")
    report = check.out / ".env.json"
    record = check.run("env", [check.python, __file__, "_env", str(report)], 120)
    if report.is_file():
        record["report"] = json.loads(report.read_text())
        report.unlink()
    return record


def env_report(path: str) -> None:
    """The machine's software and the two ceilings, as JSON at `path` (run in its own process)."""
    import platform

    import torch
    import transformers

    report: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    if torch.cuda.is_available():
        from orca_client.bench.decode import copy_bandwidth

        props = torch.cuda.get_device_properties(0)
        report.update({
            "gpu": props.name, "capability": list(torch.cuda.get_device_capability()),
            "multiprocessors": props.multi_processor_count, "memory_bytes": props.total_memory,
            "l2_bytes": getattr(props, "L2_cache_size", None), "cudnn": torch.backends.cudnn.version(),
        })
        device = torch.device("cuda")
        report["copy_bandwidth_bytes_per_second"] = copy_bandwidth(device)
        report["bf16_matmul_flops"] = _matmul_rate(torch, device)
        report["sdpa_kernels_bf16"] = _sdpa_kernels(torch, device)
        free, total = torch.cuda.mem_get_info()
        report["free_memory_bytes"] = free
    Path(path).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def _matmul_rate(torch: Any, device: Any, n: int = 8192) -> float:
    """FLOP/s of an n x n x n bf16 product on random data: the median of 10 after 3 warm-ups, CUDA events."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * n**3 / times[len(times) // 2]


def _sdpa_kernels(torch: Any, device: Any) -> dict[str, str]:
    """Which of SDPA's kernels run a bf16 causal prompt and a decode-shaped call (1 query, GQA 32/8) here."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(4, 32, 128, 64, device=device, dtype=torch.bfloat16)
    k = torch.randn(4, 8, 128, 64, device=device, dtype=torch.bfloat16)
    found = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        try:
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
                torch.nn.functional.scaled_dot_product_attention(q[:, :, -1:], k, k, enable_gqa=True)
            torch.cuda.synchronize()
            found[backend.name] = "ok"
        except Exception as exc:  # noqa: BLE001 - a kernel that does not fit is the finding
            found[backend.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return found


def stage_tests(check: Check, cuda: bool) -> dict[str, Any]:
    xml = check.out / "tests.xml"
    argv = [check.python, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider",
            "-rfEs", f"--junitxml={xml}"]
    # one process: each engine sizes its K/V pool from the GPU's free memory, which parallel tests would share
    if _importable(check.python, "pytest_timeout"):
        argv += ["--timeout", "150"]
    record = check.run("tests", argv, 300)
    if xml.is_file():
        record.update(_junit(xml))
    if not cuda:
        record["note"] = "no CUDA device: every test of tests/test_gpu.py skips (GPU parts skipped)"
    return record


def _junit(path: Path) -> dict[str, Any]:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is not None:
            counts["failed" if bad.tag == "failure" else "errors"] += 1
            failures.append({"test": name, "message": (bad.get("message") or "")[:500],
                             "detail": (bad.text or "")[-3000:]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {"counts": counts, "failures": failures}


def stage_checkpoint(check: Check, shape: str, path: Path) -> dict[str, Any]:
    code = ("from pathlib import Path; from orca_client.bench.decode import build_checkpoint; "
            "from orca import EngineConfig; c = EngineConfig(); "
            f"build_checkpoint({shape!r}, Path({str(path)!r}), c.torch_dtype, c.torch_device)")
    return check.run("checkpoint", [check.python, "-c", code], 180)


def stage_decode(check: Check, checkpoint: Path, cuda: bool, budget: float, tmp: Path,
                 systems: tuple[str, ...] | None = None) -> dict[str, Any]:
    systems = systems or (DECODE_SYSTEMS_CUDA if cuda else DECODE_SYSTEMS_CPU)
    batches = "1,4,16,64,256" if cuda else "1,4"
    # (on a CPU a smoke run: 16 tokens, so that the n-token run outlasts the 1-token one it is differenced
    # with even on a busy host; with 4, a quantized tiny model's once did not, and measured no rate. The
    # medians of 3: one 1-token run that a busy host stalled for 0.16 s outlasted its 16-token run, 0.05 s)
    new_tokens, repeats = ("32", "3") if cuda else ("16", "3")
    record: dict[str, Any] = {"systems": {}}
    merged: dict[str, Any] | None = None
    stop = time.monotonic() + budget
    for i, system in enumerate(systems):
        share = (stop - time.monotonic()) / (len(systems) - i)
        part = tmp / f"decode-{system}.json"
        run = check.run(f"decode {system}", [
            check.python, "-m", "orca_client.bench.decode", "--model", str(checkpoint), "--systems", system,
            "--batch-sizes", batches, "--new-tokens", new_tokens, "--repeats", repeats, "--json", str(part)],
            share)
        if part.is_file():
            result = json.loads(part.read_text())
            run["batches_done"] = [r["batch"] for r in result["runs"] if system in r]
            merged = _merge_decode(merged, result, system)
        record["systems"][system] = run
        if check.left() < 60:
            break
    statuses = {run["status"] for run in record["systems"].values()}
    record["status"] = "ok" if statuses == {"ok"} and len(record["systems"]) == len(systems) else (
        "partial" if merged is not None else "failed")
    record["seconds"] = round(sum(run["seconds"] for run in record["systems"].values()), 1)
    if merged is not None:
        _compare_tokens(merged)
        (check.out / "decode.json").write_text(json.dumps(merged, indent=1) + "\n")
        record["table"] = _decode_table(merged)
        record["copy_bandwidth_bytes_per_second"] = merged["copy_bandwidth_bytes_per_second"]
    return record


def _merge_decode(merged: dict[str, Any] | None, result: dict[str, Any], system: str) -> dict[str, Any]:
    if merged is None:
        merged = {**result, "systems": [], "runs": [{k: r[k] for k in ("batch", "roofline_tokens_per_second")}
                                                    for r in result["runs"]]}
    merged["systems"].append(system)
    cells = {r["batch"]: r.get(system) for r in result["runs"]}
    for row in merged["runs"]:
        if cells.get(row["batch"]) is not None:
            row[system] = cells[row["batch"]]
    return merged


def _compare_tokens(merged: dict[str, Any]) -> None:
    """Requests whose greedy tokens match transformers' (by digest: the systems ran in separate processes)."""
    for row in merged["runs"]:
        hf = row.get("transformers")
        for system in merged["systems"]:
            if system != "transformers" and system in row and hf is not None:
                row[system]["same_tokens_as_transformers"] = sum(
                    a == b for a, b in zip(row[system]["token_digests"], hf["token_digests"]))


def quantized_table(result: dict[str, Any], system: str) -> dict[str, Any]:
    """The quantized stage's table of one `orca-bench decode` result: tokens/s and the roofline's share by
    batch size; None where the run measured no decode rate (its n-token run no longer than its 1-token
    run: a tiny model's few tokens on a busy CPU)."""
    rows = []
    for r in result["runs"]:
        cell = r.get(system)
        if not cell:
            continue
        rate, share = cell.get("decode_tokens_per_second"), cell.get("fraction_of_roofline")
        rows.append({"batch": r["batch"], "tokens_per_second": round(rate) if rate else None,
                     "roofline": round(r["roofline_tokens_per_second"]),
                     "%roofline": round(100 * share, 1) if share else None})
    return {"table": rows}


def _decode_table(merged: dict[str, Any]) -> list[dict[str, Any]]:
    table = []
    for row in merged["runs"]:
        line: dict[str, Any] = {"batch": row["batch"], "roofline": round(row["roofline_tokens_per_second"])}
        for system in merged["systems"]:
            cell = row.get(system)
            if cell and cell.get("decode_tokens_per_second"):
                line[system] = round(cell["decode_tokens_per_second"])
                line[f"{system} %roofline"] = round(100 * cell["fraction_of_roofline"], 1)
                if "same_tokens_as_transformers" in cell:
                    line[f"{system} same/hf"] = f"{cell['same_tokens_as_transformers']}/{row['batch']}"
        table.append(line)
    return table


def best_orca_system(decode: dict[str, Any], batch: int = 64) -> str | None:
    rows = {r["batch"]: r for r in decode.get("table", [])}
    row = rows.get(batch) or (rows[max(rows)] if rows else {})
    rates = {s: row[s] for s in ORCA_OPTIONS if isinstance(row.get(s), (int, float))}
    return max(rates, key=rates.__getitem__) if rates else None


def stage_offline(check: Check, checkpoint: Path, cuda: bool, system: str, limit: float) -> dict[str, Any]:
    target = check.out / "offline.json"
    # The default pool, sized from the GPU's memory (flex's layout grows with the iteration, not the pool).
    workload = (["--num-requests", "256", "--max-bs", "256", "--prompt-len", "64:512", "--max-new-tokens", "32:256",
                 "--token-ids", "3:32000", "--peak-seconds", "2"] if cuda else
                ["--num-requests", "6", "--max-bs", "4", "--prompt-len", "8:32", "--max-new-tokens", "2:8",
                 "--token-ids", "3:250", "--peak-seconds", "0.5"])
    record = check.run(f"offline {system}", [
        check.python, "-m", "orca_client.bench.offline", "--model", str(checkpoint), *ORCA_OPTIONS[system],
        *workload, "--json", str(target)], limit)
    record["system"] = system
    if target.is_file():
        result = json.loads(target.read_text())
        orca = result.get("orca", {})
        record["summary"] = {
            "orca_tokens_per_second": orca.get("tokens_per_second"),
            "transformers_tokens_per_second": result.get("transformers", {}).get("tokens_per_second"),
            "ratio_to_transformers": result.get("ratio"),
            "same_tokens_as_transformers": orca.get("same_tokens_as_transformers"),
            "breakdown_fraction": orca.get("breakdown", {}).get("fraction"),
            "mean_batch_size": orca.get("breakdown", {}).get("mean_batch_size"),
            "single_stream_decode_tokens_per_second": orca.get("single_stream", {}).get("decode_tokens_per_second"),
        }
    return record


FEATURE_BACKENDS = ("batched", "flex")  # on CUDA (a CPU runs auto only): batched, and flex with CUDA graphs
# The feature benches' pool on CUDA: room for their requests (the default pool, sized from the GPU's memory,
# would take most of it for each engine)
FEATURE_N_SLOTS = "65536"
# The quantized stage's weights: none first, the unquantized weights on the same machine, in the same stage
# (fp8 needs a GPU of compute capability 8.9 or later); then, on CUDA, the float weights over a quantized
# K/V pool (kv-<kv_cache_dtype>: flex's paged decode kernel reading values and scales, in CUDA graphs)
QUANTIZED_KINDS_CUDA = ("none", "int8", "int4", "fp8", "kv-fp8_e4m3", "kv-int8")
QUANTIZED_KINDS_CPU = ("none", "int8", "int4", "kv-int8")


def feature_backends(cuda: bool) -> tuple[str, ...]:
    """The attention backends each feature stage (speculative, lora, prefix) runs, a process each."""
    return FEATURE_BACKENDS if cuda else ("auto",)


def _bench_runs(check: Check, stage: str, keys: tuple[str, ...], argv: Callable[[str], list[str]],
                summarize: Callable[[dict[str, Any]], dict[str, Any]], limit: float) -> dict[str, dict[str, Any]]:
    """One bench process per key (`python -m` and argv(key)), each writing <stage>-<key>.json under the output
    folder, sharing `limit` seconds (what one leaves goes to those after it); each run's record with what
    `summarize` draws from its JSON."""
    runs: dict[str, dict[str, Any]] = {}
    stop = time.monotonic() + limit
    for i, key in enumerate(keys):
        target = check.out / f"{stage}-{key}.json"
        run = check.run(f"{stage} {key}", [check.python, "-m", *argv(key), "--json", str(target)],
                        (stop - time.monotonic()) / (len(keys) - i))
        if target.is_file():
            run.update(summarize(json.loads(target.read_text())))
        runs[key] = run
    return runs


def stage_quantized(check: Check, checkpoint: Path, cuda: bool, limit: float) -> dict[str, Any]:
    """Decode tokens/s with the weights quantized at load, flex with CUDA graphs (batched on the CPU)."""
    system = "orca-flex-graphs" if cuda else "orca-batched"
    batches, new_tokens, repeats = ("1,16,64", "32", "2") if cuda else ("1,4", "16", "3")  # (as stage_decode's)

    def argv(kind: str) -> list[str]:
        weights, kv = ("none", kind.removeprefix("kv-")) if kind.startswith("kv-") else (kind, "auto")
        # A quantized pool: batched beside flex, the comparison attention_backend auto's choice waits for
        systems = f"{system},orca-batched" if kv != "auto" and system != "orca-batched" else system
        return ["orca_client.bench.decode", "--model", str(checkpoint), "--systems", systems, "--quantization",
                weights, "--kv-cache-dtype", kv, "--batch-sizes", batches, "--new-tokens", new_tokens,
                "--repeats", repeats]

    def table(result: dict[str, Any]) -> dict[str, Any]:
        record = quantized_table(result, system)
        if system != "orca-batched" and "orca-batched" in result.get("systems", ()):
            record["orca-batched"] = quantized_table(result, "orca-batched")["table"]
        return record

    kinds = QUANTIZED_KINDS_CUDA if cuda else QUANTIZED_KINDS_CPU
    record: dict[str, Any] = {"system": system, "kinds": _bench_runs(check, "quantized", kinds, argv, table, limit)}
    return _combined(record, record["kinds"])


def stage_speculative(check: Check, checkpoint: Path, cuda: bool, limit: float) -> dict[str, Any]:
    size = (["--max-tokens", "64", "--streams", "8", "--single-prompts", "1", "--repeats", "2", "--n-slots",
             FEATURE_N_SLOTS] if cuda else
            ["--max-tokens", "8", "--streams", "2", "--single-prompts", "1", "--repeats", "1"])

    def argv(backend: str) -> list[str]:
        # Speculation's own cost at 8 streams too: never disabled by the batch (the default stops at 4).
        return ["orca_client.bench.speculative", "--model", str(checkpoint), "--workload", "random", "--methods",
                "off,ngram,draft", "--draft-layers", "2" if cuda else "1", "--attention-backend", backend,
                "--speculative-disable-by-batch-size", "1024", *size]

    record: dict[str, Any] = {"backends": _bench_runs(
        check, "speculative", feature_backends(cuda), argv,
        lambda result: {"summary": _speculative_summary(result)}, limit)}
    return _combined(record, record["backends"])


def _speculative_summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per workload: tokens/s of each method (streams, single-stream decode), the ratios to off, and how many
    requests kept speculation off's tokens."""
    out: dict[str, Any] = {}
    for workload, w in result.get("workloads", {}).items():
        out[workload] = {
            "tokens_per_second": {m: {"streams": r["streams"]["tokens_per_second"],
                                      "single": r["single"]["decode_tokens_per_second"]}
                                  for m, r in w["methods"].items()},
            "acceptance_rate": {m: (r["streams"].get("speculation") or {}).get("acceptance_rate")
                                for m, r in w["methods"].items() if m != "off"},
            "ratios_to_off": w.get("ratios_to_off"),
            "same_tokens_as_off": {m: {run: f"{v['equal']}/{v['requests']}" for run, v in same.items()}
                                   for m, same in w.get("same_tokens_as_off", {}).items()},
        }
    return out


def stage_lora(check: Check, checkpoint: Path, cuda: bool, limit: float) -> dict[str, Any]:
    size = (["--adapters", "1,4,16", "--requests", "32", "--max-tokens", "32", "--load-rounds", "4", "--n-slots",
             FEATURE_N_SLOTS] if cuda else
            ["--adapters", "1,2", "--requests", "4", "--max-tokens", "4", "--load-rounds", "1",
             "--prompt-tokens", "8:16"])

    def argv(backend: str) -> list[str]:
        return ["orca_client.bench.lora", "--model", str(checkpoint), "--rank", "8", "--attention-backend", backend,
                *size]

    def summary(result: dict[str, Any]) -> dict[str, Any]:
        runs = result["lora"]["runs"]
        return {"summary": {
            "tokens_per_second": {name: r["tokens_per_second"] for name, r in runs.items()},
            "ratio_to_base": {name: r["ratio_to_base"] for name, r in runs.items()},
            "lora_off_ratio_to_base": result["lora_off"]["ratio_to_base"],
            "load": result.get("load"), "base_same_tokens_as_lora_off": result["base_same_tokens_as_lora_off"]}}

    record: dict[str, Any] = {"backends": _bench_runs(check, "lora", feature_backends(cuda), argv,
                                                      summary, limit)}
    return _combined(record, record["backends"])


def _processes(stage: str, cuda: bool, args: argparse.Namespace) -> int:
    """How many engine processes a bench stage runs (its share of the time left goes by these)."""
    if stage == "quantized":
        return len(QUANTIZED_KINDS_CUDA if cuda else QUANTIZED_KINDS_CPU)
    if stage in ("speculative", "lora", "prefix"):
        return len(feature_backends(cuda))
    if stage == "decode":
        systems = args.systems.split(",") if args.systems else DECODE_SYSTEMS_CUDA if cuda else DECODE_SYSTEMS_CPU
        return len(systems)
    return 1


def stage_prefix(check: Check, checkpoint: Path, cuda: bool, limit: float) -> dict[str, Any]:
    """orca-bench prefix offline (caching on, then off; shared-prefix and multi-turn), per backend."""
    size = (["--n-slots", FEATURE_N_SLOTS] if cuda else
            ["--conversations", "2", "--turns", "2", "--requests", "4", "--concurrency", "2", "--output-tokens", "4",
             "--prefix-tokens", "16", "--user-tokens", "8"])

    def argv(backend: str) -> list[str]:
        return ["orca_client.bench.prefix", "--mode", "offline", "--model", str(checkpoint), "--attention-backend",
                backend, *size]

    def summary(result: dict[str, Any]) -> dict[str, Any]:
        return {"summary": {name: {"ratios": w["offline"]["orca"]["ratios"],
                                   "same_outputs": w["offline"]["orca"]["same_outputs"],
                                   "prefix_cache_on": w["offline"]["orca"]["on"].get("prefix_cache")}
                            for name, w in result["workloads"].items()}}

    record: dict[str, Any] = {"backends": _bench_runs(check, "prefix", feature_backends(cuda),
                                                      argv, summary, limit)}
    return _combined(record, record["backends"])


def stage_host(check: Check, checkpoint: Path, cuda: bool, limit: float) -> dict[str, Any]:
    """scripts/experiments/decode_host_profile.py: where a decode iteration's time goes (the step, the
    device's busy time, the engine's phases, the host's functions), flex with CUDA graphs over the default
    pool on CUDA (batched on a CPU)."""
    target = check.out / "host.json"
    size = (["--systems", "orca-flex-graphs", "--batch-sizes", "1,64,256", "--default-pool"] if cuda else
            ["--systems", "orca-batched", "--batch-sizes", "1,4", "--steps", "4", "--top", "5"])
    record = check.run("host", [check.python, str(ROOT / "scripts" / "experiments" / "decode_host_profile.py"),
                                "--model", str(checkpoint), *size, "--json", str(target)], limit)
    if target.is_file():
        record["summary"] = [
            {"system": r["system"], "batch": r["batch"], "step_ms": round(r["step_ms_median"], 2),
             "device_busy_ms": round(r["device_busy_us_per_iteration"] / 1e3, 2),
             "phases_ms": {k: round(v, 2) for k, v in r["phases_ms_median"].items()}}
            for r in json.loads(target.read_text())["results"]]
    return record


def _combined(record: dict[str, Any], runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    statuses = {run["status"] for run in runs.values()}
    record["status"] = "ok" if statuses == {"ok"} else ("failed" if statuses == {"failed"} else "partial")
    record["seconds"] = round(sum(run["seconds"] for run in runs.values()), 1)
    return record


# -- helpers -----------------------------------------------------------------------------------------------------
def _which(program: str) -> bool:
    from shutil import which

    return which(program) is not None


def _importable(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def _cuda(check: Check) -> bool:
    probe = subprocess.run([check.python, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, env=check.env)
    return probe.stdout.strip() == "True"


def print_table(check: Check) -> None:
    s = check.summary["stages"]
    check.say("\n==== gpu_check summary ====")
    env = s.get("env", {}).get("report", {})
    check.say(f"device: {env.get('gpu') or 'no CUDA device (the GPU parts were skipped; a CPU smoke run)'}; torch "
              f"{env.get('torch')} (CUDA {env.get('cuda')}), transformers {env.get('transformers')}, triton "
              f"{env.get('triton')}")
    if env.get("copy_bandwidth_bytes_per_second"):
        check.say(f"copy bandwidth {env['copy_bandwidth_bytes_per_second'] / 1e12:.2f} TB/s; bf16 matmul "
                  f"{env['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s; SDPA kernels: {env.get('sdpa_kernels_bf16')}")
    for name, stage in s.items():
        extra = stage.get("counts") or stage.get("note") or ""
        check.say(f"{name:>10}: {stage.get('status')} ({stage.get('seconds', 0):.0f} s) {extra}")
    for failure in s.get("tests", {}).get("failures", []):
        check.say(f"  FAILED {failure['test']}: {failure['message'][:300]}")
    for row in s.get("decode", {}).get("table", []):
        check.say("  " + ", ".join(f"{k} {v}" for k, v in row.items()))
    summary = s.get("offline", {}).get("summary")
    if summary:
        check.say(f"  offline ({s['offline']['system']}): {json.dumps(summary, default=str)}")
    for kind, run in s.get("quantized", {}).get("kinds", {}).items():
        for row in run.get("table", []):
            check.say(f"  quantized {kind}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
        for row in run.get("orca-batched", []):
            check.say(f"  quantized {kind} (orca-batched): " + ", ".join(f"{k} {v}" for k, v in row.items()))
    for row in s.get("host", {}).get("summary", []):
        check.say(f"  host {row['system']} B={row['batch']}: step {row['step_ms']} ms, device busy "
                  f"{row['device_busy_ms']} ms, phases {row['phases_ms']}")
    for stage in ("speculative", "lora", "prefix"):
        for backend, run in s.get(stage, {}).get("backends", {}).items():
            if run.get("summary"):
                check.say(f"  {stage} ({backend}): {json.dumps(run['summary'], default=str)}")
    check.say(f"total {time.monotonic() - check.start:.0f} s; files in {check.out}")


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "_env":
        env_report(sys.argv[2])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", default=os.environ.get("OUT") or "gpu_check_out", help="output folder")
    p.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET", "480")),
                   help="seconds for the whole run (default: $GPU_CHECK_BUDGET or %(default)s)")
    p.add_argument("--stages", default=",".join(STAGES),
                   help="comma-separated, run in this order (default: %(default)s)")
    p.add_argument("--systems", default=None,
                   help=f"the decode stage's systems, in order (default: {','.join(DECODE_SYSTEMS_CUDA)} on CUDA, "
                        f"{','.join(DECODE_SYSTEMS_CPU)} elsewhere)")
    p.add_argument("--python", default=sys.executable, help="the interpreter of the stages (default: this one)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, args.budget, args.python)
    stages = args.stages.split(",")
    cuda = _cuda(check)
    check.summary["cuda"] = cuda
    if not cuda:
        check.env["ORCA_TORCH_COMPILE"] = "off"  # the smoke run's engines eager: no compile at each load
        check.say("gpu_check: torch sees no CUDA device: the GPU parts are skipped; the stages run on the CPU as a "
                  "smoke check of this script (a tiny model), and their figures mean nothing")
    unknown = [name for name in stages if name not in STAGES]
    if unknown:
        p.error(f"unknown stage(s) {', '.join(unknown)} (the stages: {', '.join(STAGES)})")
    with tempfile.TemporaryDirectory(prefix="orca-gpu-check-") as tmp_dir:
        tmp = Path(tmp_dir)
        checkpoint = tmp / "model"
        decode: dict[str, Any] = {}
        for name in stages:
            if name == "env":
                record = stage_env(check)
            elif name == "tests":
                record = stage_tests(check, cuda)
            else:
                if not (checkpoint / "config.json").is_file():
                    check.summary["stages"]["checkpoint"] = stage_checkpoint(check, "llama-1b" if cuda else "tiny",
                                                                             checkpoint)
                    check.save()
                    if not (checkpoint / "config.json").is_file():
                        break
                # the bench stages share the time left by their processes (what one leaves goes to those after it)
                rest = [n for n in stages[stages.index(name):] if n not in ("env", "tests")]
                share = check.left() * _processes(name, cuda, args) / sum(_processes(n, cuda, args) for n in rest) - 5
                if name == "quantized":
                    record = stage_quantized(check, checkpoint, cuda, share)
                elif name == "speculative":
                    record = stage_speculative(check, checkpoint, cuda, share)
                elif name == "lora":
                    record = stage_lora(check, checkpoint, cuda, share)
                elif name == "prefix":
                    record = stage_prefix(check, checkpoint, cuda, share)
                elif name == "host":
                    record = stage_host(check, checkpoint, cuda, share)
                elif name == "decode":
                    record = decode = stage_decode(check, checkpoint, cuda, max(0.0, share), tmp,
                                                   tuple(args.systems.split(",")) if args.systems else None)
                else:
                    system = best_orca_system(decode) or ("orca-flex-graphs" if cuda else "orca-batched")
                    record = stage_offline(check, checkpoint, cuda, system, share)
            check.summary["stages"][name] = record
            check.save()
            if check.left() < 20:
                check.say(f"gpu_check: the budget is spent after {name}")
                break
    print_table(check)
    check.save()
    failed = [n for n, st in check.summary["stages"].items() if st.get("status") != "ok"]
    return 1 if failed or check.summary["stages"].get("tests", {}).get("counts", {}).get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
