"""The command line, ``python -m orca_server.launcher`` (what ``make serve`` runs).

This module owns the flags, their defaults (the only place ports have defaults:
``ORCA_HTTP_PORT``, ``ORCA_GRPC_PORT``, ``ORCA_METRICS_PORT``, ``ORCA_OPENAI_PORT``
or 8000/8001/8002/9000) and what :func:`main` does with them: assemble the Python
backend (:mod:`orca_server.wheel`), build tritonserver's command
(:mod:`orca_server.server`), then either exec tritonserver or, with the
OpenAI-compatible API on (the default), run it beside orca-openai, whose command
line :func:`openai_command` derives from the same flags
(:func:`orca_server.server.run_beside` supervises the two).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from orca_server.server import build_command, run_beside
from orca_server.wheel import (
    TritonServerError,
    default_backend_dir,
    find_pytriton_paths,
    prepare_backend_dir,
    server_env,
)


def _env_port(name: str, default: int) -> int:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"{name}={value!r} is not a port number") from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m orca_server.launcher",
        description=(
            "Run the tritonserver binary from the nvidia-pytriton wheel on a Triton "
            "model repository, with the Python backend set up for this interpreter. "
            "Arguments after '--' are passed to tritonserver unchanged."
        ),
        epilog=(
            "Environment: ORCA_HTTP_PORT, ORCA_GRPC_PORT, ORCA_METRICS_PORT and ORCA_OPENAI_PORT set the "
            "default ports; ORCA_OPENAI_API_KEY makes the OpenAI API ask for that key. "
            "Example: python -m orca_server.launcher --model-repository "
            "model_repository --model orca_gpt -- --log-verbose=1"
        ),
    )
    parser.add_argument(
        "--model-repository",
        type=Path,
        default=Path("model_repository"),
        help="Triton model repository directory (default: %(default)s)",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=_env_port("ORCA_HTTP_PORT", 8000),
        help="HTTP/REST port (default: $ORCA_HTTP_PORT or 8000; now %(default)s)",
    )
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=_env_port("ORCA_GRPC_PORT", 8001),
        help="gRPC port (default: $ORCA_GRPC_PORT or 8001; now %(default)s)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=_env_port("ORCA_METRICS_PORT", 8002),
        help="Prometheus metrics port (default: $ORCA_METRICS_PORT or 8002; now %(default)s)",
    )
    parser.add_argument(
        "--openai-port",
        type=int,
        default=_env_port("ORCA_OPENAI_PORT", 9000),
        help="port of the OpenAI-compatible API (orca-openai) started beside Triton; 0 = none "
        "(default: $ORCA_OPENAI_PORT or 9000; now %(default)s)",
    )
    parser.add_argument(
        "--no-openai",
        action="store_true",
        help="do not start the OpenAI-compatible API (same as --openai-port 0)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default="auto",
        metavar="{auto,hermes,mistral,llama3_json}",
        help="orca-openai's --tool-call-parser: how tool calls are found in a chat answer's text "
        "(default: %(default)s; python -m orca_openai --help describes each)",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="bind HTTP, gRPC and metrics to this address (default: all interfaces)",
    )
    parser.add_argument(
        "--model",
        dest="models",
        action="append",
        default=[],
        metavar="NAME",
        help="load only this model (repeatable; uses explicit model control). "
        "Default: load every model in the repository",
    )
    parser.add_argument(
        "--backend-dir",
        type=Path,
        default=None,
        help=f"where to assemble the Python backend (default: {default_backend_dir()})",
    )
    parser.add_argument(
        "--copy-backend",
        action="store_true",
        help="copy the backend files instead of symlinking them",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="prepare the backend dir, print the command and environment, do not start",
    )
    parser.add_argument("tritonserver_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tritonserver_args[:1] == ["--"]:
        args.tritonserver_args = args.tritonserver_args[1:]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: prepare the backend and exec tritonserver (never returns on success)."""
    args = parse_args(argv)
    if not args.model_repository.is_dir():
        print(f"error: model repository {args.model_repository} not found", file=sys.stderr)
        return 2
    try:
        paths = find_pytriton_paths()
        backend_dir = prepare_backend_dir(
            args.backend_dir or default_backend_dir(), copy=args.copy_backend, paths=paths
        )
    except (TritonServerError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    cmd = build_command(
        args.model_repository,
        args.http_port,
        args.grpc_port,
        args.metrics_port,
        backend_dir,
        args.tritonserver_args,
        models=args.models,
        address=args.address,
        paths=paths,
    )
    env = server_env(paths=paths)
    host = args.address if args.address not in (None, "0.0.0.0") else "localhost"
    openai = None if args.no_openai or not args.openai_port else openai_command(args)
    if args.dry_run:
        if openai:  # first: the last line stays tritonserver's command
            print(" ".join(openai))
        for key in ("PATH", "LD_LIBRARY_PATH"):
            print(f"{key}={env[key]}")
        print(" ".join(cmd))
        return 0
    print(" ".join(cmd), flush=True)
    print(
        f"Starting Triton. Once it is up:\n"
        f"  curl -sf http://{host}:{args.http_port}/v2/health/ready && echo ready\n"
        f"  curl -s http://{host}:{args.metrics_port}/metrics",
        flush=True,
    )
    if openai is None:
        os.execve(cmd[0], cmd, env)
        return 1  # pragma: no cover - execve does not return
    print(" ".join(openai), flush=True)
    print(f"  curl -s http://{host}:{args.openai_port}/v1/models   (the OpenAI-compatible API)", flush=True)
    return run_beside(cmd, env, openai)


def openai_command(args: argparse.Namespace) -> list[str]:
    """The argv of orca-openai (orca_openai/) fronting the Triton that :func:`main` starts."""
    triton_host = args.address if args.address not in (None, "0.0.0.0") else "127.0.0.1"
    return [
        sys.executable, "-m", "orca_openai",
        "--host", args.address or "0.0.0.0",
        "--port", str(args.openai_port),
        "--triton-url", f"{triton_host}:{args.grpc_port}",
        "--metrics-url", f"http://{triton_host}:{args.metrics_port}/metrics",
        "--tool-call-parser", args.tool_call_parser,
    ]


if __name__ == "__main__":
    sys.exit(main())
