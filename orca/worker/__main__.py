"""``python -m orca.worker``: start this node's ranks of a distributed engine (orca/executor/distributed.py).

The driver (the engine inside Triton, with tensor_parallel_size x pipeline_parallel_size > local_workers)
listens at control_address; each other node runs this command with the driver's address. Defaults come
from the environment, so a Kubernetes LeaderWorkerSet follower needs no arguments but the port:

    LWS_LEADER_ADDRESS  the driver's host        (--driver HOST:PORT overrides host and port)
    ORCA_CONTROL_PORT   the driver's port
    LWS_WORKER_INDEX    this node's index         (the driver's own host is node 0)
    ORCA_LOCAL_RANKS    ranks on this node        (default: visible CUDA devices, else 1)
    ORCA_WORKER_AUTHKEY the shared secret of the driver and its workers (required)

With several ranks on a node it starts one process per rank (rank i of the node uses cuda:i) and exits
when they all have: when the driver stops the engine or goes away.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m orca.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--driver", help="HOST:PORT of the driver (default: $LWS_LEADER_ADDRESS:$ORCA_CONTROL_PORT)")
    p.add_argument("--node-index", type=int,
                   help="this node's index, >= 1 for remote nodes (default: $LWS_WORKER_INDEX)")
    p.add_argument("--num-ranks", type=int,
                   help="ranks on this node (default: $ORCA_LOCAL_RANKS, else the CUDA devices, else 1)")
    p.add_argument("--local-index", type=int, help="run only this local rank in this process (the driver uses it)")
    p.add_argument("--cpu-threads", type=int, default=0,
                   help="torch threads per rank on a CPU (default: cores / ranks)")
    p.add_argument("--connect-timeout", type=float, default=600.0,
                   help="seconds to keep trying to reach the driver (default: 600; the driver may start later)")
    return p


def _driver_address(arg: str | None) -> tuple[str, int]:
    if arg:
        host, _, port = arg.rpartition(":")
    else:
        host, port = os.environ.get("LWS_LEADER_ADDRESS", ""), os.environ.get("ORCA_CONTROL_PORT", "")
    if not host or not port.isdigit():
        raise SystemExit("give --driver HOST:PORT, or set LWS_LEADER_ADDRESS and ORCA_CONTROL_PORT")
    return host, int(port)


def _num_ranks(arg: int | None) -> int:
    if arg is not None:
        return arg
    if os.environ.get("ORCA_LOCAL_RANKS"):
        return int(os.environ["ORCA_LOCAL_RANKS"])
    import torch

    return max(1, torch.cuda.device_count())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    host, port = _driver_address(args.driver)
    secret = os.environ.get("ORCA_WORKER_AUTHKEY")
    if not secret:
        raise SystemExit("set ORCA_WORKER_AUTHKEY to the driver's shared secret")
    node = args.node_index if args.node_index is not None else int(os.environ.get("LWS_WORKER_INDEX", "1"))
    ranks = _num_ranks(args.num_ranks)
    threads = args.cpu_threads or max(1, (os.cpu_count() or 1) // ranks)
    if args.local_index is not None:
        from orca.executor.worker_process import run_worker

        return run_worker(host, port, secret.encode(), node, args.local_index, threads, args.connect_timeout)
    # One process per local rank, each a fresh interpreter.
    procs = [
        subprocess.Popen([
            sys.executable, "-m", "orca.worker", "--driver", f"{host}:{port}", "--node-index", str(node),
            "--num-ranks", str(ranks), "--local-index", str(i), "--cpu-threads", str(threads),
            "--connect-timeout", str(args.connect_timeout),
        ])
        for i in range(ranks)
    ]
    codes = [p.wait() for p in procs]
    return max(codes)


if __name__ == "__main__":
    raise SystemExit(main())
