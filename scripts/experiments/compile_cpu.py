"""Measured-and-not-shipped experiments of the CPU data plane (docs/BENCHMARKS.md), kept runnable.

    .venv/bin/python scripts/experiments/compile_cpu.py stack      # SmolLM2's layer stack, eager vs compiled
    .venv/bin/python scripts/experiments/compile_cpu.py flex       # flex attention compiled for the CPU
    .venv/bin/python scripts/experiments/compile_cpu.py shipped    # the shipped compiled forward vs eager
    .venv/bin/python scripts/experiments/compile_cpu.py regions    # small compiled regions vs eager
    .venv/bin/python scripts/experiments/compile_cpu.py matvec     # one-row matmul forms over SmolLM2's weights

`stack`: the forward of SmolLM2-135M's 30 decoder layers (no head) for a decode batch of 1, 4, 16 and 32
requests with 100 cached tokens each, median of 20: eager with reference linears, eager with the
oneDNN-packed linears (what ships), and one torch.compile graph of the whole stack (inductor, freezing on,
so it packs the weights itself), with attention as a registered custom op so that the graph holds every
layer whatever the batch's composition: dynamic token counts, then a static graph for one row.

What ships since (orca/worker/cpu_graphs/, `torch_compile`) is the `stack` idea in another form: no
freezing, the packed linears and attention as low-level torch.library ops, the iteration's layout in
scope rather than in a global, the token count unbacked (docs/BENCHMARKS.md, the third step).

`shipped`: the worker's own forward pass for the decode batches of `stack` (and the head), eager, then
through orca.worker.cpu_graphs.CPUGraphs (the runner `torch_compile auto` loads; its warm-up one iteration
of each size, so that each takes its graph: the lone step at 1 row, the few step at 4, the graph of every
token count at 16 and 32), median of 20.

`regions`: add + RMSNorm, rotary and SiLU x up, each its own torch.compile function (dynamic), against
eager, at 1 and 8 rows, microseconds a call (median of 2000).

`matvec`: SmolLM2's 121 linear weights in a step's order (the head last) at one row, through oneDNN's
packed matmul, F.linear, torch.mv, x @ W.t() on a transposed copy and MKL's packed matmul, GB/s.

`flex`: torch.compile(flex_attention) on the CPU with the engine's own FlexLayout mask (paged: the mask reads
its request and position tables), for a decode batch, against the per-request reference.
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback

import torch

from orca.config import EngineConfig
from orca.models import attention as A
from orca.worker import Worker

N_SLOTS = 16384


def _decode_meta(worker: Worker, requests: int, context: int, backend: str = "reference") -> A.AttentionMetadata:
    tables = [list(range(i * 20, i * 20 + 20)) for i in range(requests)]
    return A.AttentionMetadata.build([1] * requests, [context] * requests, tables, 16, worker.kv_pool, backend=backend)


def _decode_layout(worker: Worker, requests: int, context: int) -> A.IterationLayout:
    """_decode_meta's iteration as the worker hands it to a runner (reference attention)."""
    tables = [list(range(i * 20, i * 20 + 20)) for i in range(requests)]
    return A.IterationLayout(A.get_backend("reference"), [1] * requests, [context] * requests, tables, 16,
                             worker.kv_pool)


def _median_ms(fn, reps: int = 20) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def stack() -> None:
    import orca.models.llama as llama

    current: dict[str, A.AttentionMetadata] = {}

    @torch.library.custom_op("orca_experiment::attention", mutates_args=("pool",))
    def attention(q: torch.Tensor, kv: torch.Tensor, pool: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
        return A.selective_attention(q, kv, current["meta"], layer, scale)

    @attention.register_fake
    def _(q, kv, pool, layer, scale):  # noqa: ANN001, ANN202
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])

    for linear_backend in ("reference", "onednn"):
        worker = Worker(EngineConfig(dtype="float32", device="cpu", linear_backend=linear_backend, n_slots=N_SLOTS))
        worker.init_kv_pool(N_SLOTS // 16)
        with torch.inference_mode():
            for n in (1, 4, 16, 32):
                meta = _decode_meta(worker, n, 100)
                ids, pos = torch.randint(0, 1000, (n,)), torch.full((n,), 100)
                ms = _median_ms(lambda: worker.model(ids, pos, meta))  # noqa: B023
                print(f"eager, {linear_backend} linears, {n} rows: {ms:.1f} ms", flush=True)
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    worker = Worker(EngineConfig(dtype="float32", device="cpu", linear_backend="reference", n_slots=N_SLOTS))
    worker.init_kv_pool(N_SLOTS // 16)
    pool = worker.kv_pool
    llama.selective_attention = lambda q, kv, meta, layer, scale, window=None: torch.ops.orca_experiment.attention(
        q, kv, pool, layer, scale)
    for dynamic, sizes in ((True, (1, 4, 16, 32)), (False, (1,))):
        torch._dynamo.reset()
        compiled = torch.compile(lambda ids, pos: worker.model(ids, pos, None), dynamic=dynamic)
        with torch.inference_mode():
            for n in sizes:
                current["meta"] = _decode_meta(worker, n, 100)
                ids, pos = torch.randint(0, 1000, (n,)), torch.full((n,), 100)
                t0 = time.perf_counter()
                compiled(ids, pos)
                first = time.perf_counter() - t0
                ms = _median_ms(lambda: compiled(ids, pos))  # noqa: B023
                print(f"compiled (dynamic={dynamic}), {n} rows: {ms:.1f} ms (first call {first:.0f} s)", flush=True)


def flex() -> None:
    from torch.nn.attention.flex_attention import flex_attention

    worker = Worker(EngineConfig(dtype="float32", device="cpu", n_slots=N_SLOTS, attention_backend="flex"))
    worker.init_kv_pool(N_SLOTS // 16)
    compiled = torch.compile(flex_attention, dynamic=True)
    for n in (1, 32):
        meta = _decode_meta(worker, n, 100, backend="flex")
        q, pool = torch.randn(n, 9, 64), worker.kv_pool[0]
        try:
            out = compiled(q.transpose(0, 1)[None], pool[0][None], pool[1][None], block_mask=meta.flex.block_mask(),
                           enable_gqa=True)
            print(f"flex compiled for the CPU, {n} rows: ran, output {tuple(out.shape)}")
        except Exception as exc:  # noqa: BLE001 - the experiment reports what inductor does
            print(f"flex compiled for the CPU, {n} rows: {type(exc).__name__}: {str(exc).splitlines()[0]}")
            print("".join(traceback.format_exception_only(exc))[-600:])


def shipped() -> None:
    import os

    os.environ.pop("ORCA_TORCH_COMPILE", None)
    from orca.worker.cpu_graphs import CPUGraphs

    worker = Worker(EngineConfig(dtype="float32", device="cpu", n_slots=N_SLOTS, torch_compile="off"))
    worker.init_kv_pool(N_SLOTS // 16)
    model, compiled = worker.model, CPUGraphs(worker.model)  # (an int8 head's compiled graph installed)
    with torch.inference_mode():
        layouts = {n: _decode_layout(worker, n, 100) for n in (1, 4, 16, 32)}
        inputs = {n: (torch.randint(0, 1000, (n,)), torch.full((n,), 100)) for n in layouts}

        def warm_up() -> None:  # each size compiles the graph it takes, and the first one the head's
            for n, layout in layouts.items():
                model.compute_logits(compiled.forward(*inputs[n], layout))

        t0 = time.perf_counter()
        compiled.compile(warm_up, worker.device)
        print(f"compiled in {time.perf_counter() - t0:.1f} s", flush=True)
        for n, layout in layouts.items():
            ids, pos = inputs[n]
            eager = _median_ms(lambda: model.compute_logits(model(ids, pos, layout.metadata())))  # noqa: B023
            comp = _median_ms(lambda: model.compute_logits(compiled.forward(ids, pos, layout)))  # noqa: B023
            print(f"{n} rows: eager {eager:.1f} ms, compiled {comp:.1f} ms, {eager / comp:.2f}x", flush=True)


def regions() -> None:
    import torch.nn.functional as F

    hidden, heads, kv_heads, dim, inter = 576, 9, 3, 64, 1536
    weight = torch.randn(hidden)

    def add_norm(x, d, w):  # noqa: ANN001, ANN202
        x = x + d
        return x, F.rms_norm(x, (hidden,), w, 1e-5)

    def rotary(qkv, cos, sin):  # noqa: ANN001, ANN202
        t = qkv.shape[0]
        qk = qkv[:, : (heads + kv_heads) * dim].view(t, heads + kv_heads, dim)
        x1, x2 = qk.chunk(2, dim=-1)
        qk = qk * cos + torch.cat((-x2, x1), -1) * sin
        kv = torch.cat((qk[:, heads:], qkv[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim)), 1)
        return qk[:, :heads], kv.view(t, 2, kv_heads, dim)

    def swiglu(gate_up):  # noqa: ANN001, ANN202
        gate, up = gate_up.chunk(2, -1)
        return F.silu(gate) * up

    def us(fn, *args) -> float:  # noqa: ANN001
        for _ in range(50):
            fn(*args)
        t0 = time.perf_counter()
        for _ in range(2000):
            fn(*args)
        return (time.perf_counter() - t0) / 2000 * 1e6

    for t in (1, 8):
        cases = {
            "add + RMSNorm": (add_norm, (torch.randn(t, hidden), torch.randn(t, hidden), weight)),
            "rotary": (rotary, (torch.randn(t, (heads + 2 * kv_heads) * dim), torch.randn(t, 1, dim),
                                torch.randn(t, 1, dim))),
            "SiLU x up": (swiglu, (torch.randn(t, 2 * inter),)),
        }
        for name, (fn, args) in cases.items():
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
            print(f"{t} rows, {name}: eager {us(fn, *args):.1f} us, compiled {us(compiled, *args):.1f} us", flush=True)


def matvec() -> None:
    hidden, inter, vocab = 576, 1536, 49152
    shapes = [(960, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)] * 30 + [(vocab, hidden)]
    weights = [torch.randn(o, i) for o, i in shapes]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    forms = {
        "oneDNN packed": (lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None),
                          lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")),
        "F.linear": (lambda w: w, lambda x, p: torch.nn.functional.linear(x, p)),
        "torch.mv": (lambda w: w, lambda x, p: torch.mv(p, x[0])),
        "x @ W.t() (transposed copy)": (lambda w: w.t().contiguous(), lambda x, p: x @ p),
        "MKL packed": (lambda w: (torch.ops.mkl._mkl_reorder_linear_weight(w, 1), w),
                       lambda x, p: torch.ops.mkl._mkl_linear(x, p[0], p[1], None, 1)),
    }
    xs = {i: torch.randn(1, i) for i in (hidden, inter)}
    for name, (prepare, run) in forms.items():
        packed = [prepare(w) for w in weights]

        def once(packed: list = packed, run=run) -> None:  # noqa: ANN001
            for (_, i), p in zip(shapes, packed):
                run(xs[i], p)

        ms = _median_ms(once, reps=7)
        print(f"{name}: {ms:.1f} ms, {nbytes / ms / 1e6:.1f} GB/s", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    modes = {"stack": stack, "flex": flex, "shipped": shipped, "regions": regions, "matvec": matvec}
    modes[sys.argv[1] if len(sys.argv) > 1 else "stack"]()
