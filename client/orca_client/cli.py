"""orca-client: talk to orca_gpt over gRPC streaming from the terminal."""

from __future__ import annotations

import argparse
import sys

from orca_client.client import OrcaClient, OrcaError

CHAT_TEMPERATURE = 0.2
"""chat's default temperature: low, as SmolLM2's model card recommends (0.2) for the shipped 135M model, which
at the engine's default of 1.0 soon wanders off; --temperature wins."""
CHAT_TOP_P = 0.9
"""chat's default nucleus: the model card's 0.9, which cuts the unlikely tail a small model's answer can
stray into at temperature 0.2; --top-p wins (1 = off)."""


def _server_default(fallback: str) -> str:
    return f"the server's: the model's generation_config.json, else {fallback}"


def _sampling(args: argparse.Namespace) -> dict:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": args.stop or None,
        "ignore_eos": True if args.ignore_eos else None,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orca-client", description=__doc__)
    p.add_argument("--url", default="localhost:8001", help="Triton gRPC address (default: %(default)s)")
    p.add_argument("--model", default="orca_gpt", help="model name (default: %(default)s)")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser, temperature: float | None, temperature_help: str,
               top_p: float | None = None, top_p_help: str = _server_default("off")) -> None:
        sp.add_argument("--max-tokens", type=int, default=64, help="maximum new tokens (default: %(default)s)")
        sp.add_argument("--temperature", type=float, default=temperature,
                        help=f"0 = greedy (default: {temperature_help})")
        sp.add_argument("--top-k", type=int, default=None, help=f"0 = off (default: {_server_default('off')})")
        sp.add_argument("--top-p", type=float, default=top_p, help=f"1 = off (default: {top_p_help})")
        sp.add_argument("--seed", type=int, default=None)
        sp.add_argument("--stop", action="append", help="stop string (repeatable)")
        sp.add_argument("--ignore-eos", action="store_true")

    g = sub.add_parser("generate", help="complete a prompt given as token ids or text")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--input-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    src.add_argument("--text", help="prompt text (needs a model with a tokenizer)")
    g.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    common(g, None, _server_default("1.0"))

    c = sub.add_parser("chat", help="ask one question; the answer streams to the terminal")
    c.add_argument("message", help="the user message")
    c.add_argument("--system", help="an optional system message")
    common(c, CHAT_TEMPERATURE, f"{CHAT_TEMPERATURE}, which keeps a small model's answer on topic, rather than "
              "the server's default: the model's generation_config.json, else 1.0",
           CHAT_TOP_P, f"{CHAT_TOP_P}, as SmolLM2's model card, rather than the server's default")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sampling = _sampling(args)
    if args.command == "chat":
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.message}
        ]
        request = {"messages": messages, "stream": True, **sampling}
    elif args.input_ids is not None:
        try:
            ids = [int(x) for x in args.input_ids.split(",") if x.strip()]
        except ValueError:
            print("--input-ids must be comma-separated integers", file=sys.stderr)
            return 2
        request = {"input_ids": ids, "stream": args.stream, **sampling}
    else:
        request = {"text": args.text, "stream": args.stream, **sampling}
    try:
        with OrcaClient(args.url, args.model) as client:
            reason = None
            for chunk in client.generate(**request):
                if chunk.text is not None:
                    sys.stdout.write(chunk.text)
                else:
                    sys.stdout.write(" ".join(map(str, chunk.output_ids)) + " ")
                sys.stdout.flush()
                reason = chunk.finish_reason or reason
            sys.stdout.write("\n")
            sys.stdout.flush()
            print(f"[finish_reason: {reason}]", file=sys.stderr)
    except OrcaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
