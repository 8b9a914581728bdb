"""Distributed Orca on CPU processes and gloo: tensor parallelism, pipeline stages with batches in flight,
and workers that fail loudly (orca/executor/distributed.py).

Parity: tp 2, pp 2 and tp 2 x pp 2 give the tokens of one process (and transformers' greedy tokens) for
GPT-2 and Llama with grouped-query attention, on a workload that mixes whole and chunked prompts with
increments and preempts requests; seeded sampling draws the same tokens too. With two stages two plans
are in flight at once, as the workers' own clocks show. Failures (a killed worker, a hung one, an
exception in a worker, a dead driver) end every request with an error within a bound, refuse new ones,
and leave no process behind."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from _fixtures import hf_greedy, tiny_checkpoint, tiny_reference

from orca import EngineConfig, EngineFailedError, LLMEngine, RequestOutput, SamplingParams
from orca_server.server import free_ports

pytestmark = pytest.mark.timeout(240)

# A small pool (block 4, 64 slots) and a token budget: prompts run whole and in chunks, and the pool
# runs out (on_demand preempts the latest arrivals).
COMMON = dict(block_size=4, n_slots=64, max_num_batched_tokens=24, max_bs=8, kv_admission="on_demand")


@dataclass(frozen=True)
class Job:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    join_step: int


def workload(vocab: int) -> list[Job]:
    rng = random.Random(7)
    jobs = []
    for i in range(10):
        prompt = [rng.randrange(0, vocab - 1) for _ in range(rng.choice((3, 9, 17, 30)))]
        if i % 3 == 2:  # seeded sampling
            params = SamplingParams(temperature=0.9, top_k=20, seed=100 + i, max_tokens=10, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True)
        jobs.append(Job(f"r{i}", prompt, params, join_step=(i // 3) * 2))
    return jobs


def run(engine: LLMEngine, jobs: list[Job], max_steps: int = 2000) -> dict[str, RequestOutput]:
    pending = sorted(jobs, key=lambda j: j.join_step)
    final: dict[str, RequestOutput] = {}
    for step in range(max_steps):
        while pending and pending[0].join_step <= step:
            job = pending.pop(0)
            engine.add_request(job.request_id, job.prompt, job.params)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = out
        if not pending and not engine.has_unfinished():
            return final
    raise AssertionError("the engine did not finish")


def engine(family: str, **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_checkpoint(family)), device="cpu", **{**COMMON, **options}))


_reference_runs: dict[str, tuple[dict[str, RequestOutput], int]] = {}


def reference_run(family: str) -> dict[str, RequestOutput]:
    """One process, one batch in flight: the outputs every layout must reproduce."""
    if family not in _reference_runs:
        e = engine(family)
        outputs = run(e, workload(e.model_config.vocab_size))
        _reference_runs[family] = (outputs, e.stats().preemptions)
    return _reference_runs[family][0]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_parallel_layouts_generate_what_one_process_generates(family: str, tp: int, pp: int) -> None:
    expected = reference_run(family)
    assert _reference_runs[family][1] > 0, "the workload must preempt requests"
    e = engine(family, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        assert e.config.effective_n_workers == pp  # n_workers defaults to one batch per stage
        jobs = workload(e.model_config.vocab_size)
        e.profile = pp > 1  # the workers report when they ran each plan
        outputs = run(e, jobs)
        for job in jobs:
            assert outputs[job.request_id].error is None
            assert outputs[job.request_id].token_ids == expected[job.request_id].token_ids, job.request_id
        ref = tiny_reference(family)
        for job in jobs:
            if job.params.temperature == 0:
                assert outputs[job.request_id].token_ids == hf_greedy(ref, job.prompt, job.params.max_tokens)
        if pp > 1:
            # Batches in flight, observed: the first stage started some plan before the last stage had
            # finished the plan before it.
            timings = e.executor.stage_timings
            first = {t.batch_id: t for t in timings if t.rank == 0}
            last = {t.batch_id: t for t in timings if t.rank == e.executor.output_rank}
            overlapped = [b for b in first if b - 1 in last and first[b].start < last[b - 1].end]
            assert overlapped, "two plans were never in flight at once"
    finally:
        e.shutdown()


def test_two_tensor_parallel_engines_at_once() -> None:
    """Two engines with tp 2 in one process tree (as two Triton models would be): ports and processes
    of one never meet the other's."""
    expected = reference_run("llama")
    a, b = engine("llama", tensor_parallel_size=2), engine("gpt2", tensor_parallel_size=2)
    try:
        jobs_a = workload(a.model_config.vocab_size)
        jobs_b = workload(b.model_config.vocab_size)
        for job in jobs_a:
            a.add_request(job.request_id, job.prompt, job.params)
        for job in jobs_b:
            b.add_request(job.request_id, job.prompt, job.params)
        done_a: dict[str, RequestOutput] = {}
        done_b: dict[str, RequestOutput] = {}
        while a.has_unfinished() or b.has_unfinished():  # interleaved iterations
            done_a.update({o.request_id: o for o in a.step() if o.finished})
            done_b.update({o.request_id: o for o in b.step() if o.finished})
        assert {k: v.token_ids for k, v in done_a.items()} == {k: v.token_ids for k, v in expected.items()}
        assert {k: v.token_ids for k, v in done_b.items()} == {
            k: v.token_ids for k, v in reference_run("gpt2").items()
        }
    finally:
        a.shutdown()
        b.shutdown()


# -- refused layouts -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options,message",
    [
        ({"tensor_parallel_size": 3}, "use one of"),  # 8 heads
        ({"pipeline_parallel_size": 4}, "layers"),  # 3 layers
        ({"pipeline_parallel_size": 2, "n_workers": 3}, "n_workers must be in [1, 2]"),
        ({"tensor_parallel_size": 2, "device": "cuda"}, "GPUs"),
        ({"tensor_parallel_size": 2, "local_workers": 1}, "ORCA_WORKER_AUTHKEY"),
    ],
)
def test_invalid_layouts_are_refused_at_load(options: dict, message: str, monkeypatch) -> None:
    monkeypatch.delenv("ORCA_WORKER_AUTHKEY", raising=False)
    if options.get("device") == "cuda":
        import torch

        if torch.cuda.device_count() >= 2:
            pytest.skip("this host has 2 GPUs")
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), **{**COMMON, "device": "cpu", **options}))


# -- failures ---------------------------------------------------------------------------------------------
def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def _wait_gone(pids: list[int], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _start_failing_engine(**options) -> tuple[LLMEngine, list[int]]:
    e = engine("llama", tensor_parallel_size=2, **options)
    pids = e.executor.worker_pids
    rng = random.Random(3)
    for i in range(12):  # more than max_bs: some wait
        prompt = [rng.randrange(0, 190) for _ in range(9)]
        e.add_request(f"f{i}", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        e.step()
    return e, pids


def _finish_with_errors(e: LLMEngine, bound_s: float) -> tuple[dict[str, RequestOutput], float]:
    start = time.monotonic()
    final: dict[str, RequestOutput] = {}
    while e.has_unfinished():
        assert time.monotonic() - start < bound_s, "the failure was not noticed in time"
        for out in e.step():
            if out.finished:
                assert out.request_id not in final, "two final outputs"
                final[out.request_id] = out
    return final, time.monotonic() - start


def _assert_failed_cleanly(e: LLMEngine, final: dict[str, RequestOutput], pids: list[int], words: str) -> None:
    unfinished_before = {f"f{i}" for i in range(12)} - {k for k, v in final.items() if v.finish_reason != "error"}
    assert unfinished_before, "some request must have been unfinished when the worker failed"
    errors = [o for o in final.values() if o.finish_reason == "error"]
    assert errors and all(words in o.error for o in errors), [o.error for o in errors][:2]
    assert e.failed is not None
    with pytest.raises(EngineFailedError, match="failed"):
        e.add_request("late", [1, 2, 3], SamplingParams(max_tokens=2))
    _wait_gone(pids, 10, "a worker process was left behind")
    e.shutdown()  # idempotent after a failure


def test_killed_worker_fails_every_request() -> None:
    e, pids = _start_failing_engine()
    os.kill(pids[1], signal.SIGKILL)
    final, took = _finish_with_errors(e, bound_s=20)
    assert len(final) == 12
    _assert_failed_cleanly(e, final, pids, "worker rank")


def test_hung_worker_misses_its_deadline() -> None:
    e, pids = _start_failing_engine(worker_timeout=3)
    os.kill(pids[0], signal.SIGSTOP)
    try:
        final, took = _finish_with_errors(e, bound_s=30)
    finally:
        for p in pids:
            if not _gone(p):
                os.kill(p, signal.SIGCONT)
    assert took < 15
    assert len(final) == 12
    _assert_failed_cleanly(e, final, pids, "hung")


def test_exception_in_a_worker_fails_the_engine(monkeypatch) -> None:
    monkeypatch.setenv("ORCA_WORKER_FAULT", "1:5:raise")  # rank 1 raises in iteration 5
    monkeypatch.setenv("ORCA_ENABLE_FAULT_INJECTION", "1")  # the fault hooks' test switch (local workers inherit it)
    e, pids = _start_failing_engine()
    final, _ = _finish_with_errors(e, bound_s=20)
    assert len(final) == 12
    _assert_failed_cleanly(e, final, pids, "fault injected")


def test_workers_exit_when_the_driver_dies(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import json, sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from orca import EngineConfig, LLMEngine
        e = LLMEngine(EngineConfig(model={str(tiny_checkpoint("llama"))!r}, device="cpu", pipeline_parallel_size=2,
                                   n_slots=64, block_size=4))
        print(json.dumps(e.executor.worker_pids), flush=True)
        time.sleep(600)
        """
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(driver.stdout.readline())
        assert len(pids) == 2 and not any(_gone(p) for p in pids)
        driver.kill()
        driver.wait()
        _wait_gone(pids, 15, "workers outlived their driver")
    finally:
        driver.kill()


def test_ctrl_c_to_the_process_group_leaves_the_workers_to_the_driver(tmp_path: Path) -> None:
    """A terminal's Ctrl-C signals the whole process group (`make serve`: Triton and its stubs): the driver
    shuts down in order, so its worker processes must not die of the same SIGINT under it."""
    script = textwrap.dedent(
        f"""
        import json, signal, sys
        from orca import EngineConfig, LLMEngine, SamplingParams
        e = LLMEngine(EngineConfig(model={str(tiny_checkpoint("llama"))!r}, device="cpu", tensor_parallel_size=2,
                                   n_slots=64, block_size=4))
        signal.signal(signal.SIGINT, lambda *_: print("driver got SIGINT", flush=True))
        print(json.dumps(e.executor.worker_pids), flush=True)
        sys.stdin.readline()  # the test sends SIGINT to this process group, then a line
        e.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        out = None
        while e.has_unfinished():
            out = e.step()[-1]
        print(json.dumps([out.finish_reason, len(out.token_ids)]), flush=True)
        e.shutdown()
        """
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        pids = json.loads(driver.stdout.readline())
        os.killpg(driver.pid, signal.SIGINT)
        assert driver.stdout.readline().strip() == "driver got SIGINT"
        driver.stdin.write("go\n")
        driver.stdin.flush()
        assert json.loads(driver.stdout.readline()) == ["length", 5]  # both ranks still served the iterations
        assert driver.wait(timeout=60) == 0
        _wait_gone(pids, 15, "workers outlived their driver's shutdown")
    finally:
        driver.kill()


def test_a_rank_on_another_node_joins_with_the_leaderworkerset_environment(monkeypatch) -> None:
    """local_workers 1 of tp 2: the driver starts rank 0 and waits for the other rank, which runs
    `python -m orca.worker` with nothing but LeaderWorkerSet's environment (started first: it retries
    until the driver listens). A stray connection to the control port (a port scan, a TCP probe) before
    it joins is refused without harm."""
    (port,) = free_ports(1)
    secret = "test-secret-" + os.urandom(8).hex()
    monkeypatch.setenv("ORCA_WORKER_AUTHKEY", secret)
    env = {**os.environ, "LWS_LEADER_ADDRESS": "127.0.0.1", "ORCA_CONTROL_PORT": str(port), "LWS_WORKER_INDEX": "1",
           "ORCA_LOCAL_RANKS": "1", "ORCA_WORKER_AUTHKEY": secret}
    remote = subprocess.Popen([sys.executable, "-m", "orca.worker"], env=env)

    def stray() -> None:  # connects and says nothing, while the driver waits for its workers
        for _ in range(100):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)

    threading.Thread(target=stray, daemon=True).start()
    try:
        e = engine("llama", tensor_parallel_size=2, local_workers=1, control_address=f"127.0.0.1:{port}")
        try:
            jobs = workload(e.model_config.vocab_size)
            outputs = run(e, jobs)
            expected = reference_run("llama")
            assert {k: v.token_ids for k, v in outputs.items()} == {k: v.token_ids for k, v in expected.items()}
        finally:
            e.shutdown()
        assert remote.wait(timeout=30) == 0  # the remote rank exits when the driver stops the engine
    finally:
        remote.kill()


def _listening(port: int) -> list[str]:
    """The local addresses listening on `port` (/proc/net/tcp and tcp6, hex as the kernel writes them)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                found.append(local.rsplit(":", 1)[0])
    return found


def test_a_silent_connection_to_the_control_port_blocks_no_worker(monkeypatch) -> None:
    """A connection that opens the control port and never answers the challenge, held open while a real
    remote rank joins after it: the rank joins (each connection authenticates on a thread of its own; the
    handshake deadline is set far beyond the test's, so only that can let it in), the silent one is
    dropped at its deadline, and the TCPStore of the rendezvous listens on the control host only."""
    import orca.executor.distributed as distributed

    monkeypatch.setattr(distributed, "HANDSHAKE_TIMEOUT_S", 600.0)
    (port,) = free_ports(1)
    secret = "test-secret-" + os.urandom(8).hex()
    monkeypatch.setenv("ORCA_WORKER_AUTHKEY", secret)
    built: list[LLMEngine | BaseException] = []

    def build() -> None:
        try:
            built.append(engine("llama", tensor_parallel_size=2, local_workers=1, control_address=f"127.0.0.1:{port}"))
        except BaseException as exc:  # noqa: BLE001 - the test thread reports it
            built.append(exc)

    builder = threading.Thread(target=build, daemon=True)
    builder.start()
    deadline = time.monotonic() + 60
    while True:
        try:
            silent = socket.create_connection(("127.0.0.1", port), timeout=1)
            break
        except OSError:
            assert time.monotonic() < deadline, "the driver never listened"
            time.sleep(0.1)
    env = {**os.environ, "ORCA_WORKER_AUTHKEY": secret}
    remote = subprocess.Popen([sys.executable, "-m", "orca.worker", "--driver", f"127.0.0.1:{port}", "--node-index",
                               "1", "--num-ranks", "1"], env=env)
    try:
        builder.join(timeout=180)
        assert built and not isinstance(built[0], BaseException), built
        e = built[0]
        try:
            assert silent.recv(1024)  # it got the challenge and is still open: it never answered
            store_port = e.executor._store.port
            assert _listening(store_port) == ["0100007F"], _listening(store_port)  # 127.0.0.1, not 0.0.0.0 or ::
            assert _listening(port) == []  # every rank joined: the control port is closed
            outputs = run(e, workload(e.model_config.vocab_size))
            assert all(o.finish_reason == "length" for o in outputs.values())
        finally:
            e.shutdown()
        assert remote.wait(timeout=30) == 0
    finally:
        silent.close()
        remote.kill()
