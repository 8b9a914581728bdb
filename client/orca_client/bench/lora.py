"""``orca-bench lora``: multi-LoRA's throughput, offline in this process: --requests requests spread
round-robin over 1, 4 and 16 adapters (--adapters) against the base model alone on the same engine, and
what putting an adapter into a slot costs.

Adapters: max(--adapters) PEFT adapters of rank --rank (q_proj and v_proj; c_attn for GPT-2), made for the
base checkpoint by orca_client.lora_adapters.make_adapters into a temporary directory, random init (PEFT's
init_lora_weights=False, each layer's delta s B A scaled to 0.1 of its weight's norm: no training, so
fast). Prompts: real English text (Python's documentation, pydoc_data.topics, topics in sorted order) in
passages of --prompt-tokens tokens after "Summarize the following text:", through the model's chat
template (no template: its tokenizer; no tokenizer, the tests' tiny models: the text's UTF-8 bytes), one
passage per request, the same for every configuration; greedy, --max-tokens new tokens each, EOS ignored.

Engines, the same options (--model, --dtype, --quantization, --torch-compile, max_bs --max-bs):
  lora     enable_lora on, max_loras --max-loras (default: the largest adapter count, so every adapter has a
           slot), max_lora_rank --rank, every adapter registered (lora_modules). After a warm-up (a short
           request of each adapter, which loads them into their slots, then every request of the base
           model with up to 8 new tokens: the batch's shapes), timed one after another: "base", every
           request with lora_name None (the base model alone), then for each N of --adapters every request
           i with adapter i mod N; --repeats rounds of these in turn, the median round of each reported;
  lora off enable_lora off (the engine without LoRA layers at all), the same warm-up of the base model and
           --repeats rounds of the same requests, for reference;
  load     enable_lora on, max_loras 1, two adapters (torch_compile off: no forward pass is timed),
           --load-rounds rounds of a one-token request of each in turn: every request evicts the other
           adapter (every load copies the worker's host copy, read when the adapter was registered).
Reported: per configuration generated tokens / wall time, its ratio to "base" and the adapter loads it took
(EngineStats.lora_loads); the adapter load times from EngineCore.lora_load_seconds (the worker's time to
put an adapter into a slot, always from its host copy: registration read the files), median of the first
loads (an adapter's first use) and of the reloads; whether the base run's tokens equal the lora-off
engine's.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import sys
import tempfile
import time
from typing import Any

from orca_client.bench.common import machine_info, write_json
from orca_client.bench.options import add_engine_options, nonnegative_int, positive_int, token_range

INSTRUCTION = "Summarize the following text:\n\n"


def adapter_counts(text: str) -> list[int]:
    """--adapters: positive integers, comma-separated, sorted and without repeats; ValueError otherwise."""
    counts = set()
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"--adapters takes adapter counts >= 1, comma-separated; {item!r} is not one")
        counts.add(int(item))
    if not counts:
        raise ValueError("--adapters: give at least one adapter count (e.g. 1,4,16)")
    return sorted(counts)


def adapter_name(i: int) -> str:
    return f"lora{i}"


def engine_config(args: argparse.Namespace, **options: Any) -> Any:
    from orca import EngineConfig

    base: dict[str, Any] = {"model": args.model, "dtype": args.dtype, "quantization": args.quantization,
                            "torch_compile": args.torch_compile, "attention_backend": args.attention_backend,
                            "n_slots": args.n_slots,
                            "max_bs": args.max_bs or args.requests, "max_lora_rank": args.rank,
                            # Every run computes its prompts: with the prefix cache the base runs would find the
                            # warm-up's (and each round the last round's) blocks, and the adapters' runs, whose
                            # blocks hash apart, fewer.
                            "enable_prefix_caching": False}
    return EngineConfig(**{**base, **options})


def greedy(max_tokens: int, lora_name: str | None) -> Any:
    from orca import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, lora_name=lora_name)


def prompts_of(args: argparse.Namespace, prompter: Any) -> list[list[int]]:
    from orca_client.bench.speculative import passages

    texts = passages(prompter.count, *args.prompt_tokens, args.requests)
    if len(texts) < args.requests:
        raise ValueError(f"the text gives {len(texts)} passages of {args.prompt_tokens[0]}-{args.prompt_tokens[1]} "
                         f"tokens, {args.requests} needed: widen --prompt-tokens")
    return [prompter(INSTRUCTION + text) for text in texts]


def timed(engine: Any, prompts: list[list[int]], names: list[str | None], max_tokens: int,
          tag: str) -> tuple[dict[str, Any], list[list[int]]]:
    """The requests at once (request i with adapter names[i]), stepped as orca.LLM.generate steps them:
    generated tokens / wall time, iterations, and the adapter loads (EngineStats.lora_loads) it took."""
    from orca_client.bench.offline import drive

    iterations = itertools.count()
    loads = engine.stats().lora_loads
    start = time.perf_counter()
    tokens = drive(engine, prompts, [greedy(max_tokens, n) for n in names], tag,
                   lambda it, seconds: next(iterations))
    seconds = time.perf_counter() - start
    generated = sum(len(t) for t in tokens)
    return {"requests": len(prompts), "adapters": len({n for n in names if n is not None}),
            "generated_tokens": generated, "seconds": seconds, "tokens_per_second": generated / seconds,
            "iterations": next(iterations), "adapter_loads": engine.stats().lora_loads - loads}, tokens


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A configuration's rounds as one record: the round of median tokens/s (the lower middle one of an
    even count), every round's tokens/s, and the adapter loads of all rounds."""
    ordered = sorted(rounds, key=lambda r: r["tokens_per_second"])
    median = ordered[(len(ordered) - 1) // 2]
    return {**median, "rounds_tokens_per_second": [r["tokens_per_second"] for r in rounds],
            "adapter_loads": sum(r["adapter_loads"] for r in rounds)}


def load_times(entries: list[tuple[str, float]]) -> dict[str, Any]:
    """EngineCore.lora_load_seconds' (name, seconds) in order: each adapter's first load (its first use),
    and the later ones; all copy the worker's host copy (read at registration, kept while registered)."""
    seen: set[str] = set()
    first, again = [], []
    for name, seconds in entries:
        (again if name in seen else first).append(seconds)
        seen.add(name)
    return {
        "loads": [{"adapter": n, "seconds": s} for n, s in entries],
        "first_loads": len(first), "first_load_median_ms": 1e3 * statistics.median(first) if first else None,
        "reloads": len(again), "reload_median_ms": 1e3 * statistics.median(again) if again else None,
    }


def _shutdown(engine: Any) -> None:
    import torch

    engine.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_lora(args: argparse.Namespace, counts: list[int], modules: str, prompts: list[list[int]],
             max_loras: int) -> tuple[dict[str, Any], list[list[int]], dict[str, Any]]:
    from orca import LLMEngine
    from orca_client.bench.offline import drive

    engine = LLMEngine(engine_config(args, enable_lora=True, max_loras=max_loras, lora_modules=modules))
    try:
        n = len(prompts)
        warm = [adapter_name(i) for i in range(max(counts))]
        drive(engine, [prompts[i % n] for i in range(len(warm))], [greedy(2, w) for w in warm], "warmup")
        drive(engine, prompts, [greedy(min(args.max_tokens, 8), None)] * n, "warmup-base")
        info = {"dtype": str(engine.config.torch_dtype).removeprefix("torch."),
                "device": str(engine.config.torch_device), "quantization": engine.config.quantization,
                "max_bs": engine.config.max_bs, "max_loras": engine.config.max_loras,
                "max_lora_rank": engine.config.max_lora_rank}
        configurations: dict[str, list[str | None]] = {"base": [None] * n}
        configurations.update({str(k): [adapter_name(i % k) for i in range(n)] for k in counts})
        rounds: dict[str, list[dict[str, Any]]] = {key: [] for key in configurations}
        base_tokens: list[list[int]] = []
        for r in range(args.repeats):  # the configurations in turn, round after round
            for key, names in configurations.items():
                label = "base model alone" if key == "base" else f"{key} adapter{'s' if key != '1' else ''}"
                print(f"== lora on, {label} (round {r + 1} of {args.repeats})", file=sys.stderr, flush=True)
                run, tokens = timed(engine, prompts, names, args.max_tokens, f"{key}-{r}")
                rounds[key].append(run)
                if key == "base" and r == 0:
                    base_tokens = tokens
        info["runs"] = {key: summarize(runs) for key, runs in rounds.items()}
        loads = load_times(list(engine.core.lora_load_seconds))
    finally:
        _shutdown(engine)
    return info, base_tokens, loads


def run_lora_off(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[dict[str, Any], list[list[int]]]:
    from orca import LLMEngine
    from orca_client.bench.offline import drive

    print("== lora off, base model", file=sys.stderr, flush=True)
    engine = LLMEngine(engine_config(args, enable_lora=False))
    try:
        drive(engine, prompts, [greedy(min(args.max_tokens, 8), None)] * len(prompts), "warmup-base")
        runs, tokens = [], []
        for r in range(args.repeats):
            run, out = timed(engine, prompts, [None] * len(prompts), args.max_tokens, f"off-{r}")
            runs.append(run)
            tokens = tokens or out
        return summarize(runs), tokens
    finally:
        _shutdown(engine)


def run_load(args: argparse.Namespace, directory: str, prompt: list[int]) -> dict[str, Any]:
    from orca import LLMEngine
    from orca_client.bench.offline import drive

    print("== adapter loads (max_loras 1)", file=sys.stderr, flush=True)
    names = [adapter_name(0), adapter_name(1)]
    modules = ",".join(f"{a}={directory}/{a}" for a in names)
    engine = LLMEngine(engine_config(args, enable_lora=True, max_loras=1, lora_modules=modules, torch_compile="off"))
    try:
        for r in range(args.load_rounds):
            for name in names:
                drive(engine, [prompt], [greedy(1, name)], f"load{r}-{name}")
        return load_times(list(engine.core.lora_load_seconds))
    finally:
        _shutdown(engine)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def cmd_lora(args: argparse.Namespace) -> int:
    import torch

    from orca.checkpoint import read_model_config, resolve_checkpoint
    from orca.frontend.tokenizer import Tokenizer
    from orca_client.bench.speculative import Prompter
    from orca_client.lora_adapters import RANDOM_SCALE, make_adapters

    counts = adapter_counts(args.adapters)
    max_loras = args.max_loras or counts[-1]
    engine_config(args, enable_lora=True, max_loras=max_loras)  # the engine options' errors before any work
    checkpoint = resolve_checkpoint(args.model)
    tokenizer = Tokenizer.load(checkpoint)
    prompter = Prompter(tokenizer if tokenizer.available else None, read_model_config(checkpoint)[0].vocab_size)
    prompts = prompts_of(args, prompter)
    made = max(counts[-1], 2)  # the load phase takes two
    result: dict[str, Any] = {
        "benchmark": "lora", "command": " ".join(["orca-bench", *sys.argv[1:]]), "machine": machine_info(),
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "checkpoint": str(checkpoint),
        "prompts": prompter.kind, "text": "pydoc_data.topics, sorted",
        "options": {"adapters": counts, "requests": args.requests, "max_tokens": args.max_tokens,
                    "prompt_tokens": list(args.prompt_tokens), "max_loras": max_loras, "rank": args.rank,
                    "max_bs": args.max_bs or args.requests, "repeats": args.repeats, "load_rounds": args.load_rounds,
                    "dtype": args.dtype,
                    "quantization": args.quantization, "torch_compile": args.torch_compile,
                    "attention_backend": args.attention_backend, "n_slots": args.n_slots, "seed": args.seed},
        "spec": {"prompt_tokens": [len(p) for p in prompts]},
    }
    with tempfile.TemporaryDirectory(prefix="orca-bench-lora-") as directory:
        print(f"== making {made} random rank-{args.rank} adapters", file=sys.stderr, flush=True)
        start = time.perf_counter()
        records = make_adapters(directory, [adapter_name(i) for i in range(made)], checkpoint, rank=args.rank,
                                seed=args.seed, init="random", log=None)
        gc.collect()
        first = records[0]
        result["adapters"] = {"made": made, "init": "random", "scale": RANDOM_SCALE, "rank": args.rank,
                              "lora_alpha": first["lora_alpha"], "target_modules": first["target_modules"],
                              "seconds": time.perf_counter() - start}
        modules = ",".join(f"{r['name']}={r['path']}" for r in records[:counts[-1]])
        lora, base_tokens, loads = run_lora(args, counts, modules, prompts, max_loras)
        off, off_tokens = run_lora_off(args, prompts)
        result["load"] = run_load(args, directory, prompts[0]) if args.load_rounds else None
    base_tps = lora["runs"]["base"]["tokens_per_second"]
    for run in lora["runs"].values():
        run["ratio_to_base"] = _ratio(run["tokens_per_second"], base_tps)
    off["ratio_to_base"] = _ratio(off["tokens_per_second"], base_tps)
    result["lora"], result["lora_off"] = lora, off
    result["lora_engine_loads"] = loads
    same = sum(1 for a, b in zip(base_tokens, off_tokens) if a == b)
    result["base_same_tokens_as_lora_off"] = {"equal": same, "requests": len(base_tokens)}
    print_lora(result)
    if args.json:
        write_json(args.json, result)
    return 0


# -- the table ----------------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def print_lora(result: dict[str, Any]) -> None:
    m, o, lora, a = result["machine"], result["options"], result["lora"], result["adapters"]
    print(f"{m['cpu']}, {m['cores']} cores ({', '.join(m['cpu_flags']) or 'no avx2'}), torch {result['torch']} "
          f"({result['torch_threads']} threads), {m['date']}")
    lengths = result["spec"]["prompt_tokens"]
    print(f"{o['requests']} requests, prompts of {min(lengths)}-{max(lengths)} tokens ({result['prompts']}), "
          f"{o['max_tokens']} new tokens each (greedy, EOS ignored); {lora['dtype']} on {lora['device']}, "
          f"quantization {lora['quantization']}, max_bs {lora['max_bs']}; max_loras {lora['max_loras']}, "
          f"rank-{a['rank']} random adapters on {', '.join(a['target_modules'])} (made in {a['seconds']:.1f} s)")
    print(f"  {'configuration':<32} {'tok/s':>9} {'/ base':>7} {'seconds':>8} {'iterations':>10} {'loads':>6}")
    rows = [("base model, enable_lora off", result["lora_off"])]
    rows += [("base model (lora on, no adapter)" if k == "base" else f"{k} adapter{'s' if k != '1' else ''}, "
              "round-robin", r) for k, r in lora["runs"].items()]
    for label, r in rows:
        ratio = "-" if r["ratio_to_base"] is None else f"{r['ratio_to_base']:.2f}x"
        print(f"  {label:<32} {r['tokens_per_second']:>9.1f} {ratio:>7} {r['seconds']:>8.2f} {r['iterations']:>10} "
              f"{r.get('adapter_loads', 0):>6}")
    same = result["base_same_tokens_as_lora_off"]
    print(f"  base model's tokens with lora on equal lora off's: {same['equal']}/{same['requests']} requests")
    for label, loads in (("lora engine", result["lora_engine_loads"]), ("max_loras 1", result["load"])):
        if loads:
            print(f"  adapter loads, {label}: first {_ms(loads['first_load_median_ms'])} median of "
                  f"{loads['first_loads']}, reload {_ms(loads['reload_median_ms'])} median of "
                  f"{loads['reloads']}")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("lora", help="multi-LoRA: requests over 1, 4, 16 adapters against the base model alone, "
                       "offline, and adapter load times", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--adapters", default="1,4,16",
                   help="adapter counts, comma-separated: a timed run of the requests round-robin over each "
                        "(default: %(default)s)")
    p.add_argument("--requests", type=positive_int, default=32, help="requests per run (default: %(default)s)")
    p.add_argument("--max-tokens", type=positive_int, default=64,
                   help="new tokens per request, EOS ignored (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=token_range, default=(64, 160), metavar="A:B",
                   help="tokens of each prompt's passage of text (default: 64:160)")
    p.add_argument("--max-loras", type=positive_int, default=None,
                   help="EngineConfig.max_loras (default: the largest --adapters count, so every adapter has a "
                        "slot)")
    p.add_argument("--rank", type=positive_int, default=8,
                   help="the adapters' rank, and EngineConfig.max_lora_rank (default: %(default)s)")
    p.add_argument("--max-bs", type=positive_int, default=None,
                   help="EngineConfig.max_bs (default: --requests, all at once)")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="timed rounds of every configuration, in turn; the median round is reported "
                        "(default: %(default)s)")
    p.add_argument("--load-rounds", type=nonnegative_int, default=4,
                   help="the load phase's rounds (two adapters, max_loras 1; 0: no load phase) "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="adapter i's seed is SEED + i (default: 0)")
    add_engine_options(p)
    p.set_defaults(func=cmd_lora)


if __name__ == "__main__":  # without tritonclient (the GPU machine): python -m orca_client.bench.lora
    from orca_client.bench import main

    sys.exit(main(only="lora"))
