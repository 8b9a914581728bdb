"""``orca-openai``: serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from orca_openai.app import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_STREAM_WRITE_TIMEOUT,
    Settings,
    create_app,
)
from orca_openai.tools import PARSERS
from orca_server.launcher import is_loopback  # the launcher's rule for Triton's addresses, for the same reason

MAX_HEADER_BYTES = 16 * 1024
"""The request line and headers of one request (h11's incomplete-event bound): past it, a 400 and the
connection closed."""
KEEP_ALIVE_SECONDS = 5
"""An idle keep-alive connection is closed after this long (uvicorn's default, set here on purpose)."""


def _positive(kind: type) -> object:
    def parse(text: str) -> object:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="orca-openai",
        description="An OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions, /health, "
        "/metrics) in front of a Triton serving orca models.",
        epilog="Environment: ORCA_OPENAI_API_KEY (comma-separated) sets --api-key; ORCA_ADMIN_KEY is Triton's "
        "admin key (before --triton-admin-key-file); ORCA_CACHE_SALT_SECRET keys --cache-salt-from-key's salts "
        "(default: a random secret per process). Example: orca-openai --port 9000 --triton-url localhost:8001",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: %(default)s, this host only). Any other address needs --api-key, or "
        "--allow-no-api-key",
    )
    parser.add_argument("--port", type=int, default=9000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--triton-url", default="localhost:8001", help="Triton's gRPC host:port (default: %(default)s)")
    parser.add_argument(
        "--metrics-url",
        default=None,
        help="Triton's metrics URL served at /metrics (default: http://<triton host>:8002/metrics)",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/; repeatable, a key per tenant (default: "
        "$ORCA_OPENAI_API_KEY, comma-separated; none: open)",
    )
    parser.add_argument(
        "--allow-no-api-key",
        action="store_true",
        help="listen beyond loopback (--host) without an API key: anyone who reaches the port may generate "
        "(a warning; without this flag orca-openai refuses to start)",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens (vLLM's flag; default: absent, since a caller's "
        "cached_tokens tells whether anyone's earlier prompt began as theirs)",
    )
    parser.add_argument(
        "--cache-salt-from-key",
        action="store_true",
        help="salt each request's prefix cache with its caller's API key (HMAC-SHA256 under "
        "$ORCA_CACHE_SALT_SECRET): tenants share no cached keys and values; a client's cache_salt is combined "
        "with it, never replaces it. Needs --api-key",
    )
    parser.add_argument(
        "--triton-admin-key-file",
        default=None,
        metavar="PATH",
        help="the file holding Triton's admin key (the launcher's --admin-key-file), sent with the repository "
        "index call that lists the models; read at each lookup, so it may appear later "
        "(default: none; $ORCA_ADMIN_KEY wins)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are answered 413 (default: %(default)s)",
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=_positive(int),
        default=DEFAULT_MAX_CONCURRENT_REQUESTS,
        help="/v1/ requests served at once; more are answered 503 at once, not queued (default: %(default)s)",
    )
    parser.add_argument(
        "--stream-write-timeout",
        type=_positive(float),
        default=DEFAULT_STREAM_WRITE_TIMEOUT,
        metavar="SECONDS",
        help="a response (a stream's events) whose client reads nothing for this long is cut off and its "
        "request cancelled (default: %(default)s)",
    )
    parser.add_argument(
        "--graceful-shutdown-timeout",
        type=_positive(float),
        default=30.0,
        metavar="SECONDS",
        help="on SIGINT/SIGTERM, how long running requests may finish before they are cut off (default: "
        "%(default)s, Triton's --exit-timeout-secs)",
    )
    parser.add_argument(
        "--require-model",
        action="append",
        default=[],
        metavar="NAME",
        help="/health answers 503 unless this model is ready (repeatable; default: Triton ready with at least "
        "one orca model, all of them ready)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default="auto",
        help="how tool calls are found in the text of a chat with tools and tool_choice auto: hermes "
        "(<tool_call>{...}</tool_call>: Qwen2.5, Hermes, and templates without tools, which orca renders so), "
        "mistral ([TOOL_CALLS][{...}], or a bare JSON array of calls), llama3_json ({\"name\", \"parameters\"} "
        "objects, ;-separated), auto: any of them (default: %(default)s). tool_choice required or naming a "
        "function is grammar-enforced and needs no parser",
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true"),
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), which load and unload LoRA "
        "adapters of a model with enable_lora true (default: $VLLM_ALLOW_RUNTIME_LORA_UPDATING; off: 404)",
    )
    parser.add_argument("--log-level", default="info", help="uvicorn's log level (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.api_key is None:
        args.api_key = [k.strip() for k in os.environ.get("ORCA_OPENAI_API_KEY", "").split(",") if k.strip()]
    if any(not key.strip() for key in args.api_key):
        parser.error("--api-key must not be empty")
    if args.cache_salt_from_key and not args.api_key:
        parser.error("--cache-salt-from-key needs --api-key (or $ORCA_OPENAI_API_KEY): the salt is derived from "
                     "the caller's key")
    if not args.api_key and not is_loopback(args.host):
        if not args.allow_no_api_key:
            parser.error(f"--host {args.host} listens beyond this host without an API key: anyone who reaches the "
                         "port could generate. Give --api-key (or $ORCA_OPENAI_API_KEY), or --allow-no-api-key")
        print(f"orca-openai: warning: listening on {args.host} without an API key (--allow-no-api-key): anyone "
              "who reaches the port can generate", file=sys.stderr, flush=True)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Serves until SIGINT or SIGTERM, then shuts down gracefully and returns 0 (quietly: no traceback)."""
    try:
        return _serve(parse_args(argv))
    except KeyboardInterrupt:  # Ctrl-C before the server took over SIGINT (while importing, say)
        return 130


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    class QuietServer(uvicorn.Server):
        """uvicorn's Server, but every SIGINT/SIGTERM asks for the same graceful shutdown.

        uvicorn turns a second SIGINT into a forced exit that leaves the lifespan task to be cancelled (its
        CancelledError is logged with a traceback), and re-raises the signals it caught once it has shut down
        (a KeyboardInterrupt, or death by SIGTERM). A Ctrl-C in the terminal of ``make serve`` reaches this
        process twice (the terminal signals the process group, and the launcher forwards it), so: one stop
        request however many signals come, bounded by ``timeout_graceful_shutdown``, and exit status 0."""

        def handle_exit(self, sig: int, frame: object) -> None:
            self.should_exit = True

    metrics_url = args.metrics_url
    if metrics_url is None:
        host = args.triton_url.rsplit(":", 1)[0] or "localhost"
        metrics_url = f"http://{host}:8002/metrics"
    settings = Settings(triton_url=args.triton_url, metrics_url=metrics_url, api_keys=tuple(args.api_key),
                        max_body_bytes=args.max_body_bytes, required_models=tuple(args.require_model),
                        tool_call_parser=args.tool_call_parser,
                        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                        max_concurrent_requests=args.max_concurrent_requests,
                        stream_write_timeout=args.stream_write_timeout,
                        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                        cache_salt_from_key=args.cache_salt_from_key,
                        triton_admin_key_file=args.triton_admin_key_file)
    secret = os.environ.get("ORCA_CACHE_SALT_SECRET")
    if secret:  # replicas behind one Triton (or a restart) then derive the same salts: their caches are shared
        settings.cache_salt_secret = secret.encode()
    # uvicorn's own bounds: connections and tasks (beside the app's bound of /v1/ requests: room for /health,
    # /metrics and idle keep-alive connections, past which uvicorn answers 503), the header block's size, and
    # idle keep-alive connections' lifetime
    config = uvicorn.Config(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.graceful_shutdown_timeout,
                            limit_concurrency=2 * args.max_concurrent_requests + 64,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES, timeout_keep_alive=KEEP_ALIVE_SECONDS)
    server = QuietServer(config)
    server.run()
    return 0 if server.started else 3  # uvicorn.run's STARTUP_FAILURE (the port taken, say)
