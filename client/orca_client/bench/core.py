"""``orca-bench core``: the scheduler thread's own cost per iteration, the model excluded. The engine runs
over a stub executor that answers each plan at once (a token per sampled request, taken
in turn from real English text tokenized with the model's tokenizer, with its log-probabilities and the
top --logprobs alternatives), so what is timed is the host-side work around the model: scheduling,
planning, completing the iteration, and building each request's output. B requests (--batch) are brought
to a history of H generated tokens (--history), and then --steps decode iterations are timed, for every
(B, H). Per iteration it reports the median of:
- ``core_ms``: what the scheduler thread does (EngineCore.step: schedule, plan, stop rules, deltas);
- ``output_ms``: what the output side does with those deltas (OutputProcessor.process: detokenizing,
  stop strings, logprob entries, RequestOutput): on the Triton model's response thread, not the
  scheduler's;
- ``stub_ms``: the stub executor's own time (subtracted from core_ms).
Engines before the token-only core did both on the scheduler thread: there core_ms is LLMEngine.step and
output_ms is 0.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any

from orca_client.bench.common import machine_info, write_json
from orca_client.bench.options import doc_description, nonnegative_int, positive_int

DEFAULT_BATCHES = (32, 256)
DEFAULT_HISTORIES = (0, 1000)


class StubExecutor:
    """Answers each plan at once: no model, no tensors. Tokens come from `text_ids` in turn (so the
    detokenizer sees real text); each sampled token gets its log-probability, rank 1 and `top_n`
    alternatives."""

    max_in_flight = 1

    def __init__(self, num_blocks: int, text_ids: list[int], top_n: int, seed: int = 0) -> None:
        from orca.core.plan import StepResult, TokenLogprobs

        self._result, self._logprobs = StepResult, TokenLogprobs
        self.num_blocks = num_blocks
        self._text = text_ids
        self._top_n = top_n
        self._rng = random.Random(seed)
        self._next: dict[str, int] = {}
        self._results: list[Any] = []
        self.seconds = 0.0  # time spent in submit, summed

    def submit(self, plan: Any) -> None:
        start = time.perf_counter()
        result = self._result(plan.batch_id)
        for p in plan.requests:
            if p.sample_step is None:
                continue
            i = self._next.get(p.request_id, self._rng.randrange(len(self._text)))
            token = self._text[i % len(self._text)]
            self._next[p.request_id] = i + 1
            result.sampled[p.request_id] = [token]
            top = tuple(self._text[(i + k) % len(self._text)] for k in range(1, self._top_n + 1))
            result.logprobs[p.request_id] = [self._logprobs(
                token, -0.5, 1, top, tuple(-1.0 - k for k in range(self._top_n))
            )]
        for rid in plan.free_request_ids:
            self._next.pop(rid, None)
        self._results.append(result)
        self.seconds += time.perf_counter() - start

    def collect(self) -> Any:
        return self._results.pop(0)

    def shutdown(self) -> None:
        self._results.clear()


def english_token_ids(tokenizer: Any, limit: int = 50_000) -> list[int]:
    """Real English text (Python's own documentation, pydoc_data.topics) as the model's tokens."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))[: limit * 5]
    return list(tokenizer.encode(text, add_special_tokens=False))[:limit]


def measure(model: str | None, batch: int, history: int, steps: int, top_n: int, block_size: int = 16) -> dict:
    """One (batch, history) point: fresh engine over the stub executor, B requests brought to `history`
    generated tokens, then `steps` timed decode iterations."""
    from orca import EngineConfig, LLMEngine, SamplingParams
    from orca.checkpoint import load_tokenizer, read_model_config, resolve_checkpoint

    checkpoint = resolve_checkpoint(model)
    tokenizer = load_tokenizer(checkpoint)
    if tokenizer is not None:
        text_ids = english_token_ids(tokenizer)
    else:  # a checkpoint without a tokenizer (the tests' tiny models): its ids in turn, no text
        text_ids = list(range(min(read_model_config(checkpoint)[0].vocab_size, 4096)))
    prompt_len = 16
    per_request = prompt_len + history + steps + 2
    num_blocks = batch * (-(-per_request // block_size)) + 1
    stub = StubExecutor(num_blocks, text_ids, top_n)
    config = EngineConfig(model=model, max_bs=batch, block_size=block_size, max_queue=batch)
    engine = LLMEngine(config, executor=stub)
    core = getattr(engine, "core", None)  # the token-only core and its output processor (engine core v3)
    params = SamplingParams(max_tokens=history + steps + 1, temperature=0, ignore_eos=True, logprobs=top_n)
    for i in range(batch):
        engine.add_request(f"r{i}", text_ids[i * prompt_len:(i + 1) * prompt_len], params)
    while True:  # the prompts, then decode up to the history
        outs = engine.step()
        if outs and all(len(o.token_ids) >= history for o in outs) and len(outs) == batch:
            break
    core_ms, output_ms, stub_ms = [], [], []
    for _ in range(steps):
        before = stub.seconds
        if core is None:
            start = time.perf_counter()
            outs = engine.step()
            core_s, output_s = time.perf_counter() - start, 0.0
        else:
            start = time.perf_counter()
            deltas = core.step()
            mid = time.perf_counter()
            outs = engine.output_processor.process(deltas).outputs
            core_s, output_s = mid - start, time.perf_counter() - mid
        assert len(outs) == batch
        s = stub.seconds - before
        core_ms.append((core_s - s) * 1e3)
        output_ms.append(output_s * 1e3)
        stub_ms.append(s * 1e3)
    engine.shutdown()
    return {
        "batch": batch, "history": history, "steps": steps, "logprobs": top_n,
        "core_ms": statistics.median(core_ms), "output_ms": statistics.median(output_ms),
        "stub_ms": statistics.median(stub_ms),
        "engine": "token-only core + OutputProcessor" if core is not None else "LLMEngine.step (one thread)",
    }


def cmd_core(args: argparse.Namespace) -> int:
    points = [measure(args.model, b, h, args.steps, args.logprobs) for b in args.batch for h in args.history]
    result = {"command": "core", "machine": machine_info(), "points": points}
    print_result(result)
    if args.json:
        write_json(args.json, result)
    return 0


def print_result(result: dict) -> None:
    print(f"{'batch':>6} {'history':>8} {'core ms':>9} {'output ms':>10} {'stub ms':>8}  engine")
    for p in result["points"]:
        print(f"{p['batch']:>6} {p['history']:>8} {p['core_ms']:>9.3f} {p['output_ms']:>10.3f} "
              f"{p['stub_ms']:>8.3f}  {p['engine']}")


def add_parser(sub: Any) -> None:
    c = sub.add_parser("core", help="the scheduler thread's own cost per iteration, the model excluded (a stub "
                       "executor), at batch sizes and history lengths", description=doc_description(__doc__))
    c.add_argument("--model", default=None, help="checkpoint whose config and tokenizer to use (default: "
                   "SmolLM2-135M-Instruct; its weights are never loaded)")
    c.add_argument("--batch", type=int_list, default=list(DEFAULT_BATCHES),
                   help="requests per iteration, comma-separated (default: 32,256)")
    c.add_argument("--history", type=int_list, default=list(DEFAULT_HISTORIES),
                   help="generated tokens each request has before the timed iterations, comma-separated "
                   "(default: 0,1000)")
    c.add_argument("--steps", type=positive_int, default=30, help="timed iterations per point (default: %(default)s)")
    c.add_argument("--logprobs", type=nonnegative_int, default=5,
                   help="top alternatives per token, as SamplingParams.logprobs (default: %(default)s)")
    c.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    c.set_defaults(func=cmd_core)


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {text!r}")
    return values


if __name__ == "__main__":  # without tritonclient (the GPU machine): python -m orca_client.bench.core
    from orca_client.bench import main

    sys.exit(main(only="core"))
