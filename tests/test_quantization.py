"""Quantized linear weights (orca/models/quantization.py, EngineConfig.quantization), against the float
weights they stand for:

1. The canonical form: quantize's error bounds per kind; sharding a quantized weight gives the quantized
   shard of the float weight; a group-wise int8 weight (GGUF's Q8_0) requantized per channel.
2. QuantizedLinear computes x W^T with W the dequantized weight (bfloat16 activations: to their rounding),
   with output rows padded to the int4 kernels' tile and a bias; the fp8 matmul (torch._scaled_mm, which a
   CPU build of torch also has) against its dequantized operands.
3. The engine, quantizing a float checkpoint at load (int8, int4): its logits are those of transformers
   on the dequantized checkpoint (within bfloat16 activation rounding), and int8 greedy tokens equal the
   dequantized model's; GPT-2 (Conv1D weights), a tied head (quantized copy), the compiled forward pass.
4. Bad options: each a clear error at load naming the option, the value and what would work.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _fixtures import _root, cpu_graphs, greedy_with_first_logits
from checkpoints import make_gpt2, make_llama
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from orca import EngineConfig, LLMEngine
from orca.models.layers import onednn_packs
from orca.models.loader import load_model
from orca.models.quantization import (
    FP8_DTYPE,
    QuantizedLinear,
    QuantizedWeight,
    _fp8_linear,
    quantize,
    shard_quantized,
)
from orca.parallel import COLUMN, ROW, VOCAB, head_shard, shard_tensor
from orca.tuning import HYBRID_QUANTIZED_MIN_ROWS

CPU = torch.device("cpu")
# Linear weights of the tiny checkpoints: every 2-D tensor but the embeddings (and GPT-2's positions).
NOT_LINEAR = ("embed_tokens", "wte", "wpe")


# -- 1. the canonical form ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,bound", [("int8", 0.5 / 127), ("int4", 0.5 / 15), ("fp8", 2**-4)])
def test_quantize_error_is_within_half_a_step(kind: str, bound: float) -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 256)
    q = quantize(w, kind, 32)
    err = (q.dequantize() - w).abs()
    if kind == "int4":  # half a step of each group's range
        span = w.view(48, 8, 32).amax(2) - w.view(48, 8, 32).amin(2)
        assert (err.view(48, 8, 32) <= (span * bound).unsqueeze(2) + 1e-6).all()
    elif kind == "int8":
        assert (err <= w.abs().amax(1, keepdim=True) * bound + 1e-6).all()
    else:  # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 (above its subnormals)
        assert (err <= w.abs() * bound + w.abs().amax(1, keepdim=True) / 448 * 2**-6).all()
    assert err.max() > 0  # the check can fail: the weight was really quantized


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("rule", [COLUMN, ROW, head_shard(16), VOCAB], ids=lambda r: r.kind)
def test_a_sharded_quantized_weight_is_the_shard_of_the_whole(kind: str, rule: object) -> None:
    torch.manual_seed(1)
    w = torch.randn(64 if rule is not VOCAB else 61, 128)
    q = quantize(w, kind, 32)
    for rank in range(2):
        piece = shard_quantized(q, rule, rank, 2)
        torch.testing.assert_close(piece.dequantize(), shard_tensor(q.dequantize(), rule, rank, 2), atol=0, rtol=0)


def test_a_row_split_that_cuts_a_group_is_refused() -> None:
    q = quantize(torch.randn(8, 64), "int4", 32)
    with pytest.raises(ValueError, match="groups of 32 do not divide"):
        shard_quantized(q, ROW, 0, 4)  # 16 columns per rank


def test_group_wise_int8_is_requantized_per_channel_within_half_a_step() -> None:
    torch.manual_seed(2)
    q8 = torch.randint(-127, 128, (16, 128), dtype=torch.int8)
    scales = torch.rand(16, 4) * 0.01 + 1e-3  # four Q8_0-style blocks of 32 per row
    grouped = QuantizedWeight("int8", q8, scales, None, 32)
    per_channel = grouped.to_per_channel()
    assert per_channel.per_channel and per_channel.scales.shape == (16, 1)
    err = (per_channel.dequantize() - grouped.dequantize()).abs()
    assert (err <= per_channel.scales / 2 + 1e-7).all() and err.max() > 0


# -- 2. the layer -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,cols", [("int8", 256), ("int8", 28), ("int4", 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_is_the_dequantized_matmul(kind: str, cols: int, dtype: torch.dtype) -> None:
    """Also where the kernels' tiles do not fit: 200 output rows (int4's are padded to 16s) and 28 input
    columns (int8's CPU kernel crashed on a remainder of 8: padded)."""
    torch.manual_seed(3)
    out = 200
    q = quantize(torch.randn(out, cols) * 0.05, kind, 64)
    bias = torch.randn(out)
    layer = QuantizedLinear(q, bias, CPU, dtype)
    x = torch.randn(2, 3, cols, dtype=dtype)
    y = layer(x)
    assert y.shape == (2, 3, out) and y.dtype == dtype
    # The kernels take bfloat16 activations: the reference rounds them alike, and multiplies in float32.
    expected = F.linear(x.bfloat16().float(), q.dequantize(), bias.to(dtype).float())
    torch.testing.assert_close(y.float(), expected, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_a_float_copy_large_iterations_multiply_the_dequantized_weight(kind: str, dtype: torch.dtype) -> None:
    """linear_backend hybrid: below HYBRID_QUANTIZED_MIN_ROWS[dtype] rows the int kernel, from there oneDNN
    on the dequantized weight in the model's dtype (float32 exact; bfloat16 as F.linear on its bfloat16
    copy)."""
    if not onednn_packs(dtype):
        pytest.skip(f"oneDNN packs no {dtype} on this CPU")
    torch.manual_seed(5)
    q = quantize(torch.randn(48, 128) * 0.05, kind, 32)
    plain = QuantizedLinear(q, None, CPU, dtype)
    hybrid = QuantizedLinear(q, None, CPU, dtype, float_copy=True)
    rows = HYBRID_QUANTIZED_MIN_ROWS[dtype][kind]
    measured = {torch.float32: {"int8": 8, "int4": 12}, torch.bfloat16: {"int8": 4, "int4": 6}}
    assert hybrid.float_min_rows == rows == measured[dtype][kind]
    small = torch.randn(rows - 1, 128).to(dtype)
    torch.testing.assert_close(hybrid(small), plain(small), atol=0, rtol=0)
    large = torch.randn(rows, 128).to(dtype)
    want = (large.float() @ q.dequantize(dtype).float().t()).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(hybrid(large), want, atol=tol, rtol=tol)
    if dtype == torch.float32:
        assert (plain(large) - want).abs().max() > 1e-4  # the int kernel's bfloat16 activations differ


def test_fp8_matmul_is_the_product_of_its_dequantized_operands() -> None:
    torch.manual_seed(4)
    q = quantize(torch.randn(32, 64), "fp8")
    x = torch.randn(5, 64)
    y = _fp8_linear(x, q.qweight, q.scales.view(1, -1), torch.float32)
    x_scale = x.abs().amax(1, keepdim=True) / 448
    x_fp8 = (x / x_scale).to(FP8_DTYPE).float() * x_scale  # the activations as the kernel sees them
    torch.testing.assert_close(y, x_fp8 @ q.dequantize().t(), atol=1e-4, rtol=1e-4)
    assert (y - x @ q.dequantize().t()).abs().max() > 0  # the activations were really quantized


# -- 3. the engine --------------------------------------------------------------------------------------------
def _checkpoint(family: str) -> Path:
    """Tiny checkpoints whose layer sizes int4's groups of 32 divide (intermediate 128)."""
    path = _root() / f"quant-{family}"
    if not (path / "config.json").is_file():
        if family == "llama":
            make_llama(path, intermediate_size=128)
        elif family == "llama-tied":
            make_llama(path, intermediate_size=128, tie_word_embeddings=True)
        else:
            make_gpt2(path)
    return path


def _dequantized_checkpoint(family: str, kind: str) -> Path:
    """The same checkpoint with every linear weight replaced by quantize(w).dequantize() (the LM head int8
    under int4, as the loader keeps it): what the quantized engine stands for. A tied head is quantized
    apart from its embedding (which stays float), so the reference unties them: its head is the
    dequantized embedding."""
    src = _checkpoint(family)
    path = _root() / f"quant-{family}-{kind}-dequantized"
    if (path / "config.json").is_file():
        return path
    path.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    if config.get("tie_word_embeddings", family == "gpt2"):
        embedding = "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"
        tensors["lm_head.weight"] = tensors[embedding].clone()
        (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    for name, t in tensors.items():
        if t.dim() == 2 and not any(n in name for n in NOT_LINEAR):
            conv1d = family == "gpt2" and "lm_head" not in name  # Conv1D: stored (in, out)
            w = t.t() if conv1d else t
            head_kind = "int8" if kind == "int4" and name == "lm_head.weight" else kind  # the head stays wider
            d = quantize(w, head_kind, 32).dequantize()
            tensors[name] = (d.t() if conv1d else d).contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


PROMPTS = [[random.Random(i).randrange(0, 190) for _ in range(n)] for i, n in enumerate((5, 11, 3))]


def _engine_logits(path: Path, **options: object) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and the first token's logits of each prompt, through a new engine."""
    return _run(LLMEngine(EngineConfig(model=str(path), dtype="float32", **options)))


def _run(engine: LLMEngine) -> tuple[list[list[int]], list[torch.Tensor]]:
    return greedy_with_first_logits(engine, PROMPTS, max_tokens=8)


@pytest.mark.parametrize("family", ["llama", "gpt2", "llama-tied"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_quantized_engine_computes_the_dequantized_model(family: str, kind: str) -> None:
    # linear_backend onednn: the int kernels at every row count (hybrid's float copies take prompts)
    tokens, logits = _engine_logits(_checkpoint(family), quantization=kind, linear_backend="onednn")
    ref = AutoModelForCausalLM.from_pretrained(_dequantized_checkpoint(family, kind), dtype=torch.float32).eval()
    for prompt, row in zip(PROMPTS, logits):
        with torch.inference_mode():
            expected = ref(torch.tensor([prompt])).logits[0, -1]
        # bfloat16 activations into each quantized layer: a few hundredths on logits spread over tens
        scale = expected.abs().max().item()
        torch.testing.assert_close(row, expected, atol=0.02 * scale, rtol=0)
    float_tokens, float_logits = _engine_logits(_checkpoint(family), quantization="none")
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(logits, float_logits))  # quantization did something
    # Greedy tokens equal the dequantized model's where its choices are clear of bfloat16 rounding: the
    # tiny Llama's head is scaled for that (tests/checkpoints.py); the tiny GPT-2's top two logits come
    # within 0.04 of each other by the third token, under the ~0.1 the activations' rounding moves them.
    if kind == "int8" and family == "llama":
        deq_tokens, _ = _engine_logits(_dequantized_checkpoint(family, kind), quantization="none")
        assert tokens == deq_tokens


def test_under_int4_the_head_is_int8() -> None:
    model, _ = load_model(_checkpoint("llama"), torch.float32, CPU, quantization="int4")
    assert model.lm_head.kind == "int8" and model.layers[0].qkv_proj.kind == "int4"
    tied, _ = load_model(_checkpoint("llama-tied"), torch.float32, CPU, quantization="int4")
    assert tied.lm_head.kind == "int8"


def test_a_tied_head_gets_a_quantized_copy_and_the_embedding_stays_float() -> None:
    model, _ = load_model(_checkpoint("llama-tied"), torch.float32, CPU, quantization="int8")
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.kind == "int8"
    assert model.embed_tokens.weight.dtype == torch.float32
    kinds = {m.kind for m in model.modules() if isinstance(m, QuantizedLinear)}
    assert kinds == {"int8"}
    assert not any(type(m) is torch.nn.Linear for m in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_forward_pass_gives_the_eager_tokens(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The quantized kernels inside the compiled graph (the suite's $ORCA_TORCH_COMPILE=off lifted), with
    linear_backend hybrid: two graphs compiled at load, the int kernels' and the float copies' (from 12 rows
    of int4 layers in float32, 6 in bfloat16: the float view's graph), each taking the iterations of its row counts;
    every guard run and no compilation after load."""
    if not onednn_packs(dtype):
        pytest.skip(f"oneDNN packs no {dtype} on this CPU")
    options = dict(model=str(_checkpoint("llama")), dtype=str(dtype).removeprefix("torch."), quantization="int4",
                   linear_backend="hybrid")
    lone = [PROMPTS[0]]  # alone: one-row iterations
    eager = LLMEngine(EngineConfig(**options, torch_compile="off"))
    want = _run(eager), greedy_with_first_logits(eager, lone, max_tokens=4)
    monkeypatch.delenv("ORCA_TORCH_COMPILE")
    engine = LLMEngine(EngineConfig(**options))
    compiled = cpu_graphs(engine.executor.worker)
    assert compiled is not None and compiled.ready
    assert compiled.float_rows == (12 if dtype == torch.float32 else 6)
    compiled.stance, compiled.all_guards = "fail_on_recompile", True
    graphs: list[tuple[int, bool]] = []

    def recording(graph: Any, floats: bool) -> Any:
        def call(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
            graphs.append((input_ids.shape[0], floats))
            return graph(input_ids, *args)
        return call

    compiled.compiled = recording(compiled.compiled, False)
    compiled.compiled_float = recording(compiled.compiled_float, True)
    got = _run(engine), greedy_with_first_logits(engine, lone, max_tokens=4)
    assert {on for _, on in graphs} == {False, True}
    assert all(on == (rows >= compiled.float_rows) for rows, on in graphs)
    for (tokens, logits), (want_tokens, want_logits) in zip(got, want):
        assert tokens == want_tokens
        for g, w in zip(logits, want_logits):
            torch.testing.assert_close(g, w, atol=1e-2 if dtype == torch.float32 else 5e-2, rtol=0)


# -- 4. bad options -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options,message", [
    ({"quantization": "int3"}, "quantization must be one of auto, none, int8, int4, fp8, got 'int3'"),
    ({"quantization_group_size": 48}, "quantization_group_size must be one of 32, 64, 128, 256, got 48"),
    ({"kv_cache_dtype": "fp16"}, "kv_cache_dtype must be one of auto, fp8_e4m3, int8"),
])
def test_bad_values_are_refused_with_what_would_work(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        EngineConfig(**options)


def test_fp8_on_a_cpu_is_refused_at_load() -> None:
    with pytest.raises(ValueError, match="fp8 runs on CUDA GPUs of compute capability 8.9 or later only.*"
                                         "use int8, int4 or none"):
        LLMEngine(EngineConfig(model=str(_checkpoint("llama")), quantization="fp8"))


def test_a_group_size_the_layers_do_not_divide_is_refused_at_load(tmp_path: Path) -> None:
    path = make_llama(tmp_path / "m", intermediate_size=112)  # down_proj: 112 input columns
    with pytest.raises(ValueError, match=r"quantization int4, model.layers.0.mlp.down_proj.weight: int4 group size "
                                         r"\(quantization_group_size\) 32 does not divide the layer's 112 input "
                                         "columns: no int4 group size divides it; use int8 or none"):
        load_model(path, torch.float32, CPU, quantization="int4")
    model, _ = load_model(path, torch.float32, CPU, quantization="int8")  # per channel: any size
    assert isinstance(model.layers[0].down_proj, QuantizedLinear)


def test_from_parameters_reads_the_quantization_options() -> None:
    cfg = EngineConfig.from_parameters({"quantization": "int4", "quantization_group_size": "64",
                                        "kv_cache_dtype": "fp8_e4m3"})
    assert (cfg.quantization, cfg.quantization_group_size, cfg.kv_cache_dtype) == ("int4", 64, "fp8_e4m3")


@pytest.mark.parametrize("device, warns", [("cuda", True), ("cpu", False)])
def test_int8_on_cuda_is_planned_with_the_measured_warning(device: str, warns: bool,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """int8 runs on CUDA through torch's int8 weight-only kernel, measured far slower than bfloat16 on an
    H200: the load says so and names the faster kinds (the plan itself needs no GPU)."""
    from orca.models.loader import plan_quantization

    with caplog.at_level("WARNING", logger="orca.loader"):
        plan = plan_quantization("int8", None, torch.device(device))
    assert plan.kind == "int8"
    assert ("0.22x bfloat16" in caplog.text and "fp8" in caplog.text) == warns
    caplog.clear()
    with caplog.at_level("WARNING", logger="orca.loader"):
        plan_quantization("int4", None, torch.device(device))
    assert caplog.text == ""
