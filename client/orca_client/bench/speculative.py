"""``orca-bench speculative``: n-gram speculative decoding (prompt lookup, EngineConfig.speculative_method
"ngram") and, when asked, a draft model's ("draft") against none ("off"), offline in this process, on a
workload where lookup finds the next tokens and one whose prompts offer nothing to copy.

Workloads (--workload, comma-separated, default both):
  repetitive  real English text (Python's documentation, pydoc_data.topics, its topics in sorted order) in
              passages of --passage-tokens tokens (whole paragraphs of one topic; one passage per topic in
              turn), each in a chat message asking the model to reproduce it ("Repeat the following text
              exactly, fixing any typos:", "Quote the first sentences of this text verbatim:", alternately),
              rendered with the model's chat template (a checkpoint without one: the message's text through
              its tokenizer; without a tokenizer, the tests' tiny models: the text's UTF-8 bytes as token
              ids). The answer copies the prompt, so prompt lookup proposes tokens the model accepts.
  random      orca-bench offline's workload: random token ids (orca_client.trace's generator, the offline
              preset, prompts of --random-prompt-len tokens). The prompt offers nothing to copy: lookup
              finds matches only where the output repeats itself (a small model's greedy output on random
              tokens may fall into a loop, which lookup does find: the acceptance figures say how much).
Every request generates --max-tokens tokens (EOS ignored: the lengths are fixed), greedy by default,
--sampling seeded for temperature --temperature (0.8) with a seed per request.

For each workload, each method (--methods, of off, ngram and draft; default off,ngram) gets a fresh
LLMEngine (the same options otherwise: --model, --dtype, --quantization, --torch-compile,
--attention-backend, --num-speculative-tokens; ngram with --prompt-lookup-min and --prompt-lookup-max;
draft with its draft model, below), which runs, after a warm-up (--streams other prompts of the workload
at once, up to WARMUP_TOKENS new tokens each: the streams' shapes, whose first use costs a GPU its kernels'
loading and selection; not measured):
  streams  --streams requests of the workload at once (max_bs = --streams), stepped as orca.LLM.generate
           steps them (orca-bench offline's drive): generated tokens / wall time;
  single   the first --single-prompts prompts, each alone, measured as orca-bench offline's single stream
           (orca_client.peers.runner_common.single_stream): per prompt, --repeats times the full request and
           the same prompt with one new token; decode tokens/s = (max_tokens - 1) / (median full - median
           first token); the figure over the prompts = their decode tokens / their summed decode times.
From EngineStats, over each phase: proposed and accepted tokens (acceptance rate = accepted / proposed),
verifications (a request's iteration that verified at least one proposed token) and the mean tokens a
verification gives (1 + accepted / verifications: the accepted proposals and the token the verifying step
samples itself). Speculation must not change any token: every request's tokens are compared with the
off run's (greedy and seeded alike) and the identical ones counted.

The draft method's model (EngineConfig.speculative_model, for its engine only): --speculative-model, a
checkpoint with the model's vocabulary; or, with --draft-layers N instead, a self-speculative ("layer skip")
draft made here from --model (a checkpoint directory, not a .gguf): its first N decoder layers with its
embeddings, final norm and head (orca_client.bench.decode.build_layer_draft), in a temporary directory
removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from orca_client.bench.common import machine_info, write_json
from orca_client.bench.options import (
    add_engine_options,
    comma_choices,
    nonnegative_int,
    positive_float,
    positive_int,
    token_range,
)

WORKLOADS = ("repetitive", "random")
# The warm-up's new tokens per request. Measured on an H200 (1.1B Llama, bf16, 8 streams, the batched backend)
# with a one-prompt warm-up: the first engine of the process ran the streams at 18 ms an iteration, the
# next, doing the same work, at 9.9 ms (new shapes' kernels loaded and selected at first use).
WARMUP_TOKENS = 32
METHODS = ("off", "ngram")  # --methods' default
ALL_METHODS = ("off", "ngram", "draft")  # what --methods takes (draft needs --speculative-model or --draft-layers)
INSTRUCTIONS = (
    "Repeat the following text exactly, fixing any typos:\n\n",
    "Quote the first sentences of this text verbatim:\n\n",
)
SPEC_COUNTERS = ("spec_proposed_tokens", "spec_accepted_tokens", "spec_verifications")


# -- the workloads ------------------------------------------------------------------------------------
def paragraphs(text: str) -> list[str]:
    """A topic's paragraphs, stripped, without its title (a line of * or = underlines it) or empty ones."""
    out = []
    for para in text.split("\n\n"):
        para = para.strip("\n").rstrip()
        lines = para.splitlines()
        if not para.strip() or any(line.strip() and set(line.strip()) <= set("*=-") for line in lines):
            continue
        out.append(para)
    return out


def passages(count: Callable[[str], int], low: int, high: int, limit: int) -> list[str]:
    """Up to `limit` passages of Python's documentation (pydoc_data.topics, topics in sorted order), each
    whole consecutive paragraphs of one topic holding `low` to `high` tokens by `count`: every topic's
    first passage, then every topic's second, and so on, so that consecutive prompts differ in subject.
    Lazy: a topic's text is counted only as far as the passages taken from it."""
    from pydoc_data.topics import topics

    def of_topic(text: str) -> Iterator[str]:
        current: list[str] = []
        tokens = 0
        for para in paragraphs(text):
            n = count(para)
            if tokens + n > high:  # this paragraph would overflow: start afresh at it
                current, tokens = [], 0
                if n > high:
                    continue
            current.append(para)
            tokens += n
            if tokens >= low:
                yield "\n\n".join(current)
                current, tokens = [], 0

    live = [of_topic(topics[key]) for key in sorted(topics)]
    out: list[str] = []
    while live and len(out) < limit:
        for topic in list(live):
            passage = next(topic, None)
            if passage is None:
                live.remove(topic)
            else:
                out.append(passage)
                if len(out) == limit:
                    break
    return out


class Prompter:
    """A message's text as the prompt's token ids: the model's chat template (orca's Tokenizer, as orca_gpt
    applies it, the generation prompt added) where the checkpoint has one; else the text through its
    tokenizer; else (no tokenizer: the tests' tiny models) the text's UTF-8 bytes modulo the vocabulary."""

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        self.tokenizer, self.vocab = tokenizer, vocab
        hf = tokenizer.hf if tokenizer is not None else None
        self.hf = hf
        self.chat = hf is not None and bool(getattr(hf, "chat_template", None))
        self.kind = "chat template" if self.chat else "tokenizer" if hf is not None else "utf-8 bytes"

    def count(self, text: str) -> int:
        """The text's length in the unit the prompts are made of."""
        if self.hf is not None:
            return len(self.hf.encode(text, add_special_tokens=False))
        return len(text.encode())

    def __call__(self, text: str) -> list[int]:
        if self.chat:
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        if self.hf is not None:
            return list(self.hf.encode(text, add_special_tokens=True))
        return [b % self.vocab for b in text.encode()]


def repetitive_prompts(prompter: Prompter, n: int, passage_tokens: tuple[int, int]) -> list[list[int]]:
    texts = passages(prompter.count, *passage_tokens, n)
    if len(texts) < n:
        raise ValueError(f"the text gives {len(texts)} passages of {passage_tokens[0]}-{passage_tokens[1]} tokens, "
                         f"{n} needed: widen --passage-tokens")
    return [prompter(INSTRUCTIONS[i % len(INSTRUCTIONS)] + text) for i, text in enumerate(texts)]


def random_prompts(n: int, prompt_len: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    """orca-bench offline's requests: the offline preset of orca_client.trace, its token ids within the
    vocabulary (as cmd_offline clips them)."""
    from orca_client.trace import PRESETS, make_trace

    spec = PRESETS["offline"]
    high = min(spec.token_ids[1], vocab)
    spec = spec.with_options(num_requests=n, prompt_len=prompt_len, token_ids=(min(spec.token_ids[0], high - 1), high),
                             seed=seed)
    return [list(r.prompt_token_ids) for r in make_trace(spec, None)]


def build_prompts(name: str, args: argparse.Namespace, prompter: Prompter, n: int) -> list[list[int]]:
    if name == "repetitive":
        return repetitive_prompts(prompter, n, args.passage_tokens)
    return random_prompts(n, args.random_prompt_len, prompter.vocab, args.seed)


# -- the runs -----------------------------------------------------------------------------------------
def engine_config(args: argparse.Namespace, method: str, draft: str | None = None) -> Any:
    """The engine of `method`; `draft` is the draft engine's speculative_model (no other method takes one)."""
    from orca import EngineConfig

    options: dict[str, Any] = {
        "model": args.model, "dtype": args.dtype, "quantization": args.quantization,
        "torch_compile": args.torch_compile, "attention_backend": args.attention_backend, "n_slots": args.n_slots,
        "max_bs": args.streams,
        "speculative_method": method,
        "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
        "speculative_model": draft if method == "draft" else None,
    }
    if args.speculative_disable_by_batch_size is not None:  # (else the engine's default)
        options["speculative_disable_by_batch_size"] = args.speculative_disable_by_batch_size
    return EngineConfig(**options)


def check_draft_options(args: argparse.Namespace, methods: Sequence[str]) -> None:
    """--speculative-model and --draft-layers: one of them exactly when draft is among the methods, and
    --draft-layers only from a checkpoint directory (ValueError otherwise, before any work)."""
    given = [name for name, value in (("--speculative-model", args.speculative_model),
                                      ("--draft-layers", args.draft_layers)) if value is not None]
    if "draft" not in methods:
        if given:
            raise ValueError(f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} for the draft method, "
                             f"which --methods ({','.join(methods)}) does not run: add draft or leave it out")
        return
    if not given:
        raise ValueError("--methods draft needs a draft model: --speculative-model PATH (a checkpoint with the "
                         "model's vocabulary) or --draft-layers N (the first N layers of --model)")
    if len(given) == 2:
        raise ValueError("give --speculative-model or --draft-layers, not both: --draft-layers builds the draft "
                         "--speculative-model would name")
    if args.speculative_model is not None and not Path(args.speculative_model).expanduser().exists():
        raise ValueError(f"--speculative-model {args.speculative_model}: no such checkpoint directory or .gguf file")
    if args.draft_layers is not None:
        from orca.checkpoint import default_model_path

        model = default_model_path() if args.model is None else Path(args.model).expanduser()
        if model.suffix == ".gguf":
            raise ValueError(f"--draft-layers builds its draft from a checkpoint directory, and --model "
                             f"{'(the default) ' if args.model is None else ''}{model} is a .gguf file: give a "
                             "checkpoint directory, or a draft checkpoint with --speculative-model")


def sampling(args: argparse.Namespace, max_tokens: int, index: int) -> Any:
    """Request `index`'s parameters: greedy, or --temperature with its own seed (--seed + index)."""
    from orca import SamplingParams

    if args.sampling == "seeded":
        return SamplingParams(max_tokens=max_tokens, temperature=args.temperature, seed=args.seed + index,
                              ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def spec_counters(engine: Any) -> dict[str, int]:
    stats = engine.stats()
    return {name: int(getattr(stats, name)) for name in SPEC_COUNTERS}


def speculation(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    """What speculation did between two readings of EngineStats' cumulative counters."""
    proposed, accepted, verifications = (after[k] - before[k] for k in SPEC_COUNTERS)
    return {
        "proposed_tokens": proposed,
        "accepted_tokens": accepted,
        "verifications": verifications,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_per_verification": accepted / verifications if verifications else None,
        "mean_tokens_per_verification": 1 + accepted / verifications if verifications else None,
    }


def run_method(args: argparse.Namespace, method: str, prompts: list[list[int]], warmup: list[list[int]],
               single: int, draft: str | None = None) -> tuple[dict[str, Any], list[list[int]], list[list[int]]]:
    """One method on a fresh engine: a warm-up, the streams, then each single-stream prompt. Speculation's
    counters are read around each phase (the single-stream phase's include each prompt's warm-up and
    first-token runs). Returns the record, the streams' tokens and the single-stream prompts' tokens."""
    import torch

    from orca import LLMEngine
    from orca_client.bench.offline import drive
    from orca_client.peers.runner_common import single_stream

    engine = LLMEngine(engine_config(args, method, draft))
    try:
        n = args.max_tokens
        drive(engine, warmup, [sampling(args, min(n, WARMUP_TOKENS), len(prompts) + i) for i in range(len(warmup))],
              "warmup")
        iterations = itertools.count()
        before = spec_counters(engine)
        start = time.perf_counter()
        tokens = drive(engine, prompts, [sampling(args, n, i) for i in range(len(prompts))], "streams",
                       lambda it, seconds: next(iterations))
        seconds = time.perf_counter() - start
        generated = sum(len(t) for t in tokens)
        streams = {
            "requests": len(prompts), "seconds": seconds, "generated_tokens": generated,
            "tokens_per_second": generated / seconds, "iterations": next(iterations),
            "speculation": speculation(before, spec_counters(engine)),
        }
        runs = itertools.count()
        before = spec_counters(engine)
        per_prompt, single_tokens = [], []
        for i, prompt in enumerate(prompts[:single]):
            def one(p: list[int], k: int, i: int = i, engine: Any = engine) -> list[int]:
                return drive(engine, [p], [sampling(args, k, i)], f"single-{next(runs)}")[0]

            measured = single_stream(one, {"prompt": prompt, "max_tokens": n, "repeats": args.repeats})
            single_tokens.append(measured.pop("tokens"))
            per_prompt.append(measured)
        record = {
            "speculative_method": engine.config.speculative_method,
            "dtype": str(engine.config.torch_dtype).removeprefix("torch."),
            "device": str(engine.config.torch_device),
            "quantization": engine.config.quantization,
            "streams": streams,
            "single": {**single_summary(per_prompt, n), "speculation": speculation(before, spec_counters(engine))},
        }
    finally:
        engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return record, tokens, single_tokens


def single_summary(per_prompt: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """The single-stream prompts together: their decode tokens over their summed decode times (each prompt's
    median full time less its median first-token time), and whole-request tokens/s likewise."""
    decode = [statistics.median(r["seconds"]) - statistics.median(r["first_token_seconds"]) for r in per_prompt]
    full = [statistics.median(r["seconds"]) for r in per_prompt]
    return {
        "prompts": len(per_prompt),
        "decode_tokens_per_second": (max_tokens - 1) * len(per_prompt) / sum(decode)
        if per_prompt and all(d > 0 for d in decode) else None,
        "tokens_per_second": max_tokens * len(per_prompt) / sum(full) if per_prompt else None,
        "per_prompt": per_prompt,
    }


def _same(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Requests whose tokens are identical in both runs; for each other one, where they first differ."""
    differ = [{"request": i, "position": next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))}
              for i, (x, y) in enumerate(zip(a, b)) if list(x) != list(y)]
    return {"equal": len(a) - len(differ), "requests": len(a), "first_differences": differ}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def run_workload(args: argparse.Namespace, name: str, prompter: Prompter, methods: list[str],
                 draft: str | None = None) -> dict[str, Any]:
    single = min(args.single_prompts, args.streams)
    prompts = build_prompts(name, args, prompter, 2 * args.streams)
    warmup, prompts = prompts[args.streams:], prompts[:args.streams]  # the warm-up's prompts are not measured
    record: dict[str, Any] = {
        "spec": {"requests": len(prompts), "single_prompts": single, "max_tokens": args.max_tokens,
                 "prompt_tokens": [len(p) for p in prompts]},
        "methods": {},
    }
    tokens: dict[str, tuple[list[list[int]], list[list[int]]]] = {}
    for method in methods:
        print(f"== {name}, speculative_method {method}", file=sys.stderr, flush=True)
        run, streams_tokens, single_tokens = run_method(args, method, prompts, warmup, single, draft)
        record["methods"][method] = run
        tokens[method] = (streams_tokens, single_tokens)
    if "off" in tokens and len(tokens) > 1:
        record["same_tokens_as_off"] = {
            m: {"streams": _same(tokens[m][0], tokens["off"][0]), "single": _same(tokens[m][1], tokens["off"][1])}
            for m in methods if m != "off"
        }
        off = record["methods"]["off"]
        record["ratios_to_off"] = {
            m: {"streams": _ratio(r["streams"]["tokens_per_second"], off["streams"]["tokens_per_second"]),
                "single": _ratio(r["single"]["decode_tokens_per_second"], off["single"]["decode_tokens_per_second"])}
            for m, r in record["methods"].items() if m != "off"
        }
    return record


def cmd_speculative(args: argparse.Namespace) -> int:
    workloads = comma_choices(args.workload, WORKLOADS, "workload")
    methods = comma_choices(args.methods, ALL_METHODS, "method")
    check_draft_options(args, methods)
    layer_draft = "draft" in methods and args.draft_layers is not None
    with (tempfile.TemporaryDirectory(prefix="orca-bench-draft-") if layer_draft
          else contextlib.nullcontext()) as directory:
        draft = str(Path(directory) / f"first-{args.draft_layers}-layers") if layer_draft else args.speculative_model
        for method in methods:  # the engine options' errors before any work
            engine_config(args, method, draft)
        return _speculative(args, workloads, methods, draft, layer_draft)


def _speculative(args: argparse.Namespace, workloads: list[str], methods: list[str], draft: str | None,
                 layer_draft: bool) -> int:
    import torch

    from orca.checkpoint import read_model_config, resolve_checkpoint
    from orca.frontend.tokenizer import Tokenizer

    checkpoint = resolve_checkpoint(args.model)
    tokenizer = Tokenizer.load(checkpoint)
    prompter = Prompter(tokenizer if tokenizer.available else None, read_model_config(checkpoint)[0].vocab_size)
    draft_record: dict[str, Any] | None = None
    if layer_draft:
        from orca_client.bench.decode import build_layer_draft

        assert draft is not None
        layers = json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]
        print(f"== the draft: the first {args.draft_layers} of {layers} layers of {checkpoint}", file=sys.stderr,
              flush=True)
        build_layer_draft(checkpoint, args.draft_layers, Path(draft))
        draft_record = {"checkpoint": None, "layers": args.draft_layers, "of_layers": layers}
    elif draft is not None:
        draft_record = {"checkpoint": draft}
    result: dict[str, Any] = {
        "benchmark": "speculative", "command": " ".join(["orca-bench", *sys.argv[1:]]), "machine": machine_info(),
        "checkpoint": str(checkpoint), "torch_threads": torch.get_num_threads(), "prompts": prompter.kind,
        "text": "pydoc_data.topics, sorted",
        "options": {
            "methods": methods, "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max,
            "speculative_model": args.speculative_model, "draft_layers": args.draft_layers,
            "sampling": args.sampling, "temperature": args.temperature if args.sampling == "seeded" else 0.0,
            "seed": args.seed, "max_tokens": args.max_tokens, "streams": args.streams,
            "single_prompts": args.single_prompts, "repeats": args.repeats, "passage_tokens": list(args.passage_tokens),
            "random_prompt_len": list(args.random_prompt_len), "dtype": args.dtype,
            "quantization": args.quantization, "torch_compile": args.torch_compile,
            "attention_backend": args.attention_backend, "n_slots": args.n_slots,
        },
        "draft": draft_record,
        "workloads": {},
    }
    for name in workloads:
        result["workloads"][name] = run_workload(args, name, prompter, methods, draft)
    print_speculative(result)
    if args.json:
        write_json(args.json, result)
    return 0


# -- the table ----------------------------------------------------------------------------------------
def print_speculative(result: dict[str, Any]) -> None:
    o = result["options"]
    first = next(iter(next(iter(result["workloads"].values()))["methods"].values()))
    methods = o["methods"]
    speculating = [m for m in methods if m != "off"] if "off" in methods else []  # compared with off
    proposals = f"up to {o['num_speculative_tokens']} tokens per proposal"
    notes = (f"; ngram: {proposals}, n-grams of {o['prompt_lookup_min']}-{o['prompt_lookup_max']}"
             if "ngram" in methods else "")
    if "draft" in methods:
        draft = result["draft"]
        model = draft.get("checkpoint") or f"the model's first {draft['layers']} of {draft['of_layers']} layers"
        notes += f"; draft: {proposals} by {model}"
    print(f"{o['max_tokens']} new tokens per request ({o['sampling']}, EOS ignored), {first['dtype']} on "
          f"{first['device']} ({result['torch_threads']} threads), quantization {first['quantization']}{notes}; "
          f"prompts by {result['prompts']}")
    header = f"  {'workload':<11} {'run':<10}" + "".join(f" {m + ' tok/s':>11}" for m in methods)
    for m in speculating:
        header += f" {m + '/off':>9} {'accepted':>15} {'tok/verif':>9} {'same as off':>11}"
    print(header)
    for name, w in result["workloads"].items():
        for run, label in (("single", "single"), ("streams", f"{w['spec']['requests']} streams")):
            cells = []
            for m in methods:
                r = w["methods"][m][run]
                value = r["decode_tokens_per_second"] if run == "single" else r["tokens_per_second"]
                cells.append("-" if value is None else f"{value:.1f}")
            line = f"  {name:<11} {label:<10}" + "".join(f" {c:>11}" for c in cells)
            for m in speculating:
                ratio = w["ratios_to_off"][m][run]
                spec = w["methods"][m][run]["speculation"] or {}
                rate, per = spec.get("acceptance_rate"), spec.get("mean_tokens_per_verification")
                same = w["same_tokens_as_off"][m][run]
                accepted = "-" if rate is None else f"{100 * rate:.1f}% of {spec['proposed_tokens']}"
                line += (f" {'-' if ratio is None else f'{ratio:.2f}x':>9} {accepted:>15} "
                         f"{'-' if per is None else f'{per:.2f}':>9} {same['equal']:>6}/{same['requests']:<4}")
            print(line)
    for name, w in result["workloads"].items():  # the correctness property, broken: say where
        for method, runs in w.get("same_tokens_as_off", {}).items():
            for run, same in runs.items():
                for d in same["first_differences"]:
                    print(f"  tokens differ from off's: {name}, {run}, {method}: request {d['request']} from its "
                          f"token {d['position']}")
    print("  (single: decode tokens/s of one request alone, median of repeats; streams: generated tokens / wall "
          "time; accepted: accepted / proposed tokens; tok/verif: tokens per verifying iteration of a request; "
          "same as off: requests whose tokens equal speculation off's)")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("speculative", help="speculative decoding, n-gram (prompt lookup) or, when asked, a draft "
                       "model, on and off, offline, on a workload that copies its prompt and on random tokens",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--workload", default=",".join(WORKLOADS),
                   help="repetitive, random or both, comma-separated (default: %(default)s)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="EngineConfig.speculative_method values to run, comma-separated, of off, ngram and draft; "
                        "off is the reference (default: %(default)s)")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=4,
                   help="EngineConfig.num_speculative_tokens: tokens proposed per request per iteration, at most "
                        "(default: %(default)s)")
    p.add_argument("--prompt-lookup-min", type=positive_int, default=2,
                   help="EngineConfig.prompt_lookup_min: the shortest n-gram matched (default: %(default)s)")
    p.add_argument("--prompt-lookup-max", type=positive_int, default=4,
                   help="EngineConfig.prompt_lookup_max: the longest n-gram matched (default: %(default)s)")
    p.add_argument("--speculative-model", default=None, metavar="PATH",
                   help="EngineConfig.speculative_model of the draft method: a draft checkpoint (dir or .gguf) with "
                        "the model's vocabulary (draft needs it or --draft-layers)")
    p.add_argument("--draft-layers", type=positive_int, default=None, metavar="N",
                   help="the draft method without --speculative-model: a draft of --model's first N decoder layers "
                        "(its embeddings and head), built in a temporary directory (--model a checkpoint dir)")
    p.add_argument("--speculative-disable-by-batch-size", type=positive_int, default=None,
                   help="EngineConfig.speculative_disable_by_batch_size: iterations of this many requests or more "
                        "verify no proposals (default: the engine's, 4; above --streams: never, speculation's "
                        "own cost at every stream count)")
    p.add_argument("--max-tokens", type=positive_int, default=128,
                   help="new tokens per request, EOS ignored (default: %(default)s)")
    p.add_argument("--sampling", choices=("greedy", "seeded"), default="greedy",
                   help="greedy, or sampled at --temperature with seed --seed + the request's index (default: "
                        "%(default)s)")
    p.add_argument("--temperature", type=positive_float, default=0.8,
                   help="--sampling seeded: the temperature (default: %(default)s)")
    p.add_argument("--streams", type=positive_int, default=8,
                   help="requests at once in the streams run (the engine's max_bs) (default: %(default)s)")
    p.add_argument("--single-prompts", type=positive_int, default=3,
                   help="prompts of the workload measured alone, one after another (default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed repeats per single-stream prompt, medians taken (default: %(default)s)")
    p.add_argument("--passage-tokens", type=token_range, default=(100, 250), metavar="A:B",
                   help="repetitive: tokens of each passage of text (default: 100:250)")
    p.add_argument("--random-prompt-len", type=token_range, default=(32, 128), metavar="A:B",
                   help="random: prompt tokens ~ U(A, B) (default: 32:128, orca-bench offline's)")
    p.add_argument("--seed", type=nonnegative_int, default=0,
                   help="random: the trace's seed; seeded sampling: the first request's seed (default: %(default)s)")
    add_engine_options(p)
    p.set_defaults(func=cmd_speculative)


if __name__ == "__main__":  # without tritonclient (the GPU machine): python -m orca_client.bench.speculative
    from orca_client.bench import main

    sys.exit(main(only="speculative"))
