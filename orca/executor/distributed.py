"""Distributed execution (Orca's distributed serving): one worker process per rank, driven by the engine.

The driver is the engine's process (the Triton model's stub): tokenizer, scheduler, block accounting,
responses. It initialises no CUDA. Each rank is a worker process (``python -m orca.worker``) with one
device: the driver starts its local ranks itself (fresh interpreters, never a fork of the driver), and
ranks on other nodes start the same command with the driver's address (Kubernetes LeaderWorkerSet).

Control plane: one authenticated TCP connection (multiprocessing.connection) between the driver and each
worker. Every iteration the driver pickles its StepPlan once and writes it to every worker (a write to a
socket buffer: the driver does not wait for the workers to read), so every stage prepares its metadata
before its activations arrive; the last stage's first tensor-parallel rank answers with the StepResult.
A worker's exception is reported on the same connection; a dead worker closes it.

Data plane: torch.distributed among the workers only (NCCL on GPUs, gloo on CPUs), rendezvous through a
TCPStore the driver hosts on a port it picks, bound to control_address's host like the control port:
all-reduces and all-gathers inside each stage's tensor-parallel group, [tokens, hidden] activations from
each rank to the same tensor-parallel rank of the next stage.

Failures end in errors, never hangs: a worker that dies, reports an exception, or gives no result within
worker_timeout makes the executor raise WorkerFailure (the engine fails every request and refuses new
ones); the driver kills its local workers; a worker exits when its connection to the driver closes.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge, wait
from typing import Any

from orca.checkpoint import read_model_config, resolve_checkpoint
from orca.config import EngineConfig, fault_spec
from orca.core.plan import StepPlan, StepResult
from orca.executor import WorkerFailure
from orca.parallel import ParallelLayout

logger = logging.getLogger(__name__)

AUTHKEY_ENV = "ORCA_WORKER_AUTHKEY"
FAULT_ENV = "ORCA_WORKER_FAULT"
HANDSHAKE_TIMEOUT_S = 20.0  # a connection to the control port must authenticate within this
START_TIMEOUT_FACTOR = 10  # start-up (connect, load weights, size the pool) may take this x worker_timeout
_KILL_GRACE_S = 5.0


@dataclass(frozen=True)
class Hello:
    """A worker's first message: where it runs. Ranks go by (node_index, local_index)."""

    node_index: int
    local_index: int
    hostname: str
    pid: int


@dataclass(frozen=True)
class Assignment:
    """The driver's answer to Hello: everything a worker needs to join."""

    config: EngineConfig
    rank: int
    store_port: int  # the driver's TCPStore, on the host the worker connected to


@dataclass(frozen=True)
class StageTiming:
    """When a rank ran a plan (plan.profile only): lets tests and benchmarks see batches overlap."""

    rank: int
    batch_id: int
    start: float  # time.time(), wall clock (comparable across processes on one host)
    end: float


# -- the driver's side ------------------------------------------------------------------------------
class DistributedExecutor:
    """Implements orca.executor.Executor over worker processes: submit writes a plan to every worker,
    collect reads the oldest plan's result from the last stage."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size)
        checkpoint = resolve_checkpoint(config.model)
        self.layout.validate(read_model_config(checkpoint)[0])  # refuse before starting anything
        world = self.layout.world_size
        local = world if config.local_workers is None else config.local_workers
        _check_devices(config, local)
        self.max_in_flight = config.pipeline_parallel_size
        self.timeout = float(config.worker_timeout)
        self.start_timeout = START_TIMEOUT_FACTOR * self.timeout  # loading weights may take longer
        self.output_rank = self.layout.rank(config.pipeline_parallel_size - 1, 0)
        self.stage_timings: list[StageTiming] = []  # plan.profile only
        self.plan_bytes = 0  # size of the last plan sent
        self._in_flight: deque[int] = deque()
        self._failed: str | None = None
        self._conns: list[Connection] = []  # by rank
        self._procs: list[subprocess.Popen] = []
        self._listener: socket.socket | None = None
        self._store = None
        secret = os.environ.get(AUTHKEY_ENV) or os.urandom(24).hex()  # local workers inherit it
        if local < world and not os.environ.get(AUTHKEY_ENV):
            raise ValueError(
                f"{world - local} ranks run on other nodes (local_workers {local} of {world}): set the same "
                f"secret in ${AUTHKEY_ENV} for the driver and the workers"
            )
        worker_config = replace(config, model=str(checkpoint))
        try:
            self._start(worker_config, local, secret)
        except BaseException:
            self.shutdown()
            raise

    # -- start-up ----------------------------------------------------------------------------------
    def _start(self, config: EngineConfig, local: int, secret: str) -> None:
        import torch.distributed as dist

        host, _, port = config.control_address.rpartition(":")
        self._listener = _listen(host, int(port), max(8, self.layout.world_size))
        address = self._listener.getsockname()[:2]
        # The TCPStore binds every interface when it opens its own port: hand it one bound to the control
        # host (the pod's address), so the rendezvous is reachable where the control port is and nowhere else.
        store_socket = _listen(host, 0, max(8, self.layout.world_size))
        store_port = store_socket.getsockname()[1]
        try:
            self._store = dist.TCPStore(
                host, store_port, is_master=True, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=self.timeout), master_listen_fd=store_socket.fileno(),
            )
        except BaseException:
            store_socket.close()
            raise
        store_socket.detach()  # the store owns the descriptor now (and closes it)
        logger.info("driver listening on %s:%d for %d ranks (%d local)", *address, self.layout.world_size, local)
        threads = max(1, (os.cpu_count() or 1) // max(1, local))
        env = {**os.environ, AUTHKEY_ENV: secret}  # in the environment, never on a command line
        for i in range(local):
            cmd = [
                _python_executable(), "-m", "orca.worker", "--driver", f"{address[0]}:{address[1]}",
                "--node-index", "0", "--local-index", str(i), "--num-ranks", str(local),
                "--cpu-threads", str(threads),
            ]
            # A session of their own: a Ctrl-C in the terminal (SIGINT to the whole process group) reaches
            # Triton, which shuts the model down; the workers must live until the driver lets them go.
            self._procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True))
        hellos = self._accept(self.layout.world_size, secret.encode())
        order = sorted(hellos, key=lambda h: (h[1].node_index, h[1].local_index))
        self._conns = [conn for conn, _ in order]
        self._hellos = [hello for _, hello in order]
        for rank, conn in enumerate(self._conns):
            conn.send(Assignment(config, rank, self._store.port))
        counts = [self._expect(rank, "ready") for rank in range(len(self._conns))]
        num_blocks = min(counts)
        for conn in self._conns:
            conn.send(("init_pool", num_blocks))
        for rank in range(len(self._conns)):
            self._expect(rank, "pool_ready")
        self.num_blocks = num_blocks
        logger.info("%d workers ready; K/V pool of %d blocks on each", len(self._conns), num_blocks)

    def _accept(self, n: int, authkey: bytes) -> list[tuple[Connection, Hello]]:
        """Waits for n workers to connect and say Hello (local workers that exit early fail at once). Each
        connection authenticates on a thread of its own within HANDSHAKE_TIMEOUT_S (multiprocessing's
        Listener.accept runs the challenge inline, so one silent connection would hold up every worker
        behind it); an authenticated one then has start_timeout to say Hello. The control port closes once
        n have joined."""
        accepted: queue.Queue[tuple[Connection, Hello] | BaseException] = queue.Queue()
        server = self._listener

        def handshake(sock: socket.socket, peer: Any) -> None:
            conn = Connection(os.dup(sock.fileno()))
            # Past the deadline the socket is shut down: a peer that never answers the challenge gets EOF.
            timer = threading.Timer(HANDSHAKE_TIMEOUT_S, _shut, args=(sock,))
            timer.start()
            try:
                deliver_challenge(conn, authkey)
                answer_challenge(conn, authkey)
            except (AuthenticationError, EOFError, OSError) as exc:
                # A peer that is not one of ours (a port scan, a health check, a wrong secret, silence).
                logger.warning("refused a connection to the control port from %s: %s", peer,
                               exc or f"no handshake within {HANDSHAKE_TIMEOUT_S:g} s")
                conn.close()
                return
            finally:
                timer.cancel()
                sock.close()  # conn holds the connection's other descriptor
            try:
                hello = conn.recv() if conn.poll(self.start_timeout) else None
            except (EOFError, OSError):
                hello = None
            if not isinstance(hello, Hello):
                logger.warning("a connection to the control port from %s sent no Hello: closed", peer)
                conn.close()
                return
            _no_delay(conn)
            accepted.put((conn, hello))

        def accept_loop() -> None:
            while True:
                try:
                    sock, peer = server.accept()
                except OSError as exc:  # the listener was closed: start-up is over
                    accepted.put(exc)
                    return
                threading.Thread(target=handshake, args=(sock, peer), name="orca-handshake", daemon=True).start()

        threading.Thread(target=accept_loop, name="orca-accept", daemon=True).start()
        got: list[tuple[Connection, Hello]] = []
        deadline = time.monotonic() + self.start_timeout
        while len(got) < n:
            for i, proc in enumerate(self._procs):
                if proc.poll() is not None:
                    raise WorkerFailure(f"local worker {i} exited with code {proc.returncode} before joining")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerFailure(
                    f"{len(got)} of {n} workers joined within {self.start_timeout:g} s (10 x worker_timeout) "
                    f"(remote ranks run python -m orca.worker --driver HOST:PORT)"
                )
            try:
                item = accepted.get(timeout=min(0.2, remaining))
            except queue.Empty:
                continue
            if isinstance(item, BaseException):
                raise WorkerFailure(f"accepting workers failed: {item}")
            got.append(item)
        _shut(server)  # every rank has joined: nobody else may connect (shutdown wakes the blocked accept)
        server.close()
        self._listener = None
        keys = [(h.node_index, h.local_index) for _, h in got]
        if len(set(keys)) != len(keys):
            raise WorkerFailure(f"two workers claim the same (node index, local index): {sorted(keys)}")
        return got

    def _expect(self, rank: int, kind: str) -> object:
        """The next message from `rank`, which must be (kind, value): returns value."""
        conn = self._conns[rank]
        if not conn.poll(self.start_timeout):
            raise WorkerFailure(
                f"worker rank {rank} sent no {kind!r} within {self.start_timeout:g} s (10 x worker_timeout)"
            )
        msg = self._recv(rank)
        if msg[0] != kind:
            raise WorkerFailure(f"worker rank {rank} sent {msg[0]!r}, expected {kind!r}")
        return msg[1] if len(msg) > 1 else None

    def _recv(self, rank: int) -> tuple:
        try:
            msg = self._conns[rank].recv()
        except (EOFError, OSError):
            raise WorkerFailure(f"worker rank {rank} ({self._where(rank)}) exited") from None
        if msg[0] == "error":
            raise WorkerFailure(f"worker rank {rank} ({self._where(rank)}) failed: {msg[1]}")
        return msg

    def _where(self, rank: int) -> str:
        hellos = getattr(self, "_hellos", None)
        if not hellos:
            return "?"
        h = hellos[rank]
        return f"pid {h.pid} on {h.hostname}"

    # -- iterations --------------------------------------------------------------------------------
    def submit(self, plan: StepPlan) -> None:
        self._check_alive()
        data = pickle.dumps(("plan", plan), protocol=pickle.HIGHEST_PROTOCOL)
        self.plan_bytes = len(data)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(data)
            except OSError:
                self._fail(f"worker rank {rank} ({self._where(rank)}) exited")
        self._in_flight.append(plan.batch_id)

    def collect(self) -> StepResult:
        self._check_alive()
        batch_id = self._in_flight[0]
        deadline = time.monotonic() + self.timeout
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WorkerFailure(
                        f"no result for iteration {batch_id} within worker_timeout {self.timeout:g} s: "
                        f"a worker is hung"
                    )
                for conn in wait(self._conns, timeout=remaining):
                    rank = self._conns.index(conn)
                    msg = self._recv(rank)
                    if msg[0] == "timing":
                        self.stage_timings.append(msg[1])
                    elif msg[0] == "result" and rank == self.output_rank:
                        result: StepResult = msg[1]
                        if result.batch_id != batch_id:
                            raise WorkerFailure(f"got the result of iteration {result.batch_id}, expected {batch_id}")
                        self._in_flight.popleft()
                        return result
                    else:
                        raise WorkerFailure(f"worker rank {rank} sent an unexpected {msg[0]!r}")
        except WorkerFailure as exc:
            self._fail(str(exc))
            raise

    def _check_alive(self) -> None:
        if self._failed is not None:
            raise WorkerFailure(self._failed)

    def _fail(self, message: str) -> None:
        if self._failed is None:
            logger.error("workers failed: %s", message)
            self._failed = message
            self.shutdown()
        raise WorkerFailure(message)

    # -- shutdown ----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops every worker: asks them to exit, kills local ones that do not within a grace period."""
        for conn in self._conns:
            try:
                conn.send(("shutdown",))
            except (OSError, ValueError):
                pass
        for conn in self._conns:
            conn.close()
        self._conns = []
        deadline = time.monotonic() + (_KILL_GRACE_S if self._failed is None else 0.5)
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs = []
        if self._listener is not None:
            _shut(self._listener)
            self._listener.close()
            self._listener = None
        self._store = None

    @property
    def worker_pids(self) -> list[int]:
        """Local worker processes (tests use them to inject failures)."""
        return [p.pid for p in self._procs]


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket listening on host:port (port 0: a free one), as multiprocessing's Listener binds."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=backlog)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _no_delay(conn: Connection) -> None:
    """Small messages go out at once: with Nagle's algorithm a message written right after another waits
    for the peer's delayed ACK (40 ms on Linux)."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()


def _injected_fault(rank: int) -> tuple[int, str] | None:
    """Fault injection for the failure tests, read only with $ORCA_ENABLE_FAULT_INJECTION=1 (local workers
    inherit the driver's environment): $ORCA_WORKER_FAULT = "RANK:ITERATION:KIND" makes that rank raise
    (KIND raise), exit at once (exit) or stop answering (hang) when it gets that iteration's plan."""
    spec = fault_spec(FAULT_ENV)
    if not spec:
        return None
    r, batch_id, kind = spec.split(":")
    return (int(batch_id), kind) if int(r) == rank else None


def _inject(kind: str) -> None:
    if kind == "raise":
        raise RuntimeError(f"fault injected by ${FAULT_ENV}")
    if kind == "exit":
        os._exit(3)
    if kind == "hang":
        while True:
            time.sleep(3600)
    raise ValueError(f"${FAULT_ENV}: unknown fault kind {kind!r} (raise, exit, hang)")


def _check_devices(config: EngineConfig, local: int) -> None:
    device = config.device
    if device == "auto" or device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count()  # reads the driver's device list; creates no CUDA context
        if device.startswith("cuda") and local > count:
            raise ValueError(
                f"{local} local ranks need {local} GPUs, and {count} are visible: lower tensor_parallel_size x "
                f"pipeline_parallel_size, set local_workers and start the other ranks on other nodes, or use "
                f"device cpu"
            )


def _python_executable() -> str:
    """The interpreter for worker processes. Inside Triton's Python backend stub sys.executable may be
    the stub itself; the environment's python is next to the stdlib's prefix."""
    exe = sys.executable
    if exe and os.path.basename(exe).startswith("python"):
        return exe
    for candidate in (os.path.join(sys.prefix, "bin", "python3"), os.path.join(sys.base_prefix, "bin", "python3")):
        if os.access(candidate, os.X_OK):
            return candidate
    return "python3"


# -- the worker's side ------------------------------------------------------------------------------
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
            _no_delay(conn)
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
        return _serve(conn, host, assignment, local_index, cpu_threads)
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


def _serve(conn: Connection, host: str, a: Assignment, local_index: int, cpu_threads: int) -> int:
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
                _inject(fault[1])
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
