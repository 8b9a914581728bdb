"""The worker: one device's share of the engine, which carries out the driver's StepPlans.

Its modules, by concern (this file only re-exports):

- worker.py: class Worker, its construction and the iteration (prepare the flat inputs and the attention
  metadata, run the model, sample, keep the draws that match proposals, LoRA slot loads);
- resolution.py: every choice of the load (dtype, linear and attention backends, CUDA graphs, the
  compiled forward pass, the K/V dtype, quantization) and its reason, resolved for the device before the
  weights load, with the device's refusals; its rules render into docs/OPTIONS.md;
- memory.py: the K/V pool's size (n_slots, kv_cache_bytes, or a GPU profiling iteration) and allocation;
- runners.py: how an iteration's forward pass runs, chosen at load: eager (here), CUDA graphs
  (cuda_graphs.py) or the CPU graphs (cpu_graphs/);
- warmup.py: the load-time warm-up (flex's kernels, the runner's graphs); warmup_plans.py its iterations;
- draft.py: the draft model of speculative_method draft, its K/V pool and its drafting;
- pipeline.py: the activations a pipeline stage receives from the previous one and sends to the next;
- kv_cache.py, sampler.py: the pool's layout, sampling; __main__.py: ``python -m orca.worker``, a
  distributed engine's remote ranks.
"""

from orca.worker.draft import DraftModel
from orca.worker.memory import PROFILE_TOKENS_WITHOUT_BUDGET, release_cached_memory
from orca.worker.resolution import why_not_flex_by_default
from orca.worker.warmup_plans import (
    PROMPT_AND_INCREMENT_SLOTS,
    VERIFICATION_ROWS,
    few_warm_up_plans,
    flex_warm_up_plans,
    prompt_and_increment_plans,
    verification_plan,
    warm_up_plans,
)
from orca.worker.worker import Worker

__all__ = [
    "PROFILE_TOKENS_WITHOUT_BUDGET",
    "PROMPT_AND_INCREMENT_SLOTS",
    "VERIFICATION_ROWS",
    "DraftModel",
    "Worker",
    "few_warm_up_plans",
    "flex_warm_up_plans",
    "prompt_and_increment_plans",
    "release_cached_memory",
    "verification_plan",
    "warm_up_plans",
    "why_not_flex_by_default",
]
