"""The worker's side of distributed execution: a worker process joins the driver, loads its shard, then
carries out every plan it is sent until the driver says stop or goes away."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import time
import traceback
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection

from orca.checkpoint import read_model_config, resolve_checkpoint
from orca.config import fault_spec
from orca.core.plan import StepPlan
from orca.executor.control import AUTHKEY_ENV, Assignment, Hello, StageTiming, no_delay
from orca.parallel import ParallelLayout

FAULT_ENV = "ORCA_WORKER_FAULT"


def _injected_fault(rank: int) -> tuple[int, str] | None:
    """Fault injection for the failure tests, read only with $ORCA_ENABLE_FAULT_INJECTION=1 (local workers
    inherit the driver's environment): $ORCA_WORKER_FAULT = "RANK:ITERATION:KIND" makes that rank raise
    (KIND raise), exit at once (exit) or stop answering (hang) when it gets that iteration's plan."""
    spec = fault_spec(FAULT_ENV)
    if not spec:
        return None
    r, batch_id, kind = spec.split(":")
    return (int(batch_id), kind) if int(r) == rank else None


def inject(kind: str) -> None:
    if kind == "raise":
        raise RuntimeError(f"fault injected by ${FAULT_ENV}")
    if kind == "exit":
        os._exit(3)
    if kind == "hang":
        while True:
            time.sleep(3600)
    raise ValueError(f"${FAULT_ENV}: unknown fault kind {kind!r} (raise, exit, hang)")


def run_worker(
    host: str, port: int, authkey: bytes, node_index: int, local_index: int, cpu_threads: int,
    connect_timeout: float = 0.0,
) -> int:
    """The body of one worker process: join (retrying for connect_timeout seconds while the driver does
    not listen yet), load, then carry out plans until the driver says stop or goes away. Returns the
    process's exit code."""
    deadline = time.monotonic() + connect_timeout
    while True:  # the driver may not listen yet (a LeaderWorkerSet starts followers with the leader)
        try:
            conn = Client((host, port), authkey=authkey)
            no_delay(conn)
            break
        except AuthenticationError:
            print(f"[orca.worker] the driver at {host}:{port} refused ${AUTHKEY_ENV}", file=sys.stderr, flush=True)
            return 1
        except OSError as exc:
            if time.monotonic() > deadline:
                print(f"[orca.worker] cannot reach the driver at {host}:{port} within {connect_timeout:g} s: {exc}",
                      file=sys.stderr, flush=True)
                return 1
            time.sleep(1.0)
    try:
        conn.send(Hello(node_index, local_index, socket.gethostname(), os.getpid()))
        assignment: Assignment = conn.recv()
        return serve_plans(conn, host, assignment, local_index, cpu_threads)
    except (EOFError, OSError):
        return 0  # the driver went away: nothing left to serve
    except BaseException:  # noqa: BLE001 - tell the driver why, then exit
        message = traceback.format_exc(limit=8)
        print(f"[orca.worker] {message}", file=sys.stderr, flush=True)
        try:
            conn.send(("error", message.strip().splitlines()[-1] + "\n" + message))
        except (OSError, ValueError):
            pass
        return 1
    finally:
        conn.close()


def serve_plans(conn: Connection, host: str, a: Assignment, local_index: int, cpu_threads: int) -> int:
    import torch
    import torch.distributed as dist

    from orca.parallel import ParallelContext
    from orca.worker import Worker

    config = a.config
    layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size)
    device = config.torch_device
    if device.type == "cuda":
        device = torch.device("cuda", local_index)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(cpu_threads)
    backend = config.distributed_backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=config.worker_timeout)
    store = dist.TCPStore(host, a.store_port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=a.rank, world_size=layout.world_size, timeout=timeout)
    try:
        tp = layout.tensor_parallel_size
        tp_group = None
        for stage in range(layout.pipeline_parallel_size):  # every rank creates every group, in order
            ranks = [layout.rank(stage, t) for t in range(tp)]
            group = dist.new_group(ranks) if tp > 1 else None
            if a.rank in ranks:
                tp_group = group
        num_layers = read_model_config(resolve_checkpoint(config.model))[0].num_layers
        par = ParallelContext(layout, a.rank, num_layers, tp_group)
        worker = Worker(config, par=par, device=device)
        conn.send(("ready", worker.determine_num_blocks()))
        msg = conn.recv()
        worker.init_kv_pool(msg[1])
        conn.send(("pool_ready",))
        stage, tp_rank = layout.coords(a.rank)
        answers = stage == layout.pipeline_parallel_size - 1 and tp_rank == 0
        fault = _injected_fault(a.rank)
        while True:
            msg = pickle.loads(conn.recv_bytes())
            if msg[0] == "shutdown":
                return 0
            plan: StepPlan = msg[1]
            start = time.time()
            if fault is not None and plan.batch_id == fault[0]:
                inject(fault[1])
            result = worker.execute(plan)
            if result.error is not None:
                # The data plane is in an unknown state (peers may wait on this rank): the engine stops.
                conn.send(("error", f"iteration {plan.batch_id}: {result.error}"))
                return 1
            if plan.profile:
                conn.send(("timing", StageTiming(a.rank, plan.batch_id, start, time.time())))
            if answers:
                conn.send(("result", result))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer may be gone already
            pass
