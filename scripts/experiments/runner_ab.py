"""Load time and decode tokens/s of the default model (SmolLM2-135M, torch_compile auto: the CPU graphs) in one
process: one stream of 96 tokens, 4 streams of 64, 16 of 48 (64-token random prompts, greedy, EOS ignored),
each after a short warm-up batch; prints one JSON line. Compare two checkouts by running it alternately under
a whole-process timer with PYTHONPATH=<checkout> and one shared TORCHINDUCTOR_CACHE_DIR (each checkout's first
run fills the cache for its own graphs: not counted)."""

import json
import random
import time

t0 = time.perf_counter()
from orca import LLM, SamplingParams  # noqa: E402 - the import is part of the load timed

llm = LLM()
load = time.perf_counter() - t0
rng = random.Random(0)


def tokens_per_second(streams: int, tokens: int) -> float:
    prompts = [[rng.randrange(100, 10000) for _ in range(64)] for _ in range(streams)]
    llm.generate(prompts, [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * streams)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, [params] * streams)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


single, four, sixteen = tokens_per_second(1, 96), tokens_per_second(4, 64), tokens_per_second(16, 48)
print(json.dumps({"load_s": round(load, 1), "single_tok_s": round(single, 2), "four_tok_s": round(four, 2),
                  "sixteen_tok_s": round(sixteen, 2)}), flush=True)
