"""orca-bench: reproduce Orca's evaluation here (docs/BENCHMARKS.md).

One module per subcommand, in the order of ``orca-bench --help``; each holds the subcommand's long
description (its docstring, which --help shows), its options (add_parser) and its cmd_*:

- trace_cmd: ``orca-bench trace``, the paper's workload (orca_client.trace) against models of a running
  Triton server at a sweep of arrival rates: latencies, throughput within an SLO, the K/V pool's use from
  Triton's metrics, optionally each model's iteration timeline;
- timeline_cmd: ``orca-bench timeline``, an iteration timeline as a Perfetto trace JSON and a PNG (the
  drawing itself is orca_client.timeline);
- offline: ``orca-bench offline``, orca's engine against transformers' continuous batching in one
  process, and CPU peers (vLLM, llama.cpp) in their own venvs: tokens/s, MFU, the K/V pool, single stream;
- linears: ``orca-bench linears``, the model's linear layers alone per linear_backend;
- decode: ``orca-bench decode``, decode tokens/s against batch size and the bandwidth roofline (the GPU
  benchmark; ``python -m orca_client.bench.decode`` runs it without tritonclient);
- distributed: ``orca-bench distributed``, the control plane's cost per iteration for tp / pp layouts;
- serve: ``orca-bench serve``, the servers under guidellm (orca's OpenAI API against vLLM's OpenAI server)
  and orca's per-hop latency at batch 1;
- core: ``orca-bench core``, the scheduler thread's own cost per iteration (the engine core over a stub
  executor) and the output side's, against batch size and history length;
- prefix: ``orca-bench prefix``, automatic prefix caching on and off on multi-turn chats and a shared
  system prompt (real text, the model's chat template): offline in this process, and through orca's
  server and vLLM's (TTFT, throughput, the cache's hit rate);
- perplexity: ``orca-bench perplexity``, the engine's weight and K/V formats (quantization,
  kv_cache_dtype) on real English text against transformers' float32 reference;
- structured: ``orca-bench structured``, structured outputs' cost: grammar engines' compile and mask times
  (xgrammar against llguidance) and the engine's constrained against unconstrained tokens/s;
- speculative: ``orca-bench speculative``, n-gram speculative decoding (prompt lookup) on and off, offline,
  on prompts the answer copies (real text, the model's chat template) and on random tokens: single-stream
  and batched tokens/s, the proposals' acceptance, and whether every token is the same;
- lora: ``orca-bench lora``, multi-LoRA: requests round-robin over 1, 4 and 16 adapters against the base
  model alone, offline, and what loading an adapter into a slot costs.

Shared: common (the machine record, the JSON output, transformers' continuous batching; no tritonclient)
and options (the argparse types and the workload options of trace and offline). This module imports no
subcommand until build_parser runs, so offline, decode, core and speculative run without tritonclient (the
GPU machine has none): ``python -m orca_client.bench.offline`` (decode, core, speculative, lora).

Benchmarks print numbers; they do not pass or fail.
"""

from __future__ import annotations

import argparse
import sys

COMMANDS = ("trace_cmd", "timeline_cmd", "offline", "linears", "decode", "distributed", "serve", "core", "prefix",
            "perplexity", "structured", "speculative", "lora")  # the modules, in the order of orca-bench --help
# What runs where only torch and transformers are installed (the GPU machine): python -m orca_client.bench.X
NO_TRITONCLIENT = ("offline", "decode", "core", "speculative", "lora")


def build_parser(commands: tuple[str, ...] = COMMANDS) -> argparse.ArgumentParser:
    import importlib

    p = argparse.ArgumentParser(prog="orca-bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in commands:
        importlib.import_module(f"orca_client.bench.{name}").add_parser(sub)
    return p


def main(argv: list[str] | None = None, only: str | None = None) -> int:
    """orca-bench; with `only`, that one subcommand (its module's ``python -m``), importing no other."""
    errors: tuple[type[Exception], ...] = (ValueError, OSError)
    try:
        from tritonclient.utils import InferenceServerException

        errors += (InferenceServerException,)
    except ImportError:  # a host with torch and transformers only (the GPU machine): NO_TRITONCLIENT's run
        pass
    if only is not None:
        argv = [only, *(sys.argv[1:] if argv is None else argv)]
    args = build_parser(COMMANDS if only is None else (only,)).parse_args(argv)
    try:
        return args.func(args)
    except errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
