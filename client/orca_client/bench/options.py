"""What the subcommands' command lines share: the argparse types (a token range A:B, numbers with a lower
bound), the workload options of the commands that run a trace (trace, offline) and the TraceSpec they give,
and the --help description each subcommand takes from its module's docstring.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any

from orca_client.trace import PRESETS, TraceSpec, parse_range


def trace_spec(args: argparse.Namespace, preset: str) -> TraceSpec:
    return PRESETS[preset].with_options(
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        max_new_tokens=args.max_new_tokens,
        token_ids=args.token_ids,
        seed=args.seed,
    )


def token_range(text: str) -> tuple[int, int]:
    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _number(kind: type, low: float, strict: bool) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or (strict and value == low) or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text}")
        return value

    return parse


positive_int = _number(int, 0, strict=True)
nonnegative_int = _number(int, 0, strict=False)
positive_float = _number(float, 0.0, strict=True)


def comma_choices(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """A comma-separated option's values, each one of `allowed` (in allowed's order); ValueError naming an
    unknown one, or none given, with the allowed values."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    for item in items:
        if item not in allowed:
            raise ValueError(f"unknown {what} {item!r} ({', '.join(allowed)})")
    if not items:
        raise ValueError(f"give at least one {what} ({', '.join(allowed)})")
    return [a for a in allowed if a in items]


def add_workload_options(sp: argparse.ArgumentParser, preset: str) -> None:
    """The options that shape the trace (orca_client.trace's TraceSpec) from `preset`, and --json."""
    spec = PRESETS[preset]
    sp.add_argument("--num-requests", type=int, help=f"requests per run (default: {spec.num_requests})")
    sp.add_argument("--prompt-len", type=token_range, metavar="A:B",
                    help=f"prompt tokens ~ U(A, B) (default: {spec.prompt_len[0]}:{spec.prompt_len[1]})")
    sp.add_argument("--max-new-tokens", type=token_range, metavar="C:D",
                    help=f"new tokens ~ U(C, D) (default: {spec.max_new_tokens[0]}:{spec.max_new_tokens[1]})")
    sp.add_argument("--token-ids", type=token_range, metavar="LOW:HIGH",
                    help=f"prompt token ids ~ U[LOW, HIGH) (default: {spec.token_ids[0]}:{spec.token_ids[1]})")
    sp.add_argument("--seed", type=int, help="trace seed (default: 0)")
    sp.add_argument("--json", metavar="PATH", help="write every number to this JSON file")


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine options of the benches that build an LLMEngine in-process from one options set (speculative,
    lora): --dtype, --quantization, --torch-compile, --attention-backend, --n-slots, and --json."""
    p.add_argument("--dtype", default="auto", help="engine dtype (default: %(default)s)")
    p.add_argument("--quantization", default="auto", metavar="{auto,none,int8,int4,fp8}",
                   help="EngineConfig.quantization (default: %(default)s, the engine's)")
    p.add_argument("--torch-compile", default="auto", choices=("auto", "off"),
                   help="EngineConfig.torch_compile (default: %(default)s)")
    p.add_argument("--attention-backend", default="auto", choices=("auto", "reference", "batched", "flex"),
                   help="EngineConfig.attention_backend (default: %(default)s; flex decodes from CUDA graphs on a GPU)")
    p.add_argument("--n-slots", type=positive_int, default=None,
                   help="EngineConfig.n_slots: the K/V pool's slots (default: the engine's; on a GPU what "
                        "gpu_memory_utilization leaves, which flex's layout spans every iteration)")
    p.add_argument("--json", metavar="PATH", help="write every number to this JSON file")


def doc_description(doc: str | None) -> str:
    """A subcommand's --help description: the first paragraph of its module's docstring, on one line."""
    return " ".join((doc or "").split("\n\n")[0].replace("``", "").split())
