"""SIGTERM under load: a tritonserver of its own (a tiny orca model, --exit-timeout-secs known) serving many
streams, over gRPC and HTTP, short and long; SIGTERM goes to tritonserver. Every stream gets exactly one
final answer — its tokens and the FINAL, or an error — within the exit timeout (plus a margin for a slow
host); requests sent after the signal are refused (UNAVAILABLE), never left hanging; tritonserver exits, and no process
of it is left behind (no Python backend stub, no orca worker).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path

import aiohttp
import tritonclient.grpc.aio as aiogrpc
from _reliability import (
    Outcome,
    Spec,
    alive,
    descendants,
    finished_by_reason,
    group_processes,
    grpc_request,
    http_request,
    metrics,
    processes_matching,
    size,
)
from _server import SHIPPED_MODEL, _with_parameters
from checkpoints import make_gpt2

from orca_server.server import TritonServer

MODEL = "orca_sigterm"
MODEL_TP2 = "orca_sigterm_tp2"  # tensor parallel over two `python -m orca.worker` processes
MODELS = {MODEL: {"max_bs": "4", "n_slots": "16384"},
          MODEL_TP2: {"max_bs": "4", "n_slots": "8192", "tensor_parallel_size": "2", "device": "cpu"}}


def _repository(root: Path) -> Path:
    repo = root / "model_repository"
    tiny = make_gpt2(root / "tiny-gpt2", n_positions=2048)
    for name, params in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        shutil.copy(SHIPPED_MODEL / "1" / "model.py", repo / name / "1" / "model.py")
        config = _with_parameters((SHIPPED_MODEL / "config.pbtxt").read_text(), name, {"model": str(tiny), **params})
        (repo / name / "config.pbtxt").write_text(config)
    return repo


def _model(index: int) -> str:
    return MODEL_TP2 if index % 4 == 3 else MODEL  # every fourth stream on the tensor-parallel model


def test_sigterm_under_load_answers_every_stream_once_and_leaves_no_process(tmp_path: Path) -> None:
    exit_timeout = int(size("ORCA_SIGTERM_EXIT_TIMEOUT", 8))
    margin = 60.0  # a slow, shared host: Triton's own unloading after the timeout
    streams = int(size("ORCA_SIGTERM_STREAMS", 24))
    repo = _repository(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "ORCA_ENGINE_FAULT"}
    server = TritonServer(repo, log_path=tmp_path / "tritonserver.log", env=env, startup_timeout=600,
                          extra_args=[f"--exit-timeout-secs={exit_timeout}"])
    server.start()
    pgid = server.pid
    try:
        running = [cmd for _, cmd in group_processes(pgid)]
        assert sum("triton_python_backend_stub" in c for c in running) == 2, running
        # The tp-2 model's workers (a session of their own, so found in the process tree): they must not
        # outlive the server either.
        workers = [pid for pid, cmd in descendants(server.pid) if "orca.worker" in cmd]
        assert len(workers) == 2, descendants(server.pid)
        # Short requests finish before the signal or soon after; long ones (2000 tokens, 4 at a time)
        # outlive the exit timeout.
        specs = [Spec(i, input_ids=tuple(range(1 + i, 9 + i)), max_tokens=2000 if i % 3 == 0 else 20 + i)
                 for i in range(streams)]
        sigterm_at: list[float] = []

        async def run() -> tuple[list[Outcome], list[Outcome]]:
            client = aiogrpc.InferenceServerClient(server.grpc_url)
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            try:
                tasks = [asyncio.ensure_future(
                    grpc_request(client, _model(s.key), s, s.key, timeout=600) if s.key % 2 == 0
                    else http_request(session, server.http_url, _model(s.key), s, s.key, timeout=600))
                    for s in specs]
                # Under load: once every request has reached the engine and some have finished, SIGTERM.
                deadline = time.monotonic() + 120
                while True:
                    await asyncio.sleep(0.2)
                    assert time.monotonic() < deadline, "the streams never started"
                    done = [t for t in tasks if t.done()]
                    assert not [t for t in done if t.exception()], [t.exception() for t in done]
                    finished = seen = 0
                    for name in MODELS:
                        m = metrics(server, name)
                        done_here = sum(finished_by_reason(m).values())
                        finished += done_here
                        seen += done_here + m.get("orca_running_requests", 0) + m.get("orca_waiting_requests", 0)
                    if seen == len(tasks) and finished >= 2:
                        break
                sigterm_at.append(time.monotonic())
                server.send_signal(signal.SIGTERM)
                await asyncio.sleep(2.0)  # the model notices the shutdown within about a second
                late = [asyncio.ensure_future(grpc_request(client, MODEL, specs[1], 1000 + i, timeout=600))
                        for i in range(2)]
                everything = [*tasks, *late]
                _, pending = await asyncio.wait(everything, timeout=exit_timeout + margin)
                for t in pending:
                    t.cancel()
                hanging = [specs[i] if i < len(specs) else "late" for i, t in enumerate(everything) if t in pending]
                assert not pending, (f"{len(pending)} streams got no final answer within {exit_timeout + margin:.0f} s "
                                     f"of SIGTERM: {hanging}\n{server.log_path.read_text(errors='replace')[-3000:]}")
                return [t.result() for t in tasks], [t.result() for t in late]
            finally:
                await session.close()
                await client.close()

        outcomes, late = asyncio.run(run())
        code = server.wait(timeout=exit_timeout + margin)
        exited = time.monotonic()

        # Nothing left (before stop(), which would kill it): no process of tritonserver's group (its stubs),
        # none of the tp-2 model's workers, nothing naming its repository or its shared-memory regions. A
        # stub still exiting gets 10 s.
        def leftovers() -> list[tuple[int, str]]:
            return (group_processes(pgid) + processes_matching(str(repo)) + processes_matching(server.shm_prefix)
                    + alive(workers))

        deadline = time.monotonic() + 10
        while leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        left = leftovers()
    finally:
        server.stop()
    log = (tmp_path / "tritonserver.log").read_text(errors="replace")
    assert code is not None, "tritonserver did not exit after SIGTERM"
    assert exited - sigterm_at[0] <= exit_timeout + margin

    finished = cancelled = errors = 0
    for out in outcomes + late:
        # Exactly one final answer: the FINAL (all its tokens) or one error, never both, never two; a
        # stream the server's exit broke off counts as the error the client sees.
        answers = out.terminal + (1 if out.transport_error and out.terminal == 0 else 0)
        assert answers == 1 and not out.after_terminal, out
        assert out.done is not None and out.done - sigterm_at[0] <= exit_timeout + margin, out
        spec = specs[out.index] if out.index < len(specs) else specs[1]
        if out.finals and out.finish_reason == "length":  # ran to its end
            assert len(out.tokens) == spec.max_tokens and not out.errors, out
            finished += 1
        elif out.finals:  # cut off before the exit timeout ended: its FINAL says so
            assert out.finish_reason == "cancelled" and len(out.tokens) < spec.max_tokens, out
            cancelled += 1
        else:
            errors += 1
    # Requests sent after the signal are refused at once (gRPC still takes them while Triton waits for its
    # HTTP connections; the model does not), or, on a host too slow to have noticed, cut off as the others.
    assert all(o.finish_reason == "cancelled" or "shutting down" in " ".join(o.errors) for o in late), late
    assert cancelled + errors >= 1 and finished >= 1, (finished, cancelled, errors)  # some outlived the timeout
    assert not left, left
    print(f"\nSIGTERM: exit code {code}, {finished} finished, {cancelled} cancelled (FINAL), {errors} errors, exit "
          f"{exited - sigterm_at[0]:.1f} s after the signal (exit timeout {exit_timeout} s)\n"
          + "\n".join(line for line in log.splitlines()[-15:]))
