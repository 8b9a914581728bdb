"""``orca-bench offline``: the same requests through orca's engine (stepped as orca.LLM.generate steps it)
and through transformers' continuous batching on the same weights, in one process, in turn: tokens/s,
model FLOPs utilisation against a matmul peak measured in the same run, whether the greedy tokens are
identical, the K/V pool's use (utilization = used tokens / slots of allocated blocks, averaged over
iterations weighted by their duration; mean and peak allocated blocks; preemptions), and where an
iteration spends its time (a second run with the engine's profiling hook, engine.profile). Engine
options: --kv-admission (reserve, on_demand, or both: one engine per policy on the same requests, side
by side), --block-size, --max-num-batched-tokens, --n-slots, --max-bs, --dtype, --linear-backend,
--attention-backend, --cuda-graphs, --torch-compile, --prefix-caching (on or off: random prompts share no
prefix, so the two time what the cache costs at a 0% hit rate). Every
system also gets the single-stream figure: one request alone (a 64-token prompt, 128 new tokens, after a
warm-up), decode tokens/s = 127 / (its time - the time of the same prompt with 1 new token), medians of 3. --peers
vllm,llama_cpp runs CPU peer systems on the same requests (greedy, EOS ignored), each in the venv its
setup script makes (scripts/peers/, docs/PEERS.md), in a subprocess: vLLM's CPU backend on orca's
checkpoint, llama.cpp on GGUFs converted from it (NAME:VARIANT picks vLLM's dtype or llama.cpp's GGUF:
f32, bf16, q8_0, shipped); their tokens/s, orca's ratio to each, single-stream decode tokens/s and the
requests whose greedy tokens equal orca's.

This module: orca's engine stepped as orca.LLM.generate steps it (drive), the K/V pool's use (KVUsage),
the iteration breakdown, transformers' run, the peers' runs (orca_client.peers), the FLOP count
(model_shape, workload_flops), the matmul peak, and the tables.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from orca_client.bench.common import cb_generate, cb_page_size, machine_info, write_json
from orca_client.bench.options import (
    add_workload_options,
    doc_description,
    nonnegative_int,
    positive_float,
    positive_int,
    trace_spec,
)
from orca_client.trace import TraceSpec, make_trace

KV_ADMISSION_CHOICES = ("reserve", "on_demand", "both")
BREAKDOWN_PHASES = ("attention", "batched_ops", "sampling", "prepare", "scheduling")


def offline_policies(choice: str) -> tuple[str, ...]:
    """The K/V admission policies one offline run compares, in run order; the last is the primary one
    (result["orca"], compared with transformers): on_demand, the engine's default, when both run."""
    return ("reserve", "on_demand") if choice == "both" else (choice,)


def cmd_offline(args: argparse.Namespace) -> int:
    import torch

    from orca.checkpoint import read_model_config, resolve_checkpoint

    spec = trace_spec(args, "offline")
    checkpoint = resolve_checkpoint(args.model)
    # The single stream must fit the model's positions and, when --n-slots is given, the K/V pool.
    context = min(read_model_config(checkpoint)[0].max_position_embeddings, args.n_slots or 1 << 62)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    high = min(spec.token_ids[1], vocab)
    spec = spec.with_options(token_ids=(min(spec.token_ids[0], high - 1), high))
    trace = make_trace(spec, None)
    prompts = [list(r.prompt_token_ids) for r in trace]
    max_new = [r.max_new_tokens for r in trace]
    policies = offline_policies(args.kv_admission)
    single = single_stream_workload(spec, context)
    peers = check_peers(args.peers)
    result: dict[str, Any] = {
        "benchmark": "offline", "machine": machine_info(), "command": sys.argv, "checkpoint": str(checkpoint),
        "trace": asdict(spec), "torch_threads": torch.get_num_threads(), "kv_admission": list(policies),
        "orca_policies": {},
    }
    tokens = {policy: run_orca_offline(args, policy, prompts, max_new, result, single) for policy in policies}
    primary = policies[-1]
    result["orca"] = result["orca_policies"][primary]
    if len(policies) > 1:  # recomputation after a preemption must not change a greedy continuation
        result["same_tokens_across_policies"] = sum(
            all(tokens[p][i] == tokens[primary][i] for p in policies) for i in range(len(prompts))
        )
    if not args.skip_transformers:
        hf_tokens = run_transformers_offline(checkpoint, prompts, max_new, result["orca"]["n_slots"], result)
        result["transformers"]["same_tokens_as_orca"] = _same(hf_tokens, tokens[primary])
        for policy in policies:
            result["orca_policies"][policy]["same_tokens_as_transformers"] = _same(hf_tokens, tokens[policy])
    # In the same process, right after the runs: the peak of the machine the runs just had.
    result["peak_flops"] = measure_matmul_peak(result["dtype"], result["device"], args.peak_seconds)
    runs = [*result["orca_policies"].values(), *([result["transformers"]] if "transformers" in result else [])]
    for run in runs:
        run["mfu"] = run["model_flops"] / run["seconds"] / result["peak_flops"]
    if "transformers" in result:
        hf_tps = result["transformers"]["tokens_per_second"]
        for run in result["orca_policies"].values():
            run["ratio_to_transformers"] = run["tokens_per_second"] / hf_tps
        result["ratio"] = result["orca"]["ratio_to_transformers"]
    if peers:
        run_peers_offline(args, peers, checkpoint, prompts, max_new, tokens[primary], single, result)
    print_offline(result)
    if args.json:
        write_json(args.json, result)
    return 0


def _same(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> int:
    """Requests whose token lists are identical."""
    return sum(list(x) == list(y) for x, y in zip(a, b))


def run_orca_offline(
    args: argparse.Namespace, policy: str, prompts: list[list[int]], max_new: list[int], result: dict[str, Any],
    single: dict[str, Any],
) -> list[list[int]]:
    """One K/V admission policy on a fresh engine: warm-up, the timed run (tokens/s and the K/V pool's use,
    from engine.last_iteration after every iteration), then the profiled run (iteration_breakdown), then
    the single-stream figure (orca_client.peers.runner_common.single_stream, as every peer measures it).
    Stores the record in result["orca_policies"][policy]; returns each request's tokens."""
    import torch

    from orca import EngineConfig, LLMEngine, SamplingParams
    from orca_client.peers.runner_common import single_stream

    engine = LLMEngine(EngineConfig(
        model=args.model, max_bs=args.max_bs, dtype=args.dtype, kv_admission=policy, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens or None, n_slots=args.n_slots,
        linear_backend=args.linear_backend, attention_backend=args.attention_backend, cuda_graphs=args.cuda_graphs,
        torch_compile=args.torch_compile, enable_prefix_caching=args.prefix_caching == "on",
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
    ))
    try:
        result["dtype"] = str(engine.config.torch_dtype).removeprefix("torch.")
        result["device"] = str(engine.config.torch_device)
        result["enable_prefix_caching"] = engine.config.enable_prefix_caching
        result["effective_prefix_caching"] = engine.config.enable_prefix_caching
        result["quantization"], result["kv_cache_dtype"] = engine.config.quantization, engine.config.kv_cache_dtype
        # What auto resolved to (the in-process worker's; the offline engine always has one).
        worker = getattr(engine.executor, "worker", None)
        result["linear_backend"] = getattr(worker, "linear_backend", None)
        result["attention_backend"] = getattr(worker, "attention_backend", None)
        graphs = getattr(worker, "decode_graphs", None)
        result["cuda_graph_sizes"] = list(graphs.sizes) if graphs is not None and graphs.captured else None
        compiled = getattr(worker, "compiled", None)
        result["compiled_forward_seconds"] = compiled.compile_seconds if compiled is not None else None
        result["model"] = model_shape(engine.model_config)
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_new]
        warm = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        drive(engine, prompts[:2], [warm] * len(prompts[:2]), "warmup")
        kv = KVUsage(engine.block_size)
        preemptions = engine.stats().preemptions
        start = time.perf_counter()
        tokens = drive(engine, prompts, params, "bench", lambda it, _: kv.add(it))
        seconds = time.perf_counter() - start
        stats = engine.stats()
        result["orca_policies"][policy] = {
            **run_record(result["model"], prompts, tokens, seconds),
            "kv_admission": policy,
            "max_bs": engine.config.max_bs,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "n_slots": engine.n_slots,
            "iterations": kv.iterations,
            "mean_batch_size": kv.mean_batch_size,
            "kv": {
                **kv.summary(),
                "total_blocks": stats.kv_total_blocks,
                "block_size": engine.block_size,
                "preemptions": stats.preemptions - preemptions,
            },
            "breakdown": iteration_breakdown(engine, prompts, params),
        }
        runs = itertools.count()

        def one(prompt: list[int], n: int, engine: Any = engine) -> list[int]:
            sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            return drive(engine, [prompt], [sp], f"single-{next(runs)}")[0]

        result["orca_policies"][policy]["single_stream"] = single_stream(one, single)
    finally:
        engine.shutdown()
    del engine
    _free_memory(torch)
    return tokens


def drive(
    engine: Any,
    prompts: Sequence[Sequence[int]],
    params: Sequence[Any],
    tag: str,
    on_iteration: Callable[[Any, float], None] | None = None,
) -> list[list[int]]:
    """Runs the requests to completion on an LLMEngine the way orca.LLM.generate does (each request added
    as soon as the waiting queue takes it, then step() until none is left), calling
    ``on_iteration(engine.last_iteration, seconds of that step() call)`` after every step that completed an
    iteration. Returns each request's generated tokens, in input order."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    index = {request_id: i for i, request_id in enumerate(ids)}
    tokens: list[list[int]] = [[] for _ in ids]
    pending = list(range(len(ids)))[::-1]  # a stack: the next request on top
    while pending or engine.has_unfinished():
        while pending and engine.stats().waiting < engine.config.max_queue:
            i = pending.pop()
            engine.add_request(ids[i], list(prompts[i]), params[i])
        before = engine.last_iteration
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        for out in outputs:
            if out.finished:
                if out.error:
                    raise RuntimeError(f"generation failed: {out.error}")
                tokens[index[out.request_id]] = list(out.token_ids)
        if on_iteration is not None and engine.last_iteration is not before:
            on_iteration(engine.last_iteration, seconds)
    return tokens


@dataclass
class KVUsage:
    """The K/V pool's use over a run, from each iteration's engine.last_iteration (the moment after the
    iteration, before finished requests free their blocks), every iteration weighted by its duration.
    Utilization = used tokens / slots of the allocated blocks (kv_used_tokens / (kv_allocated_blocks x
    block_size)): what paging leaves unused inside blocks, and what reserve admission holds for tokens not
    generated yet. Iterations with no block allocated are left out."""

    block_size: int
    iterations: int = 0
    batch_sizes: int = 0
    peak_allocated_blocks: int = 0
    _weight: float = 0.0
    _utilization: float = 0.0
    _allocated: float = 0.0

    def add(self, it: Any) -> None:
        self.iterations += 1
        self.batch_sizes += it.batch_size
        self.peak_allocated_blocks = max(self.peak_allocated_blocks, it.kv_allocated_blocks)
        if it.kv_allocated_blocks > 0:
            self._weight += it.duration
            self._utilization += it.duration * it.kv_used_tokens / (it.kv_allocated_blocks * self.block_size)
            self._allocated += it.duration * it.kv_allocated_blocks

    @property
    def mean_batch_size(self) -> float:
        return self.batch_sizes / self.iterations if self.iterations else 0.0

    def summary(self) -> dict[str, Any]:
        w = self._weight
        return {
            "utilization": self._utilization / w if w > 0 else None,
            "mean_allocated_blocks": self._allocated / w if w > 0 else None,
            "peak_allocated_blocks": self.peak_allocated_blocks,
        }


def iteration_breakdown(engine: Any, prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    """Runs the same requests again with the engine's profiling on (engine.profile: each iteration's
    timings, device-synced on a GPU): attention (the per-request split, timed inside selective_attention),
    the batched ops (every other op of the model, logits included), sampling, input preparation, and
    scheduling (the rest of step(): selection, K/V blocks, plan, stop checks, detokenisation, outputs)."""
    totals = dict.fromkeys(BREAKDOWN_PHASES, 0.0)
    counts = {"iterations": 0, "batch": 0, "timed": 0}

    def on_iteration(it: Any, step: float) -> None:
        t = it.timings
        counts["iterations"] += 1
        counts["batch"] += it.batch_size
        if not t:
            return
        counts["timed"] += 1
        totals["attention"] += t.get("attention", 0.0)
        totals["batched_ops"] += t.get("model", 0.0) - t.get("attention", 0.0)
        totals["sampling"] += t.get("sample", 0.0)
        totals["prepare"] += t.get("prepare", 0.0)
        totals["scheduling"] += step - (t.get("prepare", 0.0) + t.get("model", 0.0) + t.get("sample", 0.0))

    engine.profile = True
    try:
        drive(engine, prompts, params, "breakdown", on_iteration)
    finally:
        engine.profile = False
    total = sum(totals.values())
    iterations = counts["iterations"]
    return {
        "seconds": totals,
        "fraction": {k: v / total for k, v in totals.items()} if total > 0 else {},
        "total_seconds": total,
        "iterations": iterations,
        "mean_batch_size": counts["batch"] / iterations if iterations else 0.0,
        "profiled_iterations": counts["timed"],
        "attention_measured": totals["attention"] > 0,
    }


def run_transformers_offline(
    checkpoint: Path, prompts: list[list[int]], max_new: list[int], n_slots: int, result: dict[str, Any]
) -> list[list[int]]:
    """transformers' continuous batching (its paged-attention manager) with a per-request max_new_tokens,
    EOS disabled and greedy decoding, on the same weights and dtype; its cache within orca's K/V pool of
    n_slots tokens. Stores result["transformers"]; returns each request's tokens."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    dtype = getattr(torch, result["dtype"])
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="sdpa")
    model = model.to(result["device"]).eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(max_new), eos_token_id=-1, pad_token_id=0)
    hints = WorkloadHints(max(len(p) for p in prompts), max(max_new), len(prompts))
    # Sized like orca's engine for this workload: room for every request at once (orca admits them all in
    # its first iteration) within orca's K/V budget, and every prompt in one step. The defaults would size
    # the cache, and its attention masks, from the free memory: on a CPU most of the machine's RAM.
    page = cb_page_size(ContinuousBatchingConfig())
    pages = sum(math.ceil((len(p) + n) / page) for p, n in zip(prompts, max_new))
    cb_config = ContinuousBatchingConfig(
        num_blocks=max(1, min(pages, n_slots // page)),
        max_batch_tokens=sum(len(p) for p in prompts),
    )
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb_config, workload_hints=hints, timeout=60
    ) as cb:
        cb_generate(cb, prompts[:2], [2, 2], ["warmup-0", "warmup-1"])  # warm-up, as for orca
        start = time.perf_counter()
        tokens = cb_generate(cb, prompts, max_new, [f"bench-{i}" for i in range(len(prompts))])
        seconds = time.perf_counter() - start
        resolved = cb.continuous_batching_config  # what transformers made of cb_config and the hints
    result["transformers"] = {
        **run_record(result["model"], prompts, tokens, seconds),
        "attn_implementation": model.config._attn_implementation,
        "max_requests_per_batch": getattr(resolved, "max_requests_per_batch", None),
        "max_batch_tokens": getattr(resolved, "max_batch_tokens", None),
        "num_blocks": getattr(resolved, "num_blocks", cb_config.num_blocks),
        "page_size": page,
    }
    del model, cb
    _free_memory(torch)
    return tokens


def single_stream_workload(spec: TraceSpec, context: int) -> dict[str, Any]:
    """The single-stream request every system runs: a 64-token prompt drawn like the trace's (same token
    range, the next seed), 128 new tokens, 3 timed repeats; within a shorter `context` (the model's
    positions), half of it for the prompt and the rest for new tokens."""
    prompt_len = min(64, context // 2)
    new = min(128, context - prompt_len)
    one = spec.with_options(num_requests=1, prompt_len=(prompt_len, prompt_len), max_new_tokens=(new, new),
                            seed=spec.seed + 1)
    return {"prompt": list(make_trace(one, None)[0].prompt_token_ids), "max_tokens": new, "repeats": 3}


def check_peers(text: str | None) -> list[Any]:
    """--peers parsed and the peers' venvs found before anything runs (a clear error naming the setup
    script otherwise). The default variants follow orca's dtype, known once its engine exists:
    run_peers_offline parses again then."""
    if not text:
        return []
    from orca_client.peers import PeerUnavailable, parse_peers, peer_python

    specs = parse_peers(text, "float32")
    for spec in specs:
        try:
            peer_python(spec.name)
        except PeerUnavailable as exc:
            raise ValueError(str(exc)) from None
    return specs


def run_peers_offline(
    args: argparse.Namespace, peers: list[Any], checkpoint: Path, prompts: list[list[int]], max_new: list[int],
    orca_tokens: list[list[int]], single: dict[str, Any], result: dict[str, Any],
) -> None:
    """Each peer (orca_client.peers) on the same requests and the same single-stream request, in its own
    venv, one after the other. Stores result["peers"][NAME:VARIANT]: the peer's record (without its
    tokens), orca's tokens/s over the peer's, model FLOPs and MFU against this run's matmul peak, and the
    requests whose greedy tokens equal orca's. A peer that fails is recorded with its error."""
    from orca.checkpoint import default_model_path
    from orca_client.peers import PeerUnavailable, parse_peers, peer_model, run_peer

    model_arg = Path(args.model).expanduser() if args.model else default_model_path()
    source_gguf = model_arg if model_arg.suffix == ".gguf" else None
    orca = result["orca"]
    result["peers"] = {}
    for spec in parse_peers(args.peers, result["dtype"]):
        print(f"running {spec.label} (its setup: {spec.name}) ...", file=sys.stderr, flush=True)
        try:
            peer = run_peer(spec, peer_model(spec, checkpoint, source_gguf), prompts, max_new,
                            result["torch_threads"], args.max_bs, single, args.peer_timeout)
        except (PeerUnavailable, RuntimeError, OSError, ValueError) as exc:
            print(f"error: {spec.label}: {exc}", file=sys.stderr)
            result["peers"][spec.label] = {"error": str(exc)}
            continue
        tokens = peer.pop("tokens")
        peer_single = peer["single_stream"]
        peer["same_tokens_as_orca"] = _same(tokens, orca_tokens)
        peer["single_stream"]["same_tokens_as_orca"] = peer_single.pop("tokens") == orca["single_stream"]["tokens"]
        peer["model_flops"] = workload_flops(result["model"], prompts, [len(t) for t in tokens])
        peer["mfu"] = peer["model_flops"] / peer["seconds"] / result["peak_flops"]
        peer["ratio_orca_to_peer"] = orca["tokens_per_second"] / peer["tokens_per_second"]
        result["peers"][spec.label] = peer


def model_shape(config: Any) -> dict[str, int]:
    """What the FLOP count needs, from the engine's ModelConfig (engine.model_config): the decoder's linear
    weights (every projection of a layer, biases left out; the LM head is counted apart) and the attention
    and head sizes. Per layer: Q, K, V (K and V with num_kv_heads) and the output projection, then the MLP:
    up and down, plus the gate for the gated (llama) MLP."""
    e, i = config.hidden_size, config.intermediate_size
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    mlp_matrices = 3 if config.architecture == "llama" else 2
    per_layer = e * (q + 2 * kv) + q * e + mlp_matrices * e * i
    return {
        "linear_params": config.num_layers * per_layer,
        "num_layers": config.num_layers,
        "attention_width": q,
        "hidden_size": e,
        "vocab_size": config.vocab_size,
    }


def workload_flops(shape: dict[str, int], prompts: Sequence[Sequence[int]], generated: Sequence[int]) -> float:
    """Model FLOPs of the workload, counted the usual way (2 per multiply-add, nothing recomputed):
    - the decoder's linear layers for each token that goes through them: the prompt and every generated
      token but the last;
    - the LM head (hidden x vocab) once per generated token: logits are needed for the last row only;
    - attention scores and the weighted sum of values: 4 x layers x (heads x head_dim) per causal
      (query, key) pair.
    """
    per_pair = 4 * shape["num_layers"] * shape["attention_width"]
    head = 2 * shape["hidden_size"] * shape["vocab_size"]
    total = 0.0
    for prompt, n in zip(prompts, generated):
        m = len(prompt) + n - 1  # tokens through the layers
        total += 2 * shape["linear_params"] * m + head * n + per_pair * m * (m + 1) / 2
    return total


def run_record(model: dict[str, Any], prompts: list[list[int]], tokens: list[list[int]], seconds: float) -> dict:
    """What every timed offline run reports: time, generated tokens, tokens/s and the model FLOPs done."""
    generated = sum(len(t) for t in tokens)
    return {
        "seconds": seconds,
        "generated_tokens": generated,
        "tokens_per_second": generated / seconds,
        "model_flops": workload_flops(model, prompts, [len(t) for t in tokens]),
    }


def measure_matmul_peak(dtype: str, device: str, seconds: float) -> float:
    """FLOP/s of the best square matmul the device sustains (the usual stand-in for peak)."""
    import torch

    best = 0.0
    for n in (1024, 2048):
        a = torch.randn(n, n, dtype=getattr(torch, dtype), device=device)
        b = torch.randn(n, n, dtype=getattr(torch, dtype), device=device)
        a @ b  # warm-up
        deadline = time.perf_counter() + seconds / 2
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            for _ in range(3):
                a @ b
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            best = max(best, 3 * 2 * n**3 / (time.perf_counter() - start))
    return best


def _free_memory(torch: Any) -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def print_offline(result: dict[str, Any]) -> None:
    policies = result["orca_policies"]
    first = next(iter(policies.values()))
    budget = first["max_num_batched_tokens"]
    print(f"{result['trace']['num_requests']} requests, prompts "
          f"U{tuple(result['trace']['prompt_len'])}, new tokens U{tuple(result['trace']['max_new_tokens'])}, "
          f"{result['dtype']} on {result['device']} ({result['torch_threads']} threads); orca: max_bs "
          f"{first['max_bs']}, {first['kv']['total_blocks']} K/V blocks of {first['kv']['block_size']} tokens, "
          f"{'no token budget' if budget is None else f'{budget} tokens per iteration'}, prefix caching "
          f"{'on' if result.get('effective_prefix_caching') else 'off'}, quantization "
          f"{result.get('quantization')}, kv_cache_dtype {result.get('kv_cache_dtype')}")
    print(f"matmul peak: {result['peak_flops'] / 1e9:.1f} GFLOP/s")
    rows = [(f"orca {p}", r) for p, r in policies.items()]
    if "transformers" in result:
        rows.append(("transformers", result["transformers"]))
    for name, r in rows:
        line = (f"{name:<16} {r['generated_tokens']:>6} tokens in {r['seconds']:7.2f} s = "
                f"{r['tokens_per_second']:8.1f} tok/s, MFU {100 * r['mfu']:5.1f}%")
        if "ratio_to_transformers" in r:
            line += (f", {r['ratio_to_transformers']:.2f}x transformers (identical greedy tokens for "
                     f"{r['same_tokens_as_transformers']}/{result['trace']['num_requests']} requests)")
        print(line)
    print_single_and_peers(result)
    if "same_tokens_across_policies" in result:
        print(f"identical tokens under every policy: {result['same_tokens_across_policies']}/"
              f"{result['trace']['num_requests']} requests")
    print("K/V pool (time-weighted over iterations; utilization = used tokens / slots of allocated blocks):")
    print(f"  {'policy':<10} {'util':>7} {'mean blocks':>11} {'peak blocks':>11} {'preempt':>8} {'iters':>6} "
          f"{'mean batch':>10}")
    for policy, r in policies.items():
        kv = r["kv"]
        util = "-" if kv["utilization"] is None else f"{100 * kv['utilization']:.1f}%"
        mean = "-" if kv["mean_allocated_blocks"] is None else f"{kv['mean_allocated_blocks']:.1f}"
        print(f"  {policy:<10} {util:>7} {mean:>11} {kv['peak_allocated_blocks']:>11} {kv['preemptions']:>8} "
              f"{r['iterations']:>6} {r['mean_batch_size']:>10.1f}")
    print("orca iteration breakdown (a second, profiled run):")
    print(f"  {'':<12}" + "".join(f" {p + ' (' + str(r['breakdown']['iterations']) + ' it)':>24}"
                                  for p, r in policies.items()))
    for k in BREAKDOWN_PHASES:
        cells = [f"{r['breakdown']['seconds'][k]:8.3f} s {100 * r['breakdown']['fraction'].get(k, 0):5.1f}%"
                 for r in policies.values()]
        print(f"  {k:<12}" + "".join(f" {c:>24}" for c in cells))


def print_single_and_peers(result: dict[str, Any]) -> None:
    """Every system's tokens/s, orca's ratio to it, its single-stream figures and its greedy agreement
    with orca."""
    n = result["trace"]["num_requests"]
    ss = result["orca"]["single_stream"]
    print(f"single stream ({ss['prompt_tokens']}-token prompt, {ss['max_tokens']} new tokens, median of "
          f"{ss['repeats']}; decode = the tokens after the first):")
    print(f"  {'system':<18} {'tok/s':>8} {'orca/peer':>9} {'1-stream tok/s':>14} {'decode tok/s':>12} "
          f"{'same tokens':>11} {'load s':>7}")
    rows = [(f"orca {p}", r) for p, r in result["orca_policies"].items()]
    rows += list(result.get("peers", {}).items())
    for name, r in rows:
        if "error" in r:
            print(f"  {name:<18} failed: {r['error']}")
            continue
        s = r["single_stream"]
        decode = "-" if s["decode_tokens_per_second"] is None else f"{s['decode_tokens_per_second']:.1f}"
        ratio = f"{r['ratio_orca_to_peer']:.2f}x" if "ratio_orca_to_peer" in r else ""
        same = (f"{r['same_tokens_as_orca']}/{n}" + ("" if s.get("same_tokens_as_orca") else "*")
                if "same_tokens_as_orca" in r else "")
        load = f"{r['load_seconds']:.0f}" if "load_seconds" in r else ""
        print(f"  {name:<18} {r['tokens_per_second']:>8.1f} {ratio:>9} {s['tokens_per_second']:>14.1f} "
              f"{decode:>12} {same:>11} {load:>7}")
    if result.get("peers"):
        print("  (same tokens: requests whose greedy tokens equal orca's; * the single-stream tokens differ)")


def add_parser(sub: Any) -> None:
    o = sub.add_parser("offline", help="orca's engine against transformers' continuous batching, in this process, "
                       "and optionally CPU peers (vLLM, llama.cpp) in their own venvs",
                       description=doc_description(__doc__))
    o.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    o.add_argument("--max-bs", type=int, default=32, help="orca's max_bs (default: %(default)s)")
    o.add_argument("--dtype", default="auto", help="engine dtype (default: %(default)s)")
    o.add_argument("--linear-backend", default="auto", choices=("auto", "hybrid", "onednn", "reference"),
                   help="EngineConfig.linear_backend (default: %(default)s; hybrid on a CPU where a second copy "
                        "of the weights fits, else onednn)")
    o.add_argument("--attention-backend", default="auto", choices=("auto", "reference", "batched", "flex"),
                   help="EngineConfig.attention_backend (default: %(default)s: batched)")
    o.add_argument("--cuda-graphs", default="auto", choices=("auto", "off"),
                   help="EngineConfig.cuda_graphs: decode iterations from CUDA graphs where they apply (CUDA, "
                        "attention backend flex) (default: %(default)s)")
    o.add_argument("--torch-compile", default="auto", choices=("auto", "off"),
                   help="EngineConfig.torch_compile: the forward pass compiled at load where that applies (a CPU, "
                        "attention backend reference, one worker) (default: %(default)s)")
    o.add_argument("--kv-admission", choices=KV_ADMISSION_CHOICES, default="on_demand",
                   help="orca's K/V admission policy; both: reserve, then on_demand, on the same requests, side "
                        "by side (default: %(default)s)")
    o.add_argument("--block-size", type=positive_int, default=16, help="orca's K/V block size in tokens "
                   "(default: %(default)s)")
    o.add_argument("--max-num-batched-tokens", type=nonnegative_int, default=0, metavar="N",
                   help="orca's token budget per iteration (chunked prefill); 0: no limit (default: %(default)s)")
    o.add_argument("--n-slots", type=positive_int, default=None, metavar="N",
                   help="orca's K/V pool in tokens (whole blocks; also bounds transformers' cache) (default: the "
                        "engine's: 1 GiB of K/V on a CPU, what gpu_memory_utilization leaves on a GPU)")
    o.add_argument("--prefix-caching", choices=("on", "off"), default="on",
                   help="EngineConfig.enable_prefix_caching: this workload's random prompts share no prefix, so "
                        "on against off is what the cache costs at a 0%% hit rate (default: %(default)s, the "
                        "engine's)")
    o.add_argument("--quantization", default="auto", metavar="{auto,none,int8,int4,fp8}",
                   help="EngineConfig.quantization: auto serves the default GGUF's Q4_1 weights as int4 (its Q8_0 "
                        "embedding as an int8 head); none dequantizes them (default: %(default)s, the engine's)")
    o.add_argument("--kv-cache-dtype", default="auto", metavar="{auto,fp8_e4m3,int8}",
                   help="EngineConfig.kv_cache_dtype (default: %(default)s, the engine's)")
    o.add_argument("--skip-transformers", action="store_true", help="no transformers run")
    o.add_argument("--peers", default="", metavar="NAME[:VARIANT],...",
                   help="CPU peer systems run on the same requests, each in the venv its setup script makes "
                        "(docs/PEERS.md): vllm (scripts/peers/setup_vllm_cpu.sh; VARIANT: its dtype, default "
                        "orca's), llama_cpp (scripts/peers/setup_llama_cpp.sh; VARIANT: the GGUF, f32, bf16, "
                        "q8_0 or shipped, default f32, bf16 for a bfloat16 orca); e.g. "
                        "vllm,llama_cpp,llama_cpp:shipped (default: none)")
    o.add_argument("--peer-timeout", type=positive_float, default=1800.0, metavar="SECONDS",
                   help="seconds one peer may take, its start included (default: %(default)s)")
    o.add_argument("--peak-seconds", type=float, default=4.0, help="time spent measuring the matmul peak")
    add_workload_options(o, "offline")
    o.set_defaults(func=cmd_offline)


if __name__ == "__main__":  # without tritonclient (the GPU machine): python -m orca_client.bench.offline
    from orca_client.bench import main

    sys.exit(main(only="offline"))
