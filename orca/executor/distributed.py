"""Distributed execution (Orca's distributed serving): one worker process per rank, driven by the engine.

The driver (the Triton model's stub) holds the scheduler and initialises no CUDA; each rank is a worker
process (``python -m orca.worker``, orca/executor/worker_process.py) with one device, started by the driver
for local ranks and by the same command elsewhere (Kubernetes LeaderWorkerSet). Control plane: one
authenticated TCP connection per worker (orca/executor/control.py); every plan is written to every worker,
the last stage's first tensor-parallel rank answers. Data plane: torch.distributed among the workers only,
rendezvous through a TCPStore the driver hosts on the control host. A worker that dies, fails or gives no
result within worker_timeout makes the executor raise WorkerFailure: errors, never hangs.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import queue
import socket
import subprocess
import threading
import time
from collections import deque
from dataclasses import replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from typing import Any

from orca.checkpoint import read_model_config, resolve_checkpoint
from orca.config import EngineConfig
from orca.core.plan import StepPlan, StepResult
from orca.executor import WorkerFailure
from orca.executor.control import AUTHKEY_ENV, Assignment, Hello, StageTiming, listen, no_delay, python_executable, shut
from orca.parallel import ParallelLayout

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 20.0  # a connection to the control port must authenticate within this
START_TIMEOUT_FACTOR = 10  # start-up (connect, load weights, size the pool) may take this x worker_timeout
_KILL_GRACE_S = 5.0



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
        self._listener = listen(host, int(port), max(8, self.layout.world_size))
        address = self._listener.getsockname()[:2]
        # The TCPStore binds every interface when it opens its own port: hand it one bound to the control
        # host (the pod's address), so the rendezvous is reachable where the control port is and nowhere else.
        store_socket = listen(host, 0, max(8, self.layout.world_size))
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
                python_executable(), "-m", "orca.worker", "--driver", f"{address[0]}:{address[1]}",
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
            timer = threading.Timer(HANDSHAKE_TIMEOUT_S, shut, args=(sock,))
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
            no_delay(conn)
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
        shut(server)  # every rank has joined: nobody else may connect (shutdown wakes the blocked accept)
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
            shut(self._listener)
            self._listener.close()
            self._listener = None
        self._store = None

    @property
    def worker_pids(self) -> list[int]:
        """Local worker processes (tests use them to inject failures)."""
        return [p.pid for p in self._procs]



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
