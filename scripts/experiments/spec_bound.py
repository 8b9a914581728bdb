"""How far n-gram speculation can take a single stream on `orca-bench speculative`'s repetitive workload,
whatever a verification costs: the model's greedy outputs (speculation off, generated here once) replayed
through the engine's own proposer (orca.core.speculative.NgramProposer: lookup, adaptive length, pauses),
each step keeping the proposals up to the first that differs from the output and one token more, as a
verifying iteration does (greedy: speculation changes no token). Printed, over --prompts prompts:

- the steps each proposal length took, tokens a verification, acceptance;
- the single-stream speedup if a step of r rows costs --row-costs (a step of one row = 1; by default the
  shipped int4 model's steps on the 2-core AVX512-BF16 host, 2026-11-27, --measure-row-costs: 5.26 / 6.32
  / 7.08 / 7.63 / 11.27 / 14.21 ms at 1-6 rows, ~15 at 7-9; from 5 rows torch's int4 kernel makes a
  second pass over the weights) and if verification were free (every
  step costs one row): the ceiling no faster verification can pass;
- the share of output tokens whose 3-gram (with the two before) occurs in the prompt: what lookup could
  copy at all.

--measure-row-costs: instead, the step times by rows of an engine speculating (n-gram, k=8) over the
workload's first prompts alone, twice each (medians, ms; the first run's steps not kept): the --row-costs
of this host.

Not a test, not a benchmark of record: docs/BENCHMARKS.md quotes its output with the command.

    PYTHONPATH=.:client .venv/bin/python scripts/experiments/spec_bound.py [--k 3,4,8] [--prompt-lookup-min 1]
    PYTHONPATH=.:client .venv/bin/python scripts/experiments/spec_bound.py --measure-row-costs
"""

from __future__ import annotations

import argparse
import statistics
import time

from orca import EngineConfig, LLMEngine, SamplingParams
from orca.checkpoint import resolve_checkpoint
from orca.core.request import Request
from orca.core.speculative import NgramProposer
from orca.frontend.tokenizer import Tokenizer

DEFAULT_ROW_COSTS = "1,1.2,1.35,1.45,2.14,2.7,2.79,2.82,2.87"


def greedy_outputs(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(block_size=16))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    final: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.token_ids)
    return [final[f"r{i}"] for i in range(len(prompts))]


def measure_row_costs(prompts: list[list[int]], max_tokens: int) -> None:
    engine = LLMEngine(EngineConfig(block_size=16, speculative_method="ngram", num_speculative_tokens=8))
    times: dict[int, list[float]] = {}
    for round_ in range(2):
        for prompt in prompts:
            engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            engine.step()  # the prompt
            while engine.has_unfinished():
                t0 = time.perf_counter()
                engine.step()
                if round_:
                    times.setdefault(engine.last_iteration.num_tokens, []).append(time.perf_counter() - t0)
    one = statistics.median(times[1])
    for rows, values in sorted(times.items()):
        ms = statistics.median(values)
        print(f"{rows} rows: {1e3 * ms:.2f} ms ({ms / one:.2f}x one row), {len(values)} steps")


def replay(prompt: list[int], output: list[int], k: int, n_min: int, n_max: int) -> list[tuple[int, int]]:
    """(proposed, accepted) of every decode step after the prompt's, the engine's proposer deciding."""
    proposer = NgramProposer(k, n_min, n_max)
    req = Request("r", list(prompt), SamplingParams(temperature=0, max_tokens=len(output), ignore_eos=True), 0, 0)
    req.output_token_ids.append(output[0])  # the prompt's iteration draws the first token
    steps = []
    while len(req.output_token_ids) < len(output):
        proposal = proposer.propose(req)
        t = len(req.output_token_ids)
        accepted = 0
        while accepted < len(proposal) and proposal[accepted] == output[t + accepted]:
            accepted += 1
        if proposal:
            proposer.verified(req, len(proposal), accepted)
        req.output_token_ids.extend(output[t:t + accepted + 1])
        steps.append((len(proposal), accepted))
    return steps


def copyable(prompt: list[int], output: list[int]) -> int:
    grams = {tuple(prompt[j:j + 3]) for j in range(len(prompt) - 2)}
    seq = prompt + output
    return sum(tuple(seq[t - 2:t + 1]) in grams for t in range(len(prompt), len(seq)))


def main() -> None:
    from orca_client.bench.speculative import Prompter, repetitive_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", default="3,4,8", help="num_speculative_tokens values (default: %(default)s)")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--measure-row-costs", action="store_true", help="measure this host's step times by rows")
    p.add_argument("--row-costs", default=DEFAULT_ROW_COSTS,
                   help="a step's cost at 1, 2, ... rows, relative (default: %(default)s)")
    args = p.parse_args()
    costs = [float(c) for c in args.row_costs.split(",")]
    prompts = repetitive_prompts(Prompter(Tokenizer.load(resolve_checkpoint(None)), 49152), args.prompts, (100, 250))
    if args.measure_row_costs:
        return measure_row_costs(prompts[:4], args.max_tokens)
    outputs = greedy_outputs(prompts, args.max_tokens)
    share = sum(copyable(p_, o) for p_, o in zip(prompts, outputs)) / sum(map(len, outputs))
    print(f"{len(prompts)} prompts, {args.max_tokens} greedy tokens each; output tokens whose 3-gram is in the "
          f"prompt: {100 * share:.1f}%")
    for k in (int(x) for x in args.k.split(",")):
        if k + 1 > len(costs):
            raise SystemExit(f"--row-costs gives {len(costs)} row counts; k={k} needs {k + 1}")
        rows: dict[int, int] = {}
        proposed = accepted = verifications = tokens = 0
        timed, free, per_prompt = 0.0, 0, []
        for prompt, output in zip(prompts, outputs):
            steps = replay(prompt, output, k, args.prompt_lookup_min, args.prompt_lookup_max)
            cost = sum(costs[n] for n, _ in steps)
            per_prompt.append((len(output) - 1) / cost)
            timed += cost
            free += len(steps)
            tokens += len(output) - 1
            for n, a in steps:
                rows[n + 1] = rows.get(n + 1, 0) + 1
                if n:
                    proposed, accepted, verifications = proposed + n, accepted + a, verifications + 1
        print(f"k={k}: steps by rows {dict(sorted(rows.items()))}; accepted {accepted}/{proposed} "
              f"({100 * accepted / max(proposed, 1):.0f}%), {(accepted + verifications) / max(verifications, 1):.2f} "
              f"tokens a verification; speedup at --row-costs {tokens / timed:.3f}x (median prompt "
              f"{statistics.median(per_prompt):.2f}x), verification free {tokens / free:.3f}x")


if __name__ == "__main__":
    main()
