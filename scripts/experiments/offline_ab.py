"""The offline workload of `orca-bench offline` in miniature (32 requests, prompts U(32, 128) tokens, new
tokens U(1, 64), greedy, EOS ignored) through orca.LLM, one warm-up first; prints tokens/s. Run it under a
whole-process timer against another checkout (PYTHONPATH=that checkout:that checkout/client) to compare two
engines on the same host: `python scripts/experiments/offline_ab.py off` (torch_compile off: no 45 s
compile per run) or `auto`."""

import random
import sys
import time

from orca import LLM, SamplingParams

rng = random.Random(0)
prompts = [[rng.randrange(100, 10000) for _ in range(rng.randint(32, 128))] for _ in range(32)]
params = [SamplingParams(max_tokens=rng.randint(1, 64), temperature=0, ignore_eos=True) for _ in range(32)]
llm = LLM(torch_compile=sys.argv[1])
llm.generate(prompts[:4], params[:4])  # warm-up
t = time.perf_counter()
outs = llm.generate(prompts, params)
dt = time.perf_counter() - t
n = sum(len(o.token_ids) for o in outs)
print(f"{n} tokens {dt:.2f} s {n/dt:.1f} tok/s", flush=True)
