"""``orca-bench decode``: decode throughput against batch size, the benchmark for a GPU.

B requests, each a random P-token prompt and G new tokens (greedy, EOS ignored), all submitted at once,
for each batch size B of the sweep, through orca's engine in one or more configurations and through
transformers' continuous batching on the same weights, device and dtype. Decode tokens/s = B x (G - 1) /
(median time of the G-token run - median time of the 1-token run): the tokens after each request's first,
over the time they took (the prefill cancels out), measured from outside for every system alike.

Against the bandwidth roofline: a decode iteration must at least read every weight it multiplies (the
layers and the LM head; the embedding only gathers B rows) and each request's keys and values, so at
best it takes (weight bytes + B x context x K/V bytes per token) / bandwidth, with the context at its mean
over the run (P + G / 2) and the bandwidth that of a large device-to-device copy measured in the same run.
Roofline tokens/s = B / that time. The fraction of it each system reaches is the figure to read.

The model is a checkpoint directory (--model) or a random-weight Llama-shaped model built here with
transformers (--shape llama-1b: hidden 2048, 16 layers, 32 query and 8 K/V heads, MLP 8192, vocabulary
32000, 1.1B parameters: what fits a GPU session, where no hub is reachable and the real weights cannot
travel; --shape tiny for a quick check on a CPU).

Orca configurations (--systems): orca-reference (attention_backend reference), orca-batched (batched
increments), orca-flex (flex, CUDA graphs off), orca-flex-graphs (flex with decode iterations replayed
from CUDA graphs); and transformers. The default is all five on CUDA, and orca-reference, orca-batched and
transformers elsewhere (flex is unfused off CUDA).
Runs without tritonclient: ``python -m orca_client.bench.decode`` works where only torch and transformers
are installed (the GPU machine).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from orca_client.bench.common import cb_generate, cb_page_size, machine_info, write_json

SHAPES: dict[str, dict[str, int]] = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=512),
}
ORCA_SYSTEMS: dict[str, dict[str, str]] = {
    "orca-reference": dict(attention_backend="reference", cuda_graphs="off"),
    "orca-batched": dict(attention_backend="batched", cuda_graphs="off"),
    "orca-flex": dict(attention_backend="flex", cuda_graphs="off"),
    "orca-flex-graphs": dict(attention_backend="flex", cuda_graphs="auto"),
}
SYSTEMS = (*ORCA_SYSTEMS, "transformers")
DEFAULT_BATCH_SIZES = "1,2,4,8,16,32,64,128,256"


def build_checkpoint(shape: str, path: Path, dtype: Any, device: Any, seed: int = 0) -> Path:
    """A random-weight LlamaForCausalLM of `shape` (SHAPES), initialised on `device`, saved to `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(path)
    del model
    return path


def build_layer_draft(checkpoint: Path, layers: int, path: Path) -> Path:
    """A self-speculative ("layer skip") draft of a Llama-shaped checkpoint directory, saved to `path`: the
    model (transformers, its stored dtype, on the CPU) with only its first `layers` decoder layers, the same
    embeddings, final norm, head and vocabulary; the checkpoint's tokenizer files copied beside it."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint, path = Path(checkpoint), Path(path)
    total = AutoConfig.from_pretrained(checkpoint).num_hidden_layers
    if not 1 <= layers <= total:
        raise ValueError(f"a draft of {layers} layers: {checkpoint} has {total} decoder layers (1 to {total})")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="auto")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None) is not None:
        model.config.layer_types = list(model.config.layer_types[:layers])
    model.save_pretrained(path)
    for pattern in ("tokenizer*.json", "special_tokens_map.json", "tokenizer.model"):
        for source in sorted(checkpoint.glob(pattern)):
            shutil.copy2(source, path / source.name)
    return path


def copy_bandwidth(device: Any, seconds: float = 1.0) -> float:
    """Bytes/s of a large device-to-device copy (each byte read once and written once: 2 x size moved)."""
    import torch

    nbytes = (1 << 30) if device.type == "cuda" else (1 << 28)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    deadline = time.perf_counter() + seconds
    while len(times) < 3 or time.perf_counter() < deadline:
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_rate(generate: Callable[[int], list[list[int]]], new_tokens: int, repeats: int, batch: int,
                device: Any) -> dict[str, Any]:
    """Decode tokens/s of `generate(n)` (every request of the batch with n new tokens), by differencing
    the n = new_tokens and n = 1 runs (medians of `repeats`); after one warm-up run of each."""
    generate(2)
    full, first, tokens = [], [], []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        tokens = generate(new_tokens)
        _sync(device)
        full.append(time.perf_counter() - start)
        start = time.perf_counter()
        generate(1)
        _sync(device)
        first.append(time.perf_counter() - start)
    if any(len(t) != new_tokens for t in tokens):
        raise RuntimeError(f"asked {new_tokens} new tokens per request, got {sorted({len(t) for t in tokens})}")
    full_s, first_s = statistics.median(full), statistics.median(first)
    return {
        "seconds": full, "first_token_seconds": first,
        "decode_tokens_per_second": batch * (new_tokens - 1) / (full_s - first_s) if full_s > first_s else None,
        "tokens": tokens,
    }


def run_orca(system: str, checkpoint: Path, args: argparse.Namespace, prompts: list[list[int]],
             batches: Sequence[int], device: Any, runs: dict[int, dict[str, Any]],
             progress: Callable[[], None] = lambda: None) -> dict[int, dict[str, Any]]:
    from orca import EngineConfig, LLMEngine

    block = 16
    per_request = -(-(args.prompt_len + args.new_tokens) // block) * block
    engine = LLMEngine(EngineConfig(
        model=str(checkpoint), device=str(device), dtype=args.dtype, max_bs=max(batches), block_size=block,
        n_slots=max(batches) * per_request, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        **ORCA_SYSTEMS[system],
    ))
    worker = getattr(engine.executor, "worker", None)
    graphs = getattr(worker, "decode_graphs", None)
    counter = iter(range(1 << 62))
    try:
        for b in batches:
            def generate(n: int, b: int = b) -> list[list[int]]:
                return _orca_generate(engine, prompts[:b], n, [f"r{next(counter)}" for _ in range(b)])

            runs[b] = decode_rate(generate, args.new_tokens, args.repeats, b, device)
            runs[b]["attention_backend"] = getattr(worker, "attention_backend", None)
            runs[b]["cuda_graph_sizes"] = list(graphs.sizes) if graphs is not None and graphs.captured else None
            print(f"  {system} B={b}: {runs[b]['decode_tokens_per_second'] or 0:.1f} decode tok/s", flush=True)
            progress()
    finally:
        engine.shutdown()
    return runs


def _orca_generate(engine: Any, prompts: list[list[int]], n: int, ids: list[str]) -> list[list[int]]:
    from orca import SamplingParams

    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    final: dict[str, list[int]] = {}
    while engine.has_unfinished():
        final.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [final[rid] for rid in ids]


def run_transformers(checkpoint: Path, args: argparse.Namespace, prompts: list[list[int]],
                     batches: Sequence[int], device: Any, dtype: Any, runs: dict[int, dict[str, Any]],
                     progress: Callable[[], None] = lambda: None) -> dict[int, dict[str, Any]]:
    """transformers' continuous batching (its paged-attention manager), sized for the largest batch."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=args.new_tokens, eos_token_id=-1, pad_token_id=0)
    top = max(batches)
    page = cb_page_size(ContinuousBatchingConfig())
    cb_config = ContinuousBatchingConfig(
        num_blocks=top * math.ceil((args.prompt_len + args.new_tokens) / page), max_batch_tokens=top * args.prompt_len,
    )
    hints = WorkloadHints(args.prompt_len, args.new_tokens, top)
    counter = iter(range(1 << 62))
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb_config, workload_hints=hints, timeout=600
    ) as cb:
        for b in batches:
            def generate(n: int, b: int = b) -> list[list[int]]:
                return cb_generate(cb, prompts[:b], [n] * b, [f"t{next(counter)}" for _ in range(b)])

            runs[b] = decode_rate(generate, args.new_tokens, args.repeats, b, device)
            print(f"  transformers B={b}: {runs[b]['decode_tokens_per_second'] or 0:.1f} decode tok/s", flush=True)
            progress()
    return runs


def _free(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def roofline(weight_bytes: int, kv_bytes_per_token: int, batch: int, context: float, bandwidth: float) -> float:
    """Decode tokens/s at the bandwidth bound: `batch` tokens per iteration, each iteration reading the
    weights once and every request's `context` tokens of keys and values."""
    return batch * bandwidth / (weight_bytes + batch * context * kv_bytes_per_token)


def model_bytes(checkpoint: Path, dtype: Any, quantization: str = "none",
                kv_cache_dtype: str = "auto") -> tuple[int, int, dict[str, int]]:
    """(bytes of the weights a decode iteration reads: everything but the input embedding; K/V bytes per
    token; the shape) of a Llama-shaped checkpoint in `dtype`, its linear weights stored as `quantization`
    says (EngineConfig.quantization for a float checkpoint: int8 and fp8 one byte a weight; int4 half a
    byte and a scale and offset per 32 in `dtype`, its LM head int8, as the loader keeps it), its keys and
    values as `kv_cache_dtype` says (the pool's own KVLayout: a quantized one's values and scales)."""
    import torch

    from orca.worker.kv_cache import KVLayout, resolve_kv_cache_dtype

    config = json.loads((checkpoint / "config.json").read_text())
    e, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or e // heads
    i = config["intermediate_size"]
    per_layer = e * (heads + 2 * kv_heads) * head_dim + heads * head_dim * e + 3 * e * i
    element = torch.empty((), dtype=dtype).element_size()
    params = layers * per_layer + e * vocab  # + the LM head
    if quantization in ("int8", "fp8"):
        weight_bytes = params * 1.0
    elif quantization == "int4":
        weight_bytes = layers * per_layer * (0.5 + 2 * element / 32) + e * vocab * 1.0
    else:
        weight_bytes = params * element
    shape = {"hidden_size": e, "num_layers": layers, "num_heads": heads, "num_kv_heads": kv_heads,
             "head_dim": head_dim, "intermediate_size": i, "vocab_size": vocab,
             "parameters": params + e * vocab}  # + the input embedding
    kv = KVLayout(layers, kv_heads, head_dim, resolve_kv_cache_dtype(kv_cache_dtype, dtype), block_size=1)
    return int(weight_bytes), kv.bytes_per_slot, shape


def run(args: argparse.Namespace) -> dict[str, Any]:
    import random

    import torch

    from orca import EngineConfig

    config = EngineConfig(device=args.device, dtype=args.dtype)
    device, dtype = config.torch_device, config.torch_dtype
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if not batches or min(batches) < 1:
        raise ValueError(f"--batch-sizes must be positive integers, got {args.batch_sizes!r}")
    systems = args.systems.split(",") if args.systems else (
        list(SYSTEMS) if device.type == "cuda" else ["orca-reference", "orca-batched", "transformers"])
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    with tempfile.TemporaryDirectory(prefix="orca-decode-") as tmp:
        if args.model:
            checkpoint = Path(args.model)
        else:
            print(f"building a random-weight {args.shape} Llama on {device} ...", flush=True)
            checkpoint = build_checkpoint(args.shape, Path(tmp) / args.shape, dtype, device)
        weight_bytes, kv_bytes, shape = model_bytes(checkpoint, dtype, args.quantization, args.kv_cache_dtype)
        if args.prompt_len + args.new_tokens > json.loads((checkpoint / "config.json").read_text()).get(
                "max_position_embeddings", 1 << 30):
            raise ValueError("--prompt-len + --new-tokens exceeds the model's max_position_embeddings")
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(3, shape["vocab_size"]) for _ in range(args.prompt_len)] for _ in range(max(batches))]
        bandwidth = copy_bandwidth(device)
        results: dict[str, dict[int, dict[str, Any]]] = {}
        head = {
            "benchmark": "decode", "command": sys.argv, "machine": _machine(device),
            "torch": torch.__version__, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "model": str(args.model or f"random {args.shape}"), "shape": shape, "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype,
            "weight_bytes": weight_bytes,
            "kv_bytes_per_token": kv_bytes, "copy_bandwidth_bytes_per_second": bandwidth,
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
            "systems": systems,
        }

        def progress() -> None:  # the JSON so far, rewritten after every batch size: a run cut short keeps it
            if args.json:
                write_json(args.json, {**head, "complete": False, "runs": _rows(results, batches, head)}, quiet=True)

        for system in systems:
            print(f"{system} ...", flush=True)
            results[system] = {}
            if system == "transformers":
                run_transformers(checkpoint, args, prompts, batches, device, dtype, results[system], progress)
            else:
                run_orca(system, checkpoint, args, prompts, batches, device, results[system], progress)
            _free(device)  # the system's engine or model is gone: its cached GPU memory too
    return {**head, "complete": True, "runs": _rows(results, batches, head)}


def token_digest(tokens: Sequence[int]) -> str:
    """A short digest of one request's generated tokens: runs in separate processes compare by it."""
    return hashlib.sha1(json.dumps(list(tokens)).encode()).hexdigest()[:12]


def _rows(results: dict[str, dict[int, dict[str, Any]]], batches: Sequence[int], head: dict[str, Any]
          ) -> list[dict[str, Any]]:
    """One row per batch size: the roofline and, for every system that ran it, its rate, the fraction of the
    roofline, the timings and the digests of its tokens (and how many requests match transformers')."""
    context = head["prompt_len"] + head["new_tokens"] / 2
    rows = []
    for b in batches:
        bound = roofline(head["weight_bytes"], head["kv_bytes_per_token"], b, context,
                         head["copy_bandwidth_bytes_per_second"])
        row: dict[str, Any] = {"batch": b, "roofline_tokens_per_second": bound}
        for system, runs in results.items():
            r = runs.get(b)
            if r is None:
                continue
            rate = r["decode_tokens_per_second"]
            row[system] = {"decode_tokens_per_second": rate, "fraction_of_roofline": rate / bound if rate else None,
                           "seconds": r["seconds"], "first_token_seconds": r["first_token_seconds"],
                           "token_digests": [token_digest(t) for t in r["tokens"]]}
            for key in ("attention_backend", "cuda_graph_sizes"):
                if key in r:
                    row[system][key] = r[key]
        hf = row.get("transformers")
        if hf is not None:
            for system in results:
                if system != "transformers" and system in row:
                    row[system]["same_tokens_as_transformers"] = sum(
                        a == h for a, h in zip(row[system]["token_digests"], hf["token_digests"]))
        rows.append(row)
    return rows


def _machine(device: Any) -> dict[str, Any]:
    """machine_info, with the GPU's name on CUDA and torch's threads elsewhere."""
    import torch

    info = machine_info()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["threads"] = torch.get_num_threads()
    return info


def print_result(result: dict[str, Any]) -> None:
    systems = result["systems"]
    print(f"{result['model']} ({result['shape']['parameters'] / 1e9:.2f}B parameters, {result['dtype']}) on "
          f"{result['machine'].get('gpu') or result['machine'].get('cpu')}; copy bandwidth "
          f"{result['copy_bandwidth_bytes_per_second'] / 1e9:.0f} GB/s; prompts {result['prompt_len']}, "
          f"{result['new_tokens']} new tokens; decode tokens/s (fraction of the roofline)")
    print(f"{'B':>5} {'roofline':>10} " + " ".join(f"{s:>22}" for s in systems))
    for row in result["runs"]:
        cells = []
        for s in systems:
            cell = row.get(s) or {}
            rate, frac = cell.get("decode_tokens_per_second"), cell.get("fraction_of_roofline")
            cells.append(f"{rate:>13.1f} ({frac:>5.1%})" if rate else f"{'-':>22}")
        print(f"{row['batch']:>5} {row['roofline_tokens_per_second']:>10.1f} " + " ".join(f"{c:>22}" for c in cells))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a Llama-shaped checkpoint directory (default: build --shape)")
    p.add_argument("--shape", choices=tuple(SHAPES), default="llama-1b",
                   help="the random-weight model built when --model is not given (default: %(default)s)")
    p.add_argument("--device", default="auto", help="torch device (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="dtype of every system (default: %(default)s: bfloat16 on CUDA)")
    p.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES, help="comma-separated (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per request (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per batch size, medians (default: %(default)s)")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated from {', '.join(SYSTEMS)} (default: all on CUDA, orca-reference and "
                        "transformers elsewhere)")
    p.add_argument("--quantization", default="none", metavar="{none,int8,int4,fp8}",
                   help="EngineConfig.quantization of orca's systems (the random checkpoint is float: auto is none); "
                        "the roofline counts the weights' bytes in that format (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default="auto", metavar="{auto,fp8_e4m3,int8}",
                   help="EngineConfig.kv_cache_dtype of orca's systems; the roofline counts the pool's bytes in it "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (default: %(default)s)")
    p.add_argument("--json", default=None, help="write the result here")


def cmd_decode(args: argparse.Namespace) -> int:
    if args.prompt_len < 1 or args.new_tokens < 2 or args.repeats < 1:
        raise ValueError("--prompt-len must be >= 1, --new-tokens >= 2 and --repeats >= 1")
    result = run(args)
    print_result(result)
    if args.json:
        write_json(args.json, result)
    return 0


def add_parser(sub: Any) -> None:
    dc = sub.add_parser("decode", help="decode tokens/s against batch size (1-256) for orca's attention backends and "
                        "CUDA graphs, transformers' continuous batching and the bandwidth roofline (the GPU benchmark)",
                        description=" ".join(__doc__.split("\n\n")[1].split()))
    add_arguments(dc)
    dc.set_defaults(func=cmd_decode)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orca_client.bench.decode", description=__doc__.split("\n\n")[1])
    add_arguments(p)
    try:
        return cmd_decode(p.parse_args(argv))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
