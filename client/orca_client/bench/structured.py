"""``orca-bench structured``: what structured outputs cost.

Two parts, in one process:

1. Grammar engines, on the model's tokenizer: for a few real JSON schemas (a person record, an order with
   nested items, a GitHub-issue-like record, a tool call) the compile time (first, and again: cached) and
   the per-token mask time along a real JSON output's tokens, at batch 1 and --batch (each request its own
   matcher, masks filled one after another as the engine core does). xgrammar (what the engine uses) and,
   when installed, llguidance (``pip install llguidance``) side by side: the measurement the choice
   rests on.
2. The engine (orca.LLM, the model as served): --batch requests, unconstrained against constrained by a
   JSON schema that makes long outputs (an array of --items short strings), and at batch 1: generated
   tokens/s of each and the constrained/unconstrained ratio. The unconstrained requests generate as many
   tokens as the constrained ones did (ignore_eos), so the two runs do the same work but the masks; the
   runs alternate, and the time the engine spends on the masks (the core's calls into each constraint,
   the sampler's masking) is measured inside the constrained runs: the overhead without the host's noise.

Benchmarks print numbers; they do not pass or fail.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from orca_client.bench.common import machine_info, write_json
from orca_client.bench.options import positive_int

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.[a-z]{2,4}$"}}, "required": ["name", "age"]},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer"}, "status": {"enum": ["open", "paid", "shipped"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
            "required": ["sku", "qty"]}}, "notes": {"type": ["string", "null"]}},
        "required": ["id", "status", "items"]},
    "issue": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 120}, "labels": {"type": "array", "items": {"type": "string"}},
        "assignee": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
            "login": {"type": "string"}, "id": {"type": "integer"}}, "required": ["login", "id"]}]},
        "state": {"enum": ["open", "closed"]}, "comments": {"type": "integer", "minimum": 0},
        "created_at": {"type": "string", "format": "date-time"}},
        "required": ["title", "labels", "assignee", "state", "comments", "created_at"]},
    "tool_call": {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"]}}, "required": ["name", "parameters"]},
        {"type": "object", "properties": {"name": {"const": "search"}, "parameters": {
            "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
            "required": ["name", "parameters"]}]}},
}
SAMPLES: dict[str, Any] = {
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"},
    "order": {"id": 1207, "status": "paid", "items": [{"sku": "ab-12", "qty": 3, "price": 9.5},
                                                       {"sku": "x-7", "qty": 1}], "notes": None},
    "issue": {"title": "Server hangs when the grammar never completes", "labels": ["bug", "structured-outputs"],
              "assignee": {"login": "octocat", "id": 583231}, "state": "open", "comments": 4,
              "created_at": "2026-11-26T07:00:00Z"},
    "tool_call": [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}],
}


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def engines(tokenizer: Any, vocab: int, stop_ids: list[int], batch: int) -> dict[str, Any]:
    """Compile and per-token mask times of xgrammar and (when installed) llguidance."""
    import xgrammar

    from orca.frontend.grammar import json_schema_grammar

    out: dict[str, Any] = {}
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=stop_ids)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    xg: dict[str, Any] = {"tokenizer_setup_s": time.perf_counter() - start, "schemas": {}}
    for name, schema in SCHEMAS.items():
        text = json.dumps(schema)
        t0 = time.perf_counter()
        compiled = compiler.compile_grammar(json_schema_grammar(text, True))
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.compile_grammar(json_schema_grammar(text, True))
        again = time.perf_counter() - t0
        ids = tokenizer.encode(json.dumps(SAMPLES[name]), add_special_tokens=False)
        record = {"compile_first_ms": first * 1e3, "compile_again_ms": again * 1e3, "tokens": len(ids)}
        for b in (1, batch):
            matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(b)]
            mask = xgrammar.allocate_token_bitmask(1, vocab)
            steps = []
            for token in ids:
                t0 = time.perf_counter()
                for m in matchers:
                    m.fill_next_token_bitmask(mask, 0)
                    mask.numpy().tobytes()  # what GrammarConstraint hands the core
                steps.append(time.perf_counter() - t0)
                for m in matchers:
                    if not m.accept_token(token):
                        raise RuntimeError(f"xgrammar refused the sample of {name} at token {token}")
            record[f"mask_ms_per_step_batch_{b}"] = _median_ms(steps)
        xg["schemas"][name] = record
    out["xgrammar"] = xg
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy as lnp
    except ImportError:
        out["llguidance"] = "not installed (pip install llguidance to compare)"
        return out
    start = time.perf_counter()
    ltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    lg: dict[str, Any] = {"tokenizer_setup_s": time.perf_counter() - start, "schemas": {}}
    for name, schema in SCHEMAS.items():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        t0 = time.perf_counter()
        first_matcher = llguidance.LLMatcher(ltok, grammar)
        first = time.perf_counter() - t0
        ids = tokenizer.encode(json.dumps(SAMPLES[name]), add_special_tokens=False)
        record = {"matcher_first_ms": first * 1e3, "tokens": len(ids), "error": first_matcher.get_error() or None}
        for b in (1, batch):
            matchers = [llguidance.LLMatcher(ltok, grammar) for _ in range(b)]
            mask = lnp.allocate_token_bitmask(1, vocab)
            steps = []
            for token in ids:
                t0 = time.perf_counter()
                for m in matchers:
                    lnp.fill_next_token_bitmask(m, mask, 0)
                steps.append(time.perf_counter() - t0)
                for m in matchers:
                    m.consume_token(token)
            record[f"mask_ms_per_step_batch_{b}"] = _median_ms(steps)
        lg["schemas"][name] = record
    out["llguidance"] = lg
    return out


class _MaskTimer:
    """Seconds the engine spends on structured outputs' masks: the core's calls into each request's
    constraint (the allowed-token bitmask, advancing with the token drawn) and the sampler's masking."""

    def __init__(self) -> None:
        import orca.worker
        from orca.frontend.grammar import GrammarConstraint

        self.seconds = 0.0
        self._patched = [(GrammarConstraint, "allowed_tokens"), (GrammarConstraint, "accept"),
                         (orca.worker.worker, "apply_allowed_tokens")]
        self._originals = [getattr(owner, name) for owner, name in self._patched]
        for (owner, name), original in zip(self._patched, self._originals):
            setattr(owner, name, self._timed(original))

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def close(self) -> None:
        for (owner, name), original in zip(self._patched, self._originals):
            setattr(owner, name, original)


def engine_overhead(model: str | None, batch: int, items: int, repeats: int) -> dict[str, Any]:
    """Generated tokens/s, constrained against unconstrained (runs alternating), at batch 1 and `batch`,
    and the share of the constrained runs' time spent on the masks."""
    from orca import LLM, SamplingParams

    llm = LLM(model, max_bs=max(batch, 1))
    schema = {"type": "array", "minItems": items, "maxItems": items,
              "items": {"type": "string", "minLength": 3, "maxLength": 8}}
    prompts = [f"List {items} English words, as a JSON array (request {i}):" for i in range(batch)]
    result: dict[str, Any] = {"schema": schema}
    timer = _MaskTimer()
    try:
        for b in (1, batch):
            runs: dict[str, list[float]] = {"constrained": [], "unconstrained": [], "mask_share": []}
            lengths: list[int] = []
            for r in range(repeats + 1):  # the first is a warm-up (compile, caches)
                constrained = [SamplingParams(max_tokens=512, temperature=0.8, seed=100 * r + i,
                                              structured_outputs={"json": schema}) for i in range(b)]
                timer.seconds = 0.0
                t0 = time.perf_counter()
                outs = llm.generate(prompts[:b], constrained)
                seconds = time.perf_counter() - t0
                mask_seconds = timer.seconds
                lengths = [len(o.token_ids) for o in outs]
                plain = [SamplingParams(max_tokens=n, temperature=0.8, seed=100 * r + i, ignore_eos=True)
                         for i, n in enumerate(lengths)]
                t1 = time.perf_counter()
                llm.generate(prompts[:b], plain)
                plain_seconds = time.perf_counter() - t1
                if r:
                    runs["constrained"].append(sum(lengths) / seconds)
                    runs["unconstrained"].append(sum(lengths) / plain_seconds)
                    runs["mask_share"].append(mask_seconds / seconds)
            c, u = statistics.median(runs["constrained"]), statistics.median(runs["unconstrained"])
            share = statistics.median(runs["mask_share"])
            result[f"batch_{b}"] = {"constrained_tok_s": c, "unconstrained_tok_s": u, "ratio": c / u,
                                    "mask_share_of_time": share, "tokens_per_request": statistics.mean(lengths),
                                    "runs": runs}
            print(f"engine batch {b}: constrained {c:.1f} tok/s, unconstrained {u:.1f} tok/s: {c / u:.3f}x; masks "
                  f"{100 * share:.1f}% of the constrained time ({statistics.mean(lengths):.0f} tokens per "
                  f"request, medians of {repeats})")
    finally:
        timer.close()
        llm.engine.shutdown()
    return result


def cmd_structured(args: argparse.Namespace) -> int:
    from orca.checkpoint import load_tokenizer, read_model_config, resolve_checkpoint

    checkpoint = resolve_checkpoint(args.model)
    tokenizer = load_tokenizer(checkpoint)
    if tokenizer is None:
        raise ValueError(f"{checkpoint} has no tokenizer: structured outputs need one")
    config = read_model_config(checkpoint)[0]
    stop_ids = sorted(set(config.eos_token_ids) | ({tokenizer.eos_token_id} - {None}))
    result: dict[str, Any] = {"command": "structured", "machine": machine_info(),
                              "model": str(args.model or "default (SmolLM2 GGUF)"), "batch": args.batch}
    if not args.skip_engines:
        result["engines"] = engines(tokenizer, config.vocab_size, stop_ids, args.batch)
        for name, data in result["engines"].items():
            if isinstance(data, str):
                print(f"{name}: {data}")
                continue
            print(f"{name}: tokenizer set-up {data['tokenizer_setup_s']:.2f} s")
            for schema, r in data["schemas"].items():
                compile_ms = (f"compile {r['compile_first_ms']:.1f} ms, again {r['compile_again_ms']:.2f} ms"
                              if "compile_first_ms" in r else f"matcher {r['matcher_first_ms']:.1f} ms")
                print(f"  {schema:10s} {compile_ms}; mask per step {r['mask_ms_per_step_batch_1']:.3f} ms at batch 1, "
                      f"{r[f'mask_ms_per_step_batch_{args.batch}']:.3f} ms at batch {args.batch}")
    if not args.skip_engine:
        result["engine"] = engine_overhead(args.model, args.batch, args.items, args.repeats)
    if args.json:
        write_json(args.json, result)
    return 0


def add_parser(sub: Any) -> None:
    sp = sub.add_parser("structured", help="structured outputs: grammar engines' compile and mask times, the "
                        "engine's constrained against unconstrained tokens/s",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    sp.add_argument("--batch", type=positive_int, default=32, help="the busy batch size (default: %(default)s)")
    sp.add_argument("--items", type=positive_int, default=12,
                    help="strings in the engine part's JSON array: its output length (default: %(default)s)")
    sp.add_argument("--repeats", type=positive_int, default=5, help="timed runs per case (default: %(default)s)")
    sp.add_argument("--skip-engines", action="store_true", help="skip the grammar engines' part")
    sp.add_argument("--skip-engine", action="store_true", help="skip the engine's tokens/s part")
    sp.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    sp.set_defaults(func=cmd_structured)
