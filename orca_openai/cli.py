"""``orca-openai``: serve the OpenAI-compatible API with uvicorn."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from orca_openai.app import DEFAULT_MAX_BODY_BYTES, Settings, create_app
from orca_openai.tools import PARSERS


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="orca-openai",
        description="An OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions, /health, "
        "/metrics) in front of a Triton serving orca models.",
        epilog="Environment: ORCA_OPENAI_API_KEY sets --api-key. Example: orca-openai --port 9000 "
        "--triton-url localhost:8001",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=9000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--triton-url", default="localhost:8001", help="Triton's gRPC host:port (default: %(default)s)")
    parser.add_argument(
        "--metrics-url",
        default=None,
        help="Triton's metrics URL served at /metrics (default: http://<triton host>:8002/metrics)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("ORCA_OPENAI_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on /v1/ (default: $ORCA_OPENAI_API_KEY; none: open)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are answered 413 (default: %(default)s)",
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
    return parser.parse_args(argv)


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
    settings = Settings(triton_url=args.triton_url, metrics_url=metrics_url, api_key=args.api_key,
                        max_body_bytes=args.max_body_bytes, required_models=tuple(args.require_model),
                        tool_call_parser=args.tool_call_parser,
                        allow_runtime_lora_updating=args.allow_runtime_lora_updating)
    config = uvicorn.Config(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    server = QuietServer(config)
    server.run()
    return 0 if server.started else 3  # uvicorn.run's STARTUP_FAILURE (the port taken, say)
