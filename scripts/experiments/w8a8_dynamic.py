"""Int8 activations for the large iterations (W8A8): what the batched offline workload would gain, and what
it costs in perplexity, on the default model (SmolLM2-135M's GGUF, int4, bfloat16 on an AVX512-BF16 CPU).

Why: with `linear_backend hybrid` the quantized layers multiply iterations of 6 rows or more (batched decode,
prompts) through a bfloat16 copy of their weights (torch's weight-only int kernels lose there), so the int4
default's batched tokens/s is bfloat16's. The CPU's int8 dot products (avx512_vnni) run twice bfloat16's
multiply-adds: `torch._int_mm` multiplied SmolLM2's layer shapes 1.6-2.2x faster than oneDNN's packed bfloat16
matmul at 32-2,048 rows here. That needs the activations in int8 too: each row scaled to int8 by its largest
magnitude at each call (dynamic, per token), the weight int8 per output channel (requantized from the
dequantized int4), the int32 products scaled back.

This script patches that path into QuantizedLinear (the experiment only: the engine has no such option) for
the layers `--layers` names, by shape (SmolLM2's: qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536,
head 49152x576), where the bfloat16 copy would run: eagerly QuantizedLinear.float_matmul (the row policy's
float side, `matmul`, and the compiled head's from its float rows), in the CPU graphs the float view's matmul
(orca/worker/cpu_graphs/views.py, _float_copy, which the runner's graph takes from float_rows rows).

    PYTHONPATH=.:client .venv/bin/python scripts/experiments/w8a8_dynamic.py perplexity
    PYTHONPATH=.:client .venv/bin/python scripts/experiments/w8a8_dynamic.py speed --reps 6
    PYTHONPATH=.:client .venv/bin/python scripts/experiments/w8a8_dynamic.py linears

`perplexity`: the text of `orca-bench perplexity` (4,096 tokens of pydoc_data, windows of 1,024, chunks of
128: every chunk is a large iteration), the engine's eager path, each layer set alone and all together.
`speed`: the offline workload of `orca-bench offline` (32 requests, prompts U(32, 128), U(1, 64) new tokens,
greedy), two compiled engines in one process, one with every layer W8A8, runs alternating on fresh prompts;
median tokens/s. `linears`: SmolLM2's layer shapes at 8-2,048 rows, the weights warm in the cache, medians
of 7 rounds: oneDNN's packed bfloat16 matmul (what the copies run), torch._int_mm alone, and W8A8 eagerly
(the row scaling and the rescale as separate ops; in the compiled forward pass inductor fuses them).
Not a test, not a benchmark of record: docs/BENCHMARKS.md quotes its output with the host.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

import torch

from orca.models import quantization as Q
from orca.worker.cpu_graphs import views

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
BF16_PACKED = torch.ops.mkldnn._linear_pointwise  # oneDNN's matmul on a weight packed at load (the copies')
CHOSEN: set[tuple[int, int]] = set()  # the (out, in) shapes QuantizedLinear gives a W8A8 path at construction

_init, _float_matmul, _float_copy = Q.QuantizedLinear.__init__, Q.QuantizedLinear.float_matmul, views._float_copy


def _patched_init(self, weight, bias, device, dtype, par=None, float_copy=False):  # type: ignore[no-untyped-def]
    _init(self, weight, bias, device, dtype, par, float_copy)
    w8 = scales = None
    if self.float_packed is not None and (self.out_features, self.in_features) in CHOSEN:
        q8 = Q.quantize(weight.dequantize(), "int8")  # per output channel, from the (int4) weight's floats
        w8, scales = q8.qweight.t().to(device), q8.scales.view(-1).float().to(device)  # (in, out) view
    self.register_buffer("w8", w8, persistent=False)
    self.register_buffer("w8_scales", scales, persistent=False)


def _w8a8(layer, x2):  # type: ignore[no-untyped-def]
    """x2 (T, in) -> (T, out), no bias (forward adds it): the activations int8 per token, torch._int_mm."""
    xf = x2.float()
    row_scale = (xf.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12)  # (T, 1): per token
    xq = (xf / row_scale).round().to(torch.int8)
    return (torch._int_mm(xq, layer.w8).float() * row_scale * layer.w8_scales).to(x2.dtype)


def _patched_float_matmul(self, x2):  # type: ignore[no-untyped-def]
    return _float_matmul(self, x2) if self.w8 is None else _w8a8(self, x2)


def _patched_float_copy(layer, x2):  # type: ignore[no-untyped-def]
    return _float_copy(layer, x2) if layer.w8 is None else _w8a8(layer, x2)


Q.QuantizedLinear.__init__ = _patched_init  # type: ignore[method-assign]
Q.QuantizedLinear.float_matmul = _patched_float_matmul  # type: ignore[method-assign]
views._float_copy = _patched_float_copy  # (graph_view reads it when a runner builds its float view)


def perplexity(args: argparse.Namespace) -> dict:
    from orca_client.bench.perplexity import engine_nll, english_text

    from orca.checkpoint import load_tokenizer, resolve_checkpoint

    tokenizer = load_tokenizer(resolve_checkpoint(None))
    ids = tokenizer(english_text())["input_ids"][:4096]
    windows = [ids[i : i + 1024] for i in range(0, len(ids), 1024)]
    sets = ["none"] + args.layers.split(",") + [args.layers]
    out, base = {}, None
    for spec in sets:
        CHOSEN.clear()
        if spec != "none":
            CHOSEN.update(SHAPES[k] for k in spec.split(","))
        total, count, _ = engine_nll(None, "bfloat16", "auto", "auto", windows, 128, "hybrid")
        ppl = math.exp(total / count)
        base = base or ppl
        out[spec] = ppl
        print(f"W8A8 {spec:32s} perplexity {ppl:.4f}  {ppl / base:.4f}x bfloat16 copies", flush=True)
    return out


def speed(args: argparse.Namespace) -> dict:
    from orca_client.bench.offline import drive

    from orca import EngineConfig, LLMEngine, SamplingParams

    CHOSEN.clear()
    a = LLMEngine(EngineConfig(linear_backend="hybrid"))
    CHOSEN.update(SHAPES[k] for k in args.layers.split(","))
    b = LLMEngine(EngineConfig(linear_backend="hybrid"))

    def work(seed: int) -> tuple[list, list]:
        rng = random.Random(seed)
        prompts = [[rng.randrange(100, 10000) for _ in range(rng.randint(32, 128))] for _ in range(32)]
        params = [SamplingParams(max_tokens=rng.randint(1, 64), temperature=0, ignore_eos=True) for _ in range(32)]
        return prompts, params

    for engine in (a, b):
        drive(engine, *work(99), "warm-up")
    rates: dict[str, list[float]] = {"bf16 copies": [], "w8a8": []}
    for rep in range(args.reps):
        prompts, params = work(rep)
        order = [("bf16 copies", a), ("w8a8", b)]
        for name, engine in order if rep % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            tokens = drive(engine, prompts, params, f"{name}-{rep}")
            rates[name].append(sum(map(len, tokens)) / (time.perf_counter() - t0))
        print(rep, {k: round(v[-1], 1) for k, v in rates.items()}, flush=True)
    ratios = [w / f for f, w in zip(rates["bf16 copies"], rates["w8a8"])]
    print(f"median tok/s: bf16 copies {statistics.median(rates['bf16 copies']):.1f}, "
          f"w8a8 {statistics.median(rates['w8a8']):.1f}; median ratio {statistics.median(ratios):.3f}")
    a.shutdown()
    b.shutdown()
    return {"rates": rates, "ratios": ratios}


def linears(args: argparse.Namespace) -> dict:
    def timed(f, reps: int = 50) -> float:  # type: ignore[no-untyped-def]
        f()
        rounds = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            rounds.append((time.perf_counter() - t0) / reps * 1e6)
        return statistics.median(rounds)

    out = {}
    for rows in (8, 32, 256, 2048):
        for name in ("qkv", "gate_up", "down"):
            n, k = SHAPES[name]
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, dtype=torch.bfloat16), None)
            w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8).t()
            w_scales = torch.rand(n)

            def w8a8(x=x, w8=w8, w_scales=w_scales) -> torch.Tensor:  # type: ignore[no-untyped-def]
                xf = x.float()
                row_scale = (xf.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12)
                return (torch._int_mm((xf / row_scale).round().to(torch.int8), w8).float() * row_scale
                        * w_scales).to(x.dtype)

            xq = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
            us = {"bf16 packed": timed(lambda x=x, p=packed: BF16_PACKED(x, p, None, "none", [], "")),
                  "_int_mm": timed(lambda xq=xq, w8=w8: torch._int_mm(xq, w8)),
                  "w8a8 eager": timed(w8a8)}
            out[f"{rows}x{name}"] = us
            print(f"{rows:5d} rows {name:8s} " + ", ".join(f"{k} {v:7.0f} us" for k, v in us.items())
                  + f"  (_int_mm {us['bf16 packed'] / us['_int_mm']:.2f}x faster)", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("perplexity", "speed", "linears"))
    parser.add_argument("--layers", default="qkv,o,gate_up,down,head")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--json")
    args = parser.parse_args()
    result = {"perplexity": perplexity, "speed": speed, "linears": linears}[args.what](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
