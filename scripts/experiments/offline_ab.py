"""The offline workload of `orca-bench offline` in miniature (32 requests, prompts U(32, 128) tokens, new
tokens U(1, 64), greedy, EOS ignored) through orca.LLM, one warm-up first; prints tokens/s. Run it under a
whole-process timer against another checkout (PYTHONPATH=that checkout:that checkout/client) to compare two
engines on the same host: `python scripts/experiments/offline_ab.py off` (torch_compile off: no 45 s
compile per run) or `auto`. A second argument, on or off, sets enable_prefix_caching (default on, the
engine's default; the prompts are random, so a 0% hit rate: the warm-up's prompts are other ones), a third
n_slots (e.g. 2048: a pool the workload cycles through, so that new blocks come from evicting cached ones)."""

import random
import sys
import time

from orca import LLM, SamplingParams

rng = random.Random(0)
prompts = [[rng.randrange(100, 10000) for _ in range(rng.randint(32, 128))] for _ in range(32)]
params = [SamplingParams(max_tokens=rng.randint(1, 64), temperature=0, ignore_eos=True) for _ in range(32)]
warm_up = [[rng.randrange(100, 10000) for _ in range(len(p))] for p in prompts[:4]]
options = {"enable_prefix_caching": (sys.argv[2] if len(sys.argv) > 2 else "on") == "on"}
if len(sys.argv) > 3:
    options["n_slots"] = int(sys.argv[3])
llm = LLM(torch_compile=sys.argv[1], **options)
llm.generate(warm_up, params[:4])
t = time.perf_counter()
outs = llm.generate(prompts, params)
dt = time.perf_counter() - t
n = sum(len(o.token_ids) for o in outs)
print(f"{n} tokens {dt:.2f} s {n/dt:.1f} tok/s", flush=True)
