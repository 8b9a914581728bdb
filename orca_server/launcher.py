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
import ipaddress
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from orca_client.admin import ADMIN_KEY_ENV, ADMIN_KEY_HEADER, admin_key

from orca_server.server import (
    LOOPBACK,
    RESTRICTED_APIS,
    build_command,
    new_admin_key,
    redact,
    run_beside,
)
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
            "default ports; ORCA_OPENAI_API_KEY makes the OpenAI API ask for that key; ORCA_ADMIN_KEY is the "
            "key of Triton's administrative APIs. "
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
        "--enable-prompt-tokens-details",
        action="store_true",
        help="orca-openai's --enable-prompt-tokens-details: report usage.prompt_tokens_details.cached_tokens "
        "(off by default: it tells a client whether anyone's earlier prompt shared its prefix)",
    )
    parser.add_argument(
        "--address",
        default=LOOPBACK,
        help="bind Triton's HTTP and gRPC ports and orca-openai to this address (default: %(default)s, this host "
        "only; 0.0.0.0 is every interface, an explicit choice that logs a warning)",
    )
    parser.add_argument(
        "--metrics-address",
        default=None,
        help="bind Triton's metrics port to this address (default: --address), e.g. the pod's address for "
        "Prometheus while HTTP and gRPC stay on loopback",
    )
    parser.add_argument(
        "--admin-key-file",
        type=Path,
        default=None,
        help=f"where the admin key of Triton's administrative APIs ({', '.join(RESTRICTED_APIS)}; header "
        f"'{ADMIN_KEY_HEADER}') is: read if the file exists, else a fresh key is written there (mode 0600). "
        f"${ADMIN_KEY_ENV} wins over it; with neither, a fresh key only orca-openai is given. Never printed",
    )
    parser.add_argument(
        "--tritonserver",
        type=Path,
        default=None,
        metavar="PATH",
        help="run this installed tritonserver with its own backends (NVIDIA's container: "
        "/opt/tritonserver/bin/tritonserver) instead of the nvidia-pytriton wheel's",
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
        admin_key = read_admin_key(args.admin_key_file)
        paths = backend_dir = None
        if args.tritonserver is None:
            paths = find_pytriton_paths()
            backend_dir = prepare_backend_dir(
                args.backend_dir or default_backend_dir(), copy=args.copy_backend, paths=paths
            )
        elif args.backend_dir is not None:
            backend_dir = args.backend_dir
    except (TritonServerError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for flag, address in (("--address", args.address), ("--metrics-address", args.metrics_address)):
        if address is not None and not is_loopback(address):
            print(f"warning: {flag} {address}: Triton listens beyond this host; its inference API has no "
                  "authentication (put a gateway or a network policy in front of it)", file=sys.stderr)
    cmd = build_command(
        args.model_repository,
        args.http_port,
        args.grpc_port,
        args.metrics_port,
        backend_dir,
        args.tritonserver_args,
        admin_key=admin_key,
        models=args.models,
        address=args.address,
        metrics_address=args.metrics_address,
        paths=paths,
        tritonserver=args.tritonserver,
    )
    env = server_env(paths=paths) if paths is not None else dict(os.environ)
    host = LOOPBACK if args.address == "0.0.0.0" else args.address
    openai = None if args.no_openai or not args.openai_port else openai_command(args)
    shown = redact(cmd, admin_key)
    if args.dry_run:
        if openai:  # first: the last line stays tritonserver's command
            print(" ".join(openai))
        for key in ("PATH", "LD_LIBRARY_PATH"):
            if key in env:
                print(f"{key}={env[key]}")
        print(shown)
        return 0
    print(shown, flush=True)
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
    return run_beside(cmd, env, openai, {**os.environ, ADMIN_KEY_ENV: admin_key})


def is_loopback(address: str) -> bool:
    """Whether `address` (an IP or a host name) is this host only: 127.0.0.0/8 (IPv4-mapped too), ::1 or
    localhost."""
    if address.strip().lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(address.strip().strip("[]"))
    except ValueError:
        return False
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def read_admin_key(path: Path | None) -> str:
    """The admin key: $ORCA_ADMIN_KEY, else the file at `path` (written with a fresh key, mode 0600, when it
    does not exist yet), else a fresh key."""
    key = admin_key(path)
    if key:
        return key
    key = new_admin_key()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise TritonServerError(f"the admin key file {path} is empty") from None
        with os.fdopen(fd, "w") as out:
            out.write(key + "\n")
    return key


def openai_command(args: argparse.Namespace) -> list[str]:
    """The argv of orca-openai (orca_openai/) fronting the Triton that :func:`main` starts."""
    triton_host = LOOPBACK if args.address == "0.0.0.0" else args.address
    metrics_host = args.metrics_address or args.address
    metrics_host = LOOPBACK if metrics_host == "0.0.0.0" else metrics_host
    return [
        sys.executable, "-m", "orca_openai",
        "--host", args.address,
        "--port", str(args.openai_port),
        "--triton-url", f"{triton_host}:{args.grpc_port}",
        "--metrics-url", f"http://{metrics_host}:{args.metrics_port}/metrics",
        "--tool-call-parser", args.tool_call_parser,
        *(["--enable-prompt-tokens-details"] if args.enable_prompt_tokens_details else []),
    ]


if __name__ == "__main__":
    sys.exit(main())
