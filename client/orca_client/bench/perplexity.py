"""``orca-bench perplexity``: output quality of the engine's weight and K/V formats, as perplexity on real
English text: the text of Python's own documentation (``pydoc_data.topics``, shipped with every Python),
its topics in sorted order, the first --tokens tokens of it under the model's tokenizer.

Each variant (--variants: QUANTIZATION[/KV_CACHE_DTYPE] with the engine's option values, and --dtype) is
computed by the engine itself: orca's worker builds the model as serving does (load_model with the
quantization, the K/V pool in its kv_cache_dtype, the attention backend), and the text runs through it
in windows of --window tokens, each window fed in chunks of --chunk tokens through the paged K/V pool,
as chunked prefill feeds a prompt, so every chunk after the first reads its context back from the pool
(stored in the variant's K/V format). The model's logits at every position give the negative
log-likelihood of the next token; perplexity = exp(mean NLL) over every predicted token.

Beside them, transformers on the checkpoint's float weights in float32 (the dequantized GGUF for the
default model) over the same windows, whole: the numerical reference (--skip-transformers skips it).
Reports each variant's perplexity and its ratio to the reference and to the first variant.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from orca_client.bench.common import machine_info, write_json
from orca_client.bench.options import positive_int

DEFAULT_VARIANTS = "none,int8,int4,auto,none/fp8_e4m3,none/int8"


def english_text() -> str:
    """Python's documentation topics (pydoc_data.topics), in sorted order: real English prose and code."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def _variant(spec: str) -> tuple[str, str]:
    quantization, _, kv = spec.partition("/")
    return quantization, kv or "auto"


def engine_nll(model: str | None, dtype: str, quantization: str, kv_cache_dtype: str, windows: list[list[int]],
               chunk: int, linear_backend: str = "onednn") -> tuple[float, int, float]:
    """(summed NLL, predicted tokens, seconds) of the windows through orca's worker in one variant."""
    import torch
    import torch.nn.functional as F

    from orca.config import EngineConfig
    from orca.worker import Worker

    longest = max(len(w) for w in windows)
    config = EngineConfig(model=model, dtype=dtype, device="cpu", quantization=quantization,
                          kv_cache_dtype=kv_cache_dtype, torch_compile="off", n_slots=longest + 64,
                          linear_backend=linear_backend)
    worker = Worker(config)
    worker.init_kv_pool(worker.determine_num_blocks())
    block = worker.kv_layout.block_size
    table = list(range(-(-longest // block)))
    total, count, seconds = 0.0, 0, 0.0
    with torch.inference_mode():
        for window in windows:
            if worker.attention.reads_whole_blocks:
                worker.kv_layout.zero_blocks(worker.kv_pool, torch.tensor(table, dtype=torch.int64), worker.kv_scales)
            t0 = time.perf_counter()
            for start in range(0, len(window) - 1, chunk):
                ids = window[start : start + chunk]
                meta = worker.attention.for_iteration([len(ids)], [start], [table], block, worker.kv_pool, None,
                                                      kv_scales=worker.kv_scales)
                hidden = worker.model(torch.tensor(ids), torch.arange(start, start + len(ids)), meta)
                logits = worker.model.compute_logits(hidden)  # (n, V) float32
                targets = window[start + 1 : start + len(ids) + 1]
                n = len(targets)  # the window's last token predicts nothing
                total += F.cross_entropy(logits[:n], torch.tensor(targets), reduction="sum").item()
                count += n
            seconds += time.perf_counter() - t0
    return total, count, seconds


def transformers_nll(checkpoint: Any, windows: list[list[int]]) -> tuple[float, int]:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.inference_mode():
        for window in windows:
            logits = hf(torch.tensor([window])).logits[0, :-1].float()
            total += F.cross_entropy(logits, torch.tensor(window[1:]), reduction="sum").item()
            count += len(window) - 1
    return total, count


def cmd_perplexity(args: argparse.Namespace) -> int:
    import torch

    from orca.checkpoint import load_tokenizer, resolve_checkpoint

    torch.set_num_threads(args.threads or torch.get_num_threads())
    checkpoint = resolve_checkpoint(args.model)
    tokenizer = load_tokenizer(checkpoint)
    if tokenizer is None:
        raise ValueError(f"{checkpoint} has no tokenizer: perplexity needs one to read the text")
    ids = tokenizer(english_text())["input_ids"][: args.tokens]
    windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
    windows = [w for w in windows if len(w) > 1]
    result: dict[str, Any] = {
        "command": "perplexity", "machine": machine_info(), "model": str(args.model or "default (SmolLM2 GGUF)"),
        "dtype": args.dtype, "linear_backend": args.linear_backend, "tokens": sum(len(w) for w in windows),
        "window": args.window, "chunk": args.chunk,
        "text": "pydoc_data.topics, sorted", "variants": [],
    }
    reference = None
    if not args.skip_transformers:
        total, count = transformers_nll(checkpoint, windows)
        reference = math.exp(total / count)
        result["transformers_float32"] = {"perplexity": reference, "predicted_tokens": count}
        print(f"transformers float32 (the checkpoint's float weights): perplexity {reference:.4f} ({count} tokens)")
    first = None
    for spec in args.variants.split(","):
        quantization, kv = _variant(spec)
        total, count, seconds = engine_nll(args.model, args.dtype, quantization, kv, windows, args.chunk,
                                           args.linear_backend)
        ppl = math.exp(total / count)
        first = first or ppl
        record = {"variant": spec, "quantization": quantization, "kv_cache_dtype": kv, "perplexity": ppl,
                  "predicted_tokens": count, "seconds": seconds, "ratio_to_first": ppl / first}
        if reference is not None:
            record["ratio_to_transformers"] = ppl / reference
        result["variants"].append(record)
        print(f"orca {args.dtype} quantization={quantization} kv_cache_dtype={kv}: perplexity {ppl:.4f}"
              f" ({ppl / first:.4f}x the first" + (f", {ppl / reference:.4f}x transformers" if reference else "")
              + f"; {seconds:.1f} s)")
    if args.json:
        write_json(args.json, result)
    return 0


def add_parser(sub: Any) -> None:
    pp = sub.add_parser("perplexity", help="output quality of weight and K/V formats: perplexity on English text",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pp.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    pp.add_argument("--dtype", default="float32", help="engine dtype (default: %(default)s)")
    pp.add_argument("--variants", default=DEFAULT_VARIANTS, metavar="Q[/KV],...",
                    help="quantization[/kv_cache_dtype] values to compare, the engine options' values "
                         "(default: %(default)s)")
    pp.add_argument("--tokens", type=positive_int, default=4096, help="tokens of text (default: %(default)s)")
    pp.add_argument("--window", type=positive_int, default=1024, help="tokens per window (default: %(default)s)")
    pp.add_argument("--chunk", type=positive_int, default=128,
                    help="tokens per forward pass through the K/V pool (default: %(default)s)")
    pp.add_argument("--linear-backend", default="onednn", metavar="{onednn,hybrid,reference,auto}",
                    help="EngineConfig.linear_backend (default: %(default)s: quantized layers multiply with their "
                         "own kernels at every row count; hybrid would hand these prompt-sized chunks to float copies)")
    pp.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    pp.add_argument("--skip-transformers", action="store_true", help="no transformers reference")
    pp.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    pp.set_defaults(func=cmd_perplexity)
