"""The engine on CUDA (`make test-gpu`; skipped where torch sees no GPU, as on CI).

Against transformers on the same GPU: fp32 greedy tokens identical (GPT-2 and Llama with GQA, a small
paged pool with chunked prefill and preemptions); bf16 logits close to fp32; the K/V pool sized from
gpu_memory_utilization after the profiling pass; seeded sampling (with log-probabilities asked) drawing
the CPU's tokens; attention_backend flex compiled for CUDA, and batched, against the reference and
transformers; decode iterations replayed from CUDA graphs against eager ones; quantized linears and
engines. Then the features added since the first GPU run, on CUDA: the prefix cache, quantized K/V pools,
speculative decoding (n-gram and draft, with CUDA graphs), multi-LoRA (with CUDA graphs for base-only
decode), the structured-output mask, the other model families (sliding window, QK norm, mixtures of
experts) against transformers.

ORCA_GPU_TESTS_DEVICE=cpu runs them on the CPU instead (a dry run of the tests themselves, before device
time is spent; the CUDA-only checks skip): `ORCA_GPU_TESTS_DEVICE=cpu pytest -m gpu tests/test_gpu.py`."""

from __future__ import annotations

import os
import random

import pytest
import torch
from _fixtures import FAMILIES, decode_graphs, drain, tiny_checkpoint
from transformers import AutoModelForCausalLM

from orca import EngineConfig, LLMEngine, SamplingParams

DEVICE = os.environ.get("ORCA_GPU_TESTS_DEVICE", "cuda")
CUDA = DEVICE == "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(CUDA and not torch.cuda.is_available(),
                       reason="needs a CUDA device (make test-gpu on a GPU host)"),
]
cuda_only = pytest.mark.skipif(not CUDA, reason="a CUDA-only check (ORCA_GPU_TESTS_DEVICE is not cuda)")

def _flex_checkpoint(family: str):
    """The family's tiny checkpoint, for flex on CUDA: its Llama with head_dim 16 (the tiny one has 8, under
    the FLEX_MIN_HEAD_DIM of torch's flex kernels)."""
    import checkpoints
    from _fixtures import _root

    if family != "llama":
        return tiny_checkpoint(family)
    path = _root() / "llama-head16"
    if not (path / "config.json").is_file():
        checkpoints.make_llama(path, head_dim=16)
    return path


POOL = dict(block_size=4, n_slots=96, max_num_batched_tokens=16, max_bs=8, kv_admission="on_demand")


def _workload(seed: int = 0, n: int = 12) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(0, 190) for _ in range(rng.randint(1, 30))], rng.randint(1, 16)) for _ in range(n)]


def _run(engine: LLMEngine, jobs: list[tuple[list[int], int]], **params: object) -> list[list[int]]:
    for i, (prompt, n) in enumerate(jobs):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, ignore_eos=True, **params))  # type: ignore[arg-type]
    final = {}
    while engine.has_unfinished():
        final.update({o.request_id: o for o in engine.step() if o.finished})
    return [final[f"r{i}"].token_ids for i in range(len(jobs))]


@torch.inference_mode()
def _hf_greedy(model: AutoModelForCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=DEVICE)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_greedy_on_cuda_equals_transformers_on_cuda(family: str) -> None:
    path = tiny_checkpoint(family)
    engine = LLMEngine(EngineConfig(model=str(path), device=DEVICE, dtype="float32", **POOL))
    jobs = _workload()
    tokens = _run(engine, jobs, temperature=0)
    assert engine.stats().preemptions > 0
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    assert tokens == [_hf_greedy(ref, prompt, n) for prompt, n in jobs]


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_are_close_to_fp32(family: str) -> None:
    path = tiny_checkpoint(family)
    rows = {}
    for dtype in ("float32", "bfloat16"):
        # A pool of its own size: with gpu_memory_utilization, the first engine's pool (still held) would
        # leave the second nothing.
        engine = LLMEngine(EngineConfig(model=str(path), device=DEVICE, dtype=dtype, max_bs=4, n_slots=256))
        engine.capture_logits = True
        engine.add_request("a", list(range(5, 25)), SamplingParams(max_tokens=1, temperature=0))
        (out,) = [o for o in engine.step() if o.request_id == "a"]
        rows[dtype] = out.logits.float()
    assert torch.allclose(rows["bfloat16"], rows["float32"], atol=0.1 * rows["float32"].abs().max().item())
    assert rows["bfloat16"].argmax() == rows["float32"].argmax()


@cuda_only
def test_kv_pool_is_sized_from_gpu_memory() -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), device=DEVICE, gpu_memory_utilization=0.05,
                                    max_num_batched_tokens=256))
    free, total = torch.cuda.mem_get_info()
    layout = engine.executor.worker.kv_layout
    pool_bytes = engine.stats().kv_total_blocks * layout.bytes_per_block
    assert 0 < pool_bytes <= 0.05 * total


@cuda_only
def test_an_engine_after_a_dropped_one_gets_the_same_pool() -> None:
    """The first engine, dropped but caught in a reference cycle (freed only by a collection), must not
    keep or fragment the memory the second sizes its pool from (measured on an H200: the second engine's
    weights landed in the first's cached pool segment, and its pool then did not fit: out of memory)."""
    options = dict(model=str(tiny_checkpoint("llama")), device=DEVICE, gpu_memory_utilization=0.3,
                   max_num_batched_tokens=256)
    first = LLMEngine(EngineConfig(**options))  # type: ignore[arg-type]
    blocks = first.stats().kv_total_blocks
    cycle: list = [first]
    cycle.append(cycle)
    del first, cycle
    second = LLMEngine(EngineConfig(**options))  # type: ignore[arg-type]
    assert second.stats().kv_total_blocks >= 0.95 * blocks
    assert len(_run(second, _workload(8, n=4), temperature=0)) == 4


@cuda_only
def test_seeded_sampling_draws_the_cpus_tokens() -> None:
    path = str(tiny_checkpoint("llama"))
    jobs = _workload(1, 6)
    params = dict(temperature=0.8, top_k=20, seed=7, logprobs=2)
    on = {device: _run(LLMEngine(EngineConfig(model=path, device=device, dtype="float32", **POOL)), jobs, **params)
          for device in ("cpu", "cuda")}
    assert on["cuda"] == on["cpu"]


@cuda_only
def test_iteration_inputs_reach_the_gpu_through_pinned_non_blocking_copies() -> None:
    """orca/models/device.py: what upload returns is on the GPU with the host values once the stream has run, and
    its staging buffer was pinned (a pageable source would have made the copy synchronous)."""
    from orca.models.device import upload

    values = list(range(1000))
    out = upload(values, torch.int64, torch.device("cuda"))
    assert out.device.type == "cuda"
    torch.cuda.current_stream().synchronize()
    assert out.tolist() == values
    assert torch.tensor(values, pin_memory=True).is_pinned()


@pytest.mark.parametrize("backend", ["flex", "batched"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_attention_on_cuda_gives_transformers_greedy_tokens(family: str, backend: str) -> None:
    """attention_backend flex compiled for CUDA (warmed up at load), and batched increments, under chunking
    and preemptions."""
    path = _flex_checkpoint(family) if backend == "flex" else tiny_checkpoint(family)
    engine = LLMEngine(EngineConfig(model=str(path), device=DEVICE, dtype="float32", attention_backend=backend,
                                    **POOL))
    assert engine.executor.worker.attention_backend == backend
    jobs = _workload(2)
    tokens = _run(engine, jobs, temperature=0)
    assert engine.stats().preemptions > 0
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    assert tokens == [_hf_greedy(ref, prompt, n) for prompt, n in jobs]


def _against_reference(requests: list[tuple[int, int]], block_size: int, pool_tokens: int, backend: str,
                       window: int | None = None) -> tuple[torch.Tensor, torch.Tensor, object]:
    """One layer's attention for (new tokens, cached tokens) requests in shuffled blocks of a pool of about
    `pool_tokens` slots: `backend`'s output, the reference's (per-request SDPA) and `backend`'s metadata."""
    from orca.models.attention import AttentionMetadata, selective_attention

    rng = random.Random(block_size)
    num_blocks = pool_tokens // block_size + 8
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(n + past) // block_size))] for n, past in requests]
    lengths, context = [n for n, _ in requests], [p for _, p in requests]
    torch.manual_seed(0)
    pool = torch.randn(2, 2, 2, num_blocks * block_size, 64, device=DEVICE)
    q = torch.randn(sum(lengths), 6, 64, device=DEVICE)
    kv = torch.randn(sum(lengths), 2, 2, 64, device=DEVICE)
    out, metas = {}, {}
    for b in ("reference", backend):
        metas[b] = AttentionMetadata.build(lengths, context, tables, block_size, pool.clone(), backend=b)
        out[b] = selective_attention(q, kv, metas[b], 1, 0.125, window)
    return out[backend], out["reference"], metas[backend]


@pytest.mark.parametrize("backend", ["flex", "batched"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_fused_backends_match_reference_on_cuda(block_size: int, backend: str) -> None:
    """flex's compiled kernel (which skips the tiles the block-sparse structure leaves out, unlike the CPU's
    unfused path) and the batched increments against per-request SDPA, on a mixed iteration with shuffled
    block tables."""
    mixed = [(1, 9), (1, 3), (1, 30), (12, 0), (5, 6), (1, 0), (9, 17), (10, 0)]
    out, reference, _ = _against_reference(mixed, block_size, 160, backend)
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_flex_iterations_of_few_rows_per_request_match_reference_on_cuda(block_size: int, window: int | None) -> None:
    """Increments, verifying rows and short prompts (at most VERIFYING_MAX_ROWS rows per request): on CUDA flex hands
    them to the paged decode kernel (a layout without block-sparse structure), against per-request SDPA."""
    from orca.tuning import VERIFYING_MAX_ROWS

    short = [(1, 9), (1, 3), (1, 300), (VERIFYING_MAX_ROWS, 0), (5, 6), (1, 0), (3, 17), (1, 64)] * 5
    out, reference, meta = _against_reference(short, block_size, 8000, "flex", window)
    assert meta.flex.paged == CUDA and (meta.flex.kv_indices is None) == CUDA
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=0)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_paged_decode_kernel_on_cuda(rows: int, dtype: torch.dtype) -> None:
    """The kernel compiled, a Llama-sized head layout (32 query heads on 8 K/V heads of 64): one row (the
    most splits) to 300 (one split), against attention from each row's gathered keys and values."""
    from test_paged_decode import _case, _expected

    from orca.models.attention import paged_decode

    q, pool, q_request, q_position, table, tables, positions = _case(
        rows, rows=rows, heads=32, kv_heads=8, head_dim=64, block_size=16, num_blocks=rows * 12 + 4, dtype=dtype,
        padding=3)
    device = torch.device("cuda")
    args = [t.to(device) for t in (q, pool, q_request, q_position, table)]
    out = paged_decode.paged_decode_attention(*args, 16, 0.125, None)
    expected = _expected(q, pool, tables, positions, 16, 0.125, None, 3)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:rows].float().cpu(), expected[:rows], atol=tolerance, rtol=tolerance)
    assert torch.count_nonzero(out[rows:]) == 0


@cuda_only
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graphs_on_and_off_give_the_same_tokens(family: str) -> None:
    """Decode iterations replayed from CUDA graphs (captured at load: attention_backend flex, cuda_graphs
    auto) against the same engine with cuda_graphs off, and both against transformers, in fp32. Batches of
    every size up to max_bs, padded to the captured sizes, among prompt chunks and preemptions."""
    path = _flex_checkpoint(family)
    jobs = _workload(4, n=16)
    tokens = {}
    for graphs in ("auto", "off"):
        engine = LLMEngine(EngineConfig(model=str(path), device=DEVICE, dtype="float32", attention_backend="flex",
                                        cuda_graphs=graphs, **POOL))
        worker = engine.executor.worker
        tokens[graphs] = _run(engine, jobs, temperature=0)
        if graphs == "auto":
            assert decode_graphs(worker) is not None and decode_graphs(worker).captured
            assert decode_graphs(worker).replays > 0
        else:
            assert decode_graphs(worker) is None and worker.no_graphs_reason == "cuda_graphs is off"
    assert tokens["auto"] == tokens["off"]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    assert tokens["auto"] == [_hf_greedy(ref, prompt, n) for prompt, n in jobs]


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_is_flex_with_cuda_graphs_on_cuda(family: str) -> None:
    """attention_backend auto on CUDA, for a dense model of head_dim 16 or more on one worker: flex, decode
    iterations in CUDA graphs, fp32 greedy equal to transformers'. On the CPU
    dry run auto is batched."""
    path = _flex_checkpoint(family)
    engine = LLMEngine(EngineConfig(model=str(path), device=DEVICE, dtype="float32", **POOL))
    worker = engine.executor.worker
    assert worker.attention_backend == ("flex" if CUDA else "batched")
    jobs = _workload(5, n=16)
    tokens = _run(engine, jobs, temperature=0)
    if CUDA:
        graphs = decode_graphs(worker)
        assert graphs is not None and graphs.captured and graphs.replays > 0
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    assert tokens == [_hf_greedy(ref, prompt, n) for prompt, n in jobs]


# -- quantized weights on CUDA (orca/models/quantization.py) ----------------------------------------------------
@cuda_only
@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
def test_quantized_linear_on_cuda_is_the_dequantized_matmul(kind: str) -> None:
    """torch's CUDA kernels (int4 tinygemm, int8 weight-only or its dequantizing fallback, _scaled_mm for
    fp8 on compute capability 8.9+) against the dequantized weight, in bfloat16."""
    from orca.models.quantization import FP8_MIN_CAPABILITY, QuantizedLinear, quantize

    if kind == "fp8" and torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY:
        pytest.skip("fp8 needs compute capability 8.9 or later")
    torch.manual_seed(0)
    device = torch.device("cuda")
    q = quantize(torch.randn(200, 256) * 0.05, kind, 64)
    layer = QuantizedLinear(q, None, device, torch.bfloat16)
    x = torch.randn(7, 256, device=device, dtype=torch.bfloat16)
    expected = x.float() @ q.dequantize().to(device).t()
    torch.testing.assert_close(layer(x).float(), expected, atol=0.05 * expected.abs().max().item(), rtol=0)


@cuda_only
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_engine_on_cuda_decodes_with_and_without_cuda_graphs(quantization: str) -> None:
    import checkpoints
    from _fixtures import _root

    path = _root() / "gpu-quant-llama"
    if not (path / "config.json").is_file():
        checkpoints.make_llama(path, intermediate_size=128, head_dim=16)
    jobs = _workload(3, n=6)
    options = dict(model=str(path), device=DEVICE, dtype="bfloat16", quantization=quantization, **POOL)
    graphs = _run(LLMEngine(EngineConfig(attention_backend="flex", cuda_graphs="auto", **options)), jobs,
                  temperature=0)
    eager = _run(LLMEngine(EngineConfig(attention_backend="flex", cuda_graphs="off", **options)), jobs, temperature=0)
    assert graphs == eager and all(len(t) == n for t, (_, n) in zip(eager, jobs))


# -- the features added since the first GPU run --------------------------------------------------------------
def _engine(path, **options: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device=DEVICE, dtype="float32", **options))  # type: ignore[arg-type]


def _reference(path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"])
def test_the_other_families_give_transformers_greedy_tokens_on_cuda(family: str) -> None:
    """Sliding windows (Mistral, Qwen2), QK norm (Qwen3), mixtures of experts (Mixtral; Qwen3-MoE with a
    dense layer): the default attention backend on the device, chunked prefill and preemptions."""
    import checkpoints
    from _fixtures import _root

    path = _root() / f"gpu-{family}"
    if not (path / "config.json").is_file():
        getattr(checkpoints, f"make_{family}")(path)
    engine = _engine(path, **POOL)
    jobs = _workload(5)
    tokens = _run(engine, jobs, temperature=0)
    assert engine.stats().preemptions > 0
    ref = _reference(path)
    assert tokens == [_hf_greedy(ref, prompt, n) for prompt, n in jobs]


@pytest.mark.parametrize("backend", ["batched", "reference", "flex"])
def test_the_prefix_cache_reads_cached_kv_on_cuda_and_keeps_the_tokens(backend: str) -> None:
    """Requests that share a 24-token prefix with a finished one read its blocks from the cache (on the
    device) and still give transformers' greedy tokens; with flex (compiled, its decode iterations from CUDA
    graphs) several requests read the same cached blocks in one iteration through their block tables."""
    path = _flex_checkpoint("llama") if backend == "flex" else tiny_checkpoint("llama")
    engine = _engine(path, attention_backend=backend, block_size=4, n_slots=256, max_bs=8)
    rng = random.Random(6)
    prefix = [rng.randrange(0, 190) for _ in range(24)]
    prompts = [prefix + [rng.randrange(0, 190) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    cached = 0
    tokens = []
    for i, prompt in enumerate(prompts):  # the first alone, so its blocks are cached before the others come
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        if i in (0, len(prompts) - 1):
            final = drain(engine)
            cached += sum(out.num_cached_tokens for out in final.values())
            tokens += [final[f"r{j}"].token_ids for j in sorted(int(r[1:]) for r in final)]
    assert cached >= 5 * 24
    ref = _reference(path)
    assert tokens == [_hf_greedy(ref, prompt, 8) for prompt in prompts]
    if backend == "flex" and CUDA:
        assert decode_graphs(engine.executor.worker).replays > 0


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_a_quantized_kv_pool_on_cuda_stays_close_to_the_float_one(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/test_kv_cache_dtype.py's check on the device: each request's log-probabilities, while its
    tokens so far are the float pool's, within the format's tolerance; prefix cache hits read quantized
    blocks back."""
    from test_kv_cache_dtype import GENERATION, _generate, assert_close_until_the_paths_part

    path = tiny_checkpoint("llama")
    want_tokens, want_rows, _ = _generate(_engine(path, **GENERATION), monkeypatch)
    engine = _engine(path, kv_cache_dtype=name, **GENERATION)
    assert engine.executor.worker.kv_scales is not None and engine.executor.worker.kv_scales.device.type == DEVICE
    tokens, rows, cached = _generate(engine, monkeypatch)
    assert cached >= 2 * 4
    assert_close_until_the_paths_part(name, want_tokens, want_rows, tokens, rows)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_flex_over_a_quantized_kv_pool_on_cuda_generates_what_batched_does(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """attention_backend flex with a quantized pool on the device: decode iterations replayed from CUDA graphs
    through the paged decode kernel reading the pool's values and scales, prompts through compiled
    flex_attention over their blocks dequantized; the batched backend over the same kind of pool gives the
    same tokens and log-probabilities (to float32 rounding)."""
    from test_kv_cache_dtype import GENERATION, _generate

    path = _flex_checkpoint("llama")
    want_tokens, want_rows, _ = _generate(_engine(path, kv_cache_dtype=name, attention_backend="batched",
                                                  **GENERATION), monkeypatch)
    engine = _engine(path, kv_cache_dtype=name, attention_backend="flex", **GENERATION)
    tokens, rows, cached = _generate(engine, monkeypatch)
    assert cached >= 2 * 4 and tokens == want_tokens
    for rid, want in want_rows.items():
        torch.testing.assert_close(torch.stack(rows[rid]), torch.stack(want), atol=1e-3, rtol=0)
    if CUDA:
        assert decode_graphs(engine.executor.worker).replays > 0


SPEC_POOL = dict(n_slots=256, block_size=4, max_num_batched_tokens=32, max_bs=8)


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("backend", ["batched", "flex"])
def test_speculative_decoding_on_cuda_keeps_the_greedy_tokens(backend: str, method: str) -> None:
    """n-gram prompt lookup and a draft model (the model as its own draft: always right) against
    speculation off on the same engine options; with flex, CUDA graphs replay the decode iterations that
    verify nothing (verifying ones, with several rows per request, run eagerly; the draft always does)."""
    from test_speculative import _prompts

    path = _flex_checkpoint("llama")
    prompts = _prompts(10, seed=1, vocab=150)
    params = [SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    options = dict(attention_backend=backend, **SPEC_POOL)
    spec = dict(speculative_method=method, num_speculative_tokens=4, speculative_disable_by_batch_size=None)
    if method == "draft":
        spec["speculative_model"] = str(path)
    tokens, stats = {}, {}
    for on in (False, True):
        engine = _engine(path, **options, **(spec if on else {}))
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), prompt, sp)
        tokens[on] = {rid: out.token_ids for rid, out in drain(engine).items()}
        stats[on] = engine.stats()
    assert tokens[True] == tokens[False]
    proposed, accepted = stats[True].spec_proposed_tokens, stats[True].spec_accepted_tokens
    assert proposed > 0 and accepted > 0
    if method == "draft":
        assert accepted / proposed > 0.9


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("backend", ["batched", "flex"])
def test_lora_adapters_on_cuda_match_peft(backend: str, tmp_path) -> None:
    """Two adapters (ranks 4 and 8, one on every projection, one on q and k only) and the base model mixed
    in one batch, against PEFT's merged models on the device, fp32; with flex the base-only decode
    iterations replay CUDA graphs and the others run eagerly."""
    import checkpoints
    from peft import PeftModel

    path = _flex_checkpoint("llama")
    adapters = {
        "a": checkpoints.make_lora_adapter(path, tmp_path / "a", 1, 4, LORA_TARGETS),
        "b": checkpoints.make_lora_adapter(path, tmp_path / "b", 2, 8, LORA_TARGETS[:2]),
    }
    engine = _engine(path, attention_backend=backend, enable_lora=True, max_loras=2, max_lora_rank=8,
                     lora_modules=",".join(f"{n}={p}" for n, p in adapters.items()), **SPEC_POOL)
    names = ["a", None, "b", None, "a", "b"]
    jobs = _workload(7, n=len(names))
    for i, ((prompt, n), name) in enumerate(zip(jobs, names)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                                                           lora_name=name))
    final = drain(engine)
    for i, ((prompt, n), name) in enumerate(zip(jobs, names)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name]).merge_and_unload()
        assert final[f"r{i}"].token_ids == _hf_greedy(model.to(DEVICE).eval(), prompt, n), (i, name)
    if backend == "flex" and CUDA:
        assert decode_graphs(engine.executor.worker) is not None and decode_graphs(engine.executor.worker).captured


def test_the_structured_output_mask_on_cuda_is_the_cpus() -> None:
    """The worker's bitmask (orca/worker/sampler.py apply_allowed_tokens) applied to device logits: the
    allowed tokens keep their logits, the others are -inf, past the mask's words too (a vocabulary that is
    not a multiple of 32)."""
    import numpy as np

    from orca.worker.sampler import apply_allowed_tokens

    rng = np.random.default_rng(0)
    vocab, rows = 1000, [0, 2, 3]
    bits = rng.random((len(rows), 992)) < 0.3  # the mask covers 992 tokens: 992..999 disallowed
    masks = [(row, np.packbits(b, bitorder="little").tobytes()) for row, b in zip(rows, bits)]
    logits = torch.randn(4, vocab)
    out = {}
    for device in ("cpu", DEVICE):
        x = logits.to(device)
        apply_allowed_tokens(x, masks)
        out[device] = x.cpu()
    assert torch.equal(out[DEVICE], out["cpu"])
    assert torch.equal(out[DEVICE][1], logits[1])
    for i, row in enumerate(rows):
        allowed = torch.from_numpy(np.concatenate([bits[i], np.zeros(8, bool)]))
        assert torch.equal(out[DEVICE][row][allowed], logits[row][allowed])
        assert torch.isneginf(out[DEVICE][row][~allowed]).all()
