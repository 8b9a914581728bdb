"""Measured-and-not-shipped experiments of the CPU data plane (docs/BENCHMARKS.md), kept runnable.

    .venv/bin/python scripts/experiments/compile_cpu.py stack      # SmolLM2's layer stack, eager vs compiled
    .venv/bin/python scripts/experiments/compile_cpu.py flex       # flex attention compiled for the CPU

`stack`: the forward of SmolLM2-135M's 30 decoder layers (no head) for a decode batch of 1, 4, 16 and 32
requests with 100 cached tokens each, median of 20: eager with reference linears, eager with the
oneDNN-packed linears (what ships), and one torch.compile graph of the whole stack (inductor, freezing on,
so it packs the weights itself), with attention as a registered custom op so that the graph holds every
layer whatever the batch's composition: dynamic token counts, then a static graph for one row.

What ships since (orca/worker/compiled.py, `torch_compile`) is the `stack` idea in another form: no
freezing, the packed linears and attention as low-level torch.library ops, the iteration's layout in
scope rather than in a global, the token count unbacked (docs/BENCHMARKS.md, the third step).

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


if __name__ == "__main__":
    torch.set_num_threads(2)
    {"stack": stack, "flex": flex}[sys.argv[1] if len(sys.argv) > 1 else "stack"]()
