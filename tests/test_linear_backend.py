"""EngineConfig.linear_backend: oneDNN-packed linears (orca/models/layers.py PackedLinear), alone (onednn) or
beside the checkpoint's weights (hybrid: F.linear from HYBRID_MIN_ROWS rows), give the numbers torch's
F.linear gives (fp32, 1e-4) in a mixed iteration, for both families with tied and untied heads and biases;
hybrid runs oneDNN's op below its row threshold and F.linear from it, eagerly and inside a compiled graph;
auto picks hybrid on this CPU for float32 when the second copy fits in memory, onednn when not, and falls
back where oneDNN cannot pack; greedy generation is identical with every backend."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoints import make_gpt2, make_llama
from torch import nn

from orca import LLM, EngineConfig, SamplingParams, tuning
from orca.models import layers
from orca.models.attention import AttentionMetadata
from orca.models.layers import PackedLinear, onednn_packs
from orca.worker import Worker
from orca.worker.cpu_graphs.views import graph_view
from orca.worker.resolution import resolve_linear_backend as resolve_with_reason

pytestmark = pytest.mark.skipif(not onednn_packs(torch.float32), reason="this torch has no oneDNN")

VARIANTS = [
    ("gpt2", {}),
    ("gpt2", {"tie_word_embeddings": False}),
    ("llama", {}),  # untied head, grouped-query attention
    ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
]
BUILDERS = {"gpt2": make_gpt2, "llama": make_llama}


@pytest.mark.parametrize(("family", "overrides"), VARIANTS, ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_packed_linears_match_reference_in_a_mixed_iteration(
    family: str, overrides: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # hybrid switches at 6 rows here: the 5-token prefix runs oneDNN's op, the 10-row iteration F.linear.
    monkeypatch.setattr(tuning, "HYBRID_MIN_ROWS", 6)
    path = BUILDERS[family](tmp_path / "ckpt", seed=5, **overrides)
    workers = {b: Worker(EngineConfig(model=str(path), block_size=4, n_slots=64, linear_backend=b))
               for b in ("reference", "onednn", "hybrid")}
    assert {b: w.linear_backend for b, w in workers.items()} == {b: b for b in workers}
    for backend in ("onednn", "hybrid"):
        packed = workers[backend].model
        # Every linear is packed, the head too (a packed copy of the embedding when tied); none in reference.
        assert not any(type(m) is nn.Linear for m in packed.modules())
        assert isinstance(packed.lm_head, PackedLinear)
        linears = [m for m in packed.modules() if isinstance(m, PackedLinear)]
        # hybrid keeps each checkpoint weight (the tied head: the embedding's own tensor, not a copy).
        assert all((m.weight is not None) == (backend == "hybrid") for m in linears)
        if backend == "hybrid" and packed.config.tie_word_embeddings:
            assert packed.lm_head.weight.data_ptr() == packed.input_embedding.weight.data_ptr()
    assert not any(isinstance(m, PackedLinear) for m in workers["reference"].model.modules())
    rng = random.Random(7)
    prompt, prefix, increment = ([rng.randrange(0, 190) for _ in range(n)] for n in (9, 5, 1))
    out = {}
    for backend, worker in workers.items():
        worker.init_kv_pool(16)
        with torch.inference_mode():
            # A cached prefix of 5 tokens, then one iteration: its increment + a whole 9-token prompt.
            worker.model(torch.tensor(prefix), torch.arange(5), AttentionMetadata.build([5], [0], [[0, 1]], 4,
                                                                                        worker.kv_pool))
            meta = AttentionMetadata.build([1, 9], [5, 0], [[0, 1], [4, 5, 6]], 4, worker.kv_pool)
            hidden = worker.model(torch.tensor(increment + prompt), torch.tensor([5, *range(9)]), meta)
            out[backend] = (hidden, worker.model.compute_logits(hidden))
    for backend in ("onednn", "hybrid"):
        torch.testing.assert_close(out[backend][0], out["reference"][0], atol=1e-4, rtol=0)
        torch.testing.assert_close(out[backend][1], out["reference"][1], atol=1e-4, rtol=0)
    assert out["reference"][1].abs().max() > 0.1  # the comparison is not of zeros


def _ops_run(fn) -> set[str]:  # noqa: ANN001
    """The matmul ops `fn()` ran (torch.profiler's names)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()} & {"mkldnn::_linear_pointwise", "aten::linear", "aten::addmm",
                                                    "aten::mm"}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_hybrid_runs_onednn_below_its_row_threshold_and_f_linear_from_it(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tuning, "HYBRID_MIN_ROWS", 8)
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 32), torch.randn(48)
    hybrid, onednn = PackedLinear(weight, bias, keep_weight=True), PackedLinear(weight, bias)
    run = torch.compile(graph_view(hybrid), dynamic=True) if compiled else hybrid  # (as the CPU graphs compile it)
    with torch.inference_mode():
        for rows, expected in ((1, "mkldnn"), (7, "mkldnn"), (8, "aten"), (40, "aten")):
            x = torch.randn(rows, 32)
            y = run(x)  # (compiled: the first call compiles, outside the profile)
            ops = _ops_run(lambda x=x: run(x))
            assert ops and all(op.startswith(expected) for op in ops), (rows, ops)
            torch.testing.assert_close(y, F.linear(x, weight, bias), atol=1e-5, rtol=0)
            assert _ops_run(lambda x=x: onednn(x)) == {"mkldnn::_linear_pointwise"}  # onednn: always its op


def test_greedy_generation_is_the_same_with_every_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tuning, "HYBRID_MIN_ROWS", 8)  # hybrid: the prompts' iteration on F.linear, decode on oneDNN
    path = make_llama(tmp_path / "ckpt", seed=2)
    rng = random.Random(3)
    prompts = [[rng.randrange(0, 190) for _ in range(n)] for n in (3, 12, 7, 1)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {b: [o.token_ids for o in LLM(str(path), max_bs=4, linear_backend=b).generate(prompts, greedy)]
              for b in ("reference", "onednn", "hybrid")}
    assert tokens["onednn"] == tokens["reference"] and tokens["hybrid"] == tokens["reference"]


def test_auto_and_explicit_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(layers, "available_memory_bytes", lambda: 8 << 30)
    # auto keeps the second copy when it takes at most a quarter of the available memory.
    assert resolve_linear_backend("auto", cpu, torch.float32, 2 << 30) == "hybrid"
    assert resolve_linear_backend("auto", cpu, torch.float32, (2 << 30) + 1) == "onednn"
    assert resolve_linear_backend("auto", cpu, torch.float32) == "onednn"  # the weights' size unknown
    assert resolve_linear_backend("hybrid", cpu, torch.float32, 64 << 30) == "hybrid"  # explicit: as asked
    assert resolve_linear_backend("onednn", cpu, torch.float32, 1) == "onednn"
    assert resolve_linear_backend("reference", cpu, torch.float32) == "reference"
    assert resolve_linear_backend("auto", cuda, torch.float32, 1) == "reference"  # cuBLAS on a GPU
    for choice in ("onednn", "hybrid"):
        with pytest.raises(ValueError, match=f"linear_backend {choice} cannot run device cuda"):
            resolve_linear_backend(choice, cuda, torch.float32)
    monkeypatch.setattr(layers, "available_memory_bytes", lambda: None)  # not Linux: no second copy
    assert resolve_linear_backend("auto", cpu, torch.float32, 1) == "onednn"
    monkeypatch.setattr(layers, "available_memory_bytes", lambda: 8 << 30)
    fp16 = onednn_packs(torch.float16)
    assert resolve_linear_backend("auto", cpu, torch.float16, 1) == ("hybrid" if fp16 else "reference")
    # bfloat16 packs only where the CPU has the instructions; auto then falls back to torch's matmul. Where
    # it packs, hybrid (a 16-bit model's quantized layers keep float copies; its float layers none).
    bf16 = onednn_packs(torch.bfloat16)
    assert resolve_linear_backend("auto", cpu, torch.bfloat16, 1) == ("hybrid" if bf16 else "reference")
    assert resolve_linear_backend("auto", cpu, torch.bfloat16, 4 << 30) == ("onednn" if bf16 else "reference")
    if not bf16:
        with pytest.raises(ValueError, match="cannot run torch.bfloat16 on this CPU.*use auto or reference"):
            resolve_linear_backend("onednn", cpu, torch.bfloat16)


def test_unknown_backend_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="linear_backend must be one of auto, hybrid, onednn, reference, got 'mkl'"):
        EngineConfig(linear_backend="mkl")


def test_auto_sizes_the_second_copy_from_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from safetensors.torch import load_file

    from orca.models.loader import checkpoint_bytes

    path = make_llama(tmp_path / "ckpt", seed=1)
    tensors = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert checkpoint_bytes(path, torch.float32) == sum(t.numel() * 4 for t in tensors.values())
    assert checkpoint_bytes(path, torch.bfloat16) == sum(t.numel() * 2 for t in tensors.values())
    assert Worker(EngineConfig(model=str(path), n_slots=64)).linear_backend == "hybrid"  # a tiny model fits
    monkeypatch.setattr(layers, "available_memory_bytes", lambda: checkpoint_bytes(path, torch.float32))
    assert Worker(EngineConfig(model=str(path), n_slots=64)).linear_backend == "onednn"  # it would not


def test_hybrid_keeps_float_weights_beside_the_packed_ones_in_float32_only(tmp_path: Path) -> None:
    """F.linear's prompt-sized edge over oneDNN was measured in float32 only (bfloat16 never won): a
    bfloat16 model under hybrid packs its float linears alone, as onednn does."""
    from orca.models.loader import load_model

    path = make_llama(tmp_path / "ckpt", seed=2)
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        if not onednn_packs(dtype):
            continue
        model, _ = load_model(path, dtype, cpu, linear_backend="hybrid")
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert packed and all((m.weight is not None) == (dtype == torch.float32) for m in packed), dtype


def resolve_linear_backend(*args: object) -> str:
    return resolve_with_reason(*args)[0]  # (the choice; its reason: tests/test_resolution.py)
