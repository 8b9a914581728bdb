"""Every quantized checkpoint format orca reads (orca/models/quantized_checkpoints.py), end to end through
the engine (orca.LLMEngine, EngineConfig.quantization), on one tiny random llama (64 hidden, 128
intermediate, 4 heads, 2 KV heads, 2 layers, vocabulary 128, its head scaled up so that greedy choices are
well apart) packed as AWQ, GPTQ (v1 and v2), compressed-tensors FP8 and a llama GGUF file mixing Q4_0, Q4_1
and Q8_0 (converted by the engine itself, as a .gguf model is). Each has a float reference: the same
checkpoint with every quantized weight replaced by its reader's get(name).dequantize(), served by
transformers.

1. quantization auto keeps each stored weight in its own kind: the linear layers are QuantizedLinear of the
   stored kind and group size, and the logits are transformers' on the reference within the bfloat16
   rounding of the activations the CPU kernels take (as tests/test_quantization.py measures it).
2. quantization none dequantizes at load: the float weights are the reference's exactly, the logits
   transformers' to float32 rounding.
3. quantization int8 on int4 (and fp8) checkpoints requantizes them: the model loads, every linear int8,
   and generates.
4. FP8 weights under quantization auto on a CPU: a clear error at load; none and int8 serve them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from _fixtures import greedy_with_first_logits
from checkpoints import gguf_writer
from safetensors.torch import load_file, save_file
from test_quantized_checkpoints import LAYERS, awq_format, fp8_format, gptq_format, quantized_copy
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from orca import EngineConfig, LLMEngine
from orca.checkpoint import resolve_checkpoint
from orca.models.llama import LlamaModel
from orca.models.quantization import QuantizedLinear
from orca.models.quantized_checkpoints import open_quantized_checkpoint

SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64, "bos_token_id": 1,
         "eos_token_id": 2, "tie_word_embeddings": False}
PROMPTS = [[random.Random(i).randrange(0, 128) for _ in range(n)] for i, n in enumerate((5, 11, 3))]
MAX_TOKENS = 6
T = gguf.GGMLQuantizationType
# The GGUF file's types: fused projections (q|k|v, gate|up) share one, as llama.cpp's own mixes do, but for
# layer 1's q|k|v (Q8_0, Q8_0, Q4_0): one layer, one kernel, so its v is requantized to int8 (the widest).
GGUF_TYPES = {
    "token_embd": T.Q8_0, "output": T.Q8_0,
    "blk.0.attn_q": T.Q4_0, "blk.0.attn_k": T.Q4_0, "blk.0.attn_v": T.Q4_0, "blk.0.attn_output": T.Q4_1,
    "blk.0.ffn_gate": T.Q4_1, "blk.0.ffn_up": T.Q4_1, "blk.0.ffn_down": T.Q8_0,
    "blk.1.attn_q": T.Q8_0, "blk.1.attn_k": T.Q8_0, "blk.1.attn_v": T.Q4_0, "blk.1.attn_output": T.Q4_0,
    "blk.1.ffn_gate": T.Q4_0, "blk.1.ffn_up": T.Q4_0, "blk.1.ffn_down": T.Q4_1,
}
INT4_FORMATS = ("awq", "gptq", "gptq_v2", "gguf")
FORMATS = (*INT4_FORMATS, "fp8")


def _layers(kinds: dict[str, tuple[str, int]]) -> dict[str, tuple[str, int]]:
    """{our layer: (kind, group size)} for both blocks, from {qkv_proj: ..., o_proj: ..., ...}."""
    return {f"layers.{i}.{name}": kind for i in range(LAYERS) for name, kind in kinds.items()}


# What auto makes of each format's linears: (kind, group size); int8 is per output channel (QuantizedLinear
# requantizes GGUF's groups of 32: its group size is then the layer's input columns).
EXPECTED_AUTO = {
    "awq": _layers({"qkv_proj": ("int4", 32), "o_proj": ("int4", 32), "gate_up_proj": ("int4", 32),
                    "down_proj": ("int4", 32)}),
    "gptq": _layers({"qkv_proj": ("int4", 32), "o_proj": ("int4", 32), "gate_up_proj": ("int4", 32),
                     "down_proj": ("int4", 32)}),
    "gptq_v2": _layers({"qkv_proj": ("int4", 64), "o_proj": ("int4", 64), "gate_up_proj": ("int4", 64),
                        "down_proj": ("int4", 128)}),  # group_size -1: one group per row
    "gguf": {"layers.0.qkv_proj": ("int4", 32), "layers.0.o_proj": ("int4", 32),
             "layers.0.gate_up_proj": ("int4", 32), "layers.0.down_proj": ("int8", 128),
             "layers.1.qkv_proj": ("int8", 64), "layers.1.o_proj": ("int4", 32),
             "layers.1.gate_up_proj": ("int4", 32), "layers.1.down_proj": ("int4", 32),
             "lm_head": ("int8", 64)},
}


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The GGUF file is converted into a cache of this module's own, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORCA_CACHE_DIR", str(tmp_path_factory.mktemp("orca-cache")))
        yield


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SIZES)).eval()
    with torch.no_grad():  # random init gives near-uniform logits: sharpen them, as tests/checkpoints.py does
        model.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("float-llama")
    model.save_pretrained(path)
    return path


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of attn_q / attn_k rows (transformers undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(hf_dir: Path, out: Path) -> Path:
    """A llama GGUF file of `hf_dir` as llama.cpp's converter writes one (names, q/k rows permuted), its
    linear weights and embeddings quantized to GGUF_TYPES (the gguf package's reference quantizers), the
    norms F32, with a small byte-pair tokenizer (letters and their pairs) for transformers to convert."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf_writer(cfg, out, "llama", gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    for name, t in load_file(hf_dir / "model.safetensors").items():
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        assert gguf_name, f"no GGUF name for {name}"
        base = gguf_name.removesuffix(".weight")
        data = t.float().numpy()
        if base.endswith(("attn_q", "attn_k")):
            data = _permute(data, heads if base.endswith("attn_q") else kv_heads)
        qtype = GGUF_TYPES.get(base, T.F32)
        if qtype == T.F32:
            w.add_tensor(f"{base}.weight", data)
        else:
            w.add_tensor(f"{base}.weight", gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def dequantized_reference(checkpoint: Path, names: set[str], out: Path) -> Path:
    """`checkpoint` as a float Hugging Face checkpoint with the tensors `names` (the float model's): each
    one its reader stores quantized as get(name).dequantize(), the others as the checkpoint has them."""
    reader = open_quantized_checkpoint(checkpoint)
    assert reader is not None
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(f))
    quantized = {n for n in names if reader.kind_of(n) is not None}
    assert len(quantized) >= 2 * 7, quantized  # every projection of both blocks at least
    reference = {n: reader.get(n).dequantize() if n in quantized else tensors[n] for n in names}  # type: ignore[union-attr]
    out.mkdir()
    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    save_file({n: t.contiguous() for n, t in reference.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def checkpoints(float_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per format: (what EngineConfig.model is given, the dequantized float reference checkpoint)."""
    root = tmp_path_factory.mktemp("formats")
    names = set(load_file(float_llama / "model.safetensors"))
    formats = {"awq": awq_format(32), "gptq": gptq_format("gptq", 32, True),
               "gptq_v2": gptq_format("gptq_v2", -1, False), "fp8": fp8_format("channel")}
    built = {}
    for fmt, (qcfg, pack) in formats.items():
        path = root / fmt
        quantized_copy(float_llama, path, qcfg, pack)
        built[fmt] = (path, dequantized_reference(path, names, root / f"{fmt}-reference"))
    (root / "gguf").mkdir()
    gguf_file = write_llama_gguf(float_llama, root / "gguf" / "tiny-llama.gguf")
    converted = resolve_checkpoint(gguf_file)  # what the engine converts it into (its reader reads that)
    built["gguf"] = (gguf_file, dequantized_reference(converted, names, root / "gguf-reference"))
    return built


def run(engine: LLMEngine) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and the first token's logits of each prompt."""
    return greedy_with_first_logits(engine, PROMPTS, MAX_TOKENS)


def engine(model: Path, quantization: str, **options: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", quantization=quantization, **options))


def quantized_layers(e: LLMEngine) -> dict[str, tuple[str, int]]:
    return {name: (m.kind, m.group_size) for name, m in e.executor.worker.model.named_modules()
            if isinstance(m, QuantizedLinear)}


@torch.inference_mode()
def reference_logits(reference: Path) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    return [model(torch.tensor([p])).logits[0, -1] for p in PROMPTS]


@pytest.fixture(scope="module")
def float_logits(float_llama: Path) -> list[torch.Tensor]:
    return reference_logits(float_llama)


@pytest.mark.parametrize("fmt", INT4_FORMATS)
def test_auto_serves_the_stored_weights_as_the_dequantized_model(
    fmt: str, checkpoints: dict[str, tuple[Path, Path]], float_logits: list[torch.Tensor]
) -> None:
    model, reference = checkpoints[fmt]
    e = engine(model, "auto", linear_backend="onednn")  # the int kernels at every row count (no float copies)
    assert quantized_layers(e) == EXPECTED_AUTO[fmt]
    tokens, logits = run(e)
    assert all(len(t) == MAX_TOKENS for t in tokens)
    for row, expected, unquantized in zip(logits, reference_logits(reference), float_logits):
        # bfloat16 activations into each quantized layer: a few thousandths of the largest logit here
        scale = expected.abs().max().item()
        torch.testing.assert_close(row, expected, atol=0.02 * scale, rtol=0)
        # ... while the quantization moved the logits of the float model it came from much further (about
        # a tenth): the tolerance tells the stored weights from others
        assert (unquantized - expected).abs().max() > 0.04 * scale


@pytest.mark.parametrize("fmt", FORMATS)
def test_none_serves_the_dequantized_weights(fmt: str, checkpoints: dict[str, tuple[Path, Path]]) -> None:
    model, reference = checkpoints[fmt]
    e = engine(model, "none", linear_backend="hybrid")  # oneDNN-packed linears that keep their weights
    assert quantized_layers(e) == {}
    ours = e.executor.worker.model
    ref = load_file(reference / "model.safetensors")
    weights = {**dict(ours.named_parameters()), **dict(ours.named_buffers())}
    for name, sources in LlamaModel.hf_weight_map(ours.config).items():
        expected = torch.cat([ref[s.name] for s in sources])
        assert torch.equal(weights[name].detach(), expected), name
    _, logits = run(e)
    for row, expected in zip(logits, reference_logits(reference)):
        torch.testing.assert_close(row, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fmt", ["awq", "gptq_v2", "gguf", "fp8"])
def test_int8_requantizes_the_stored_weights(fmt: str, checkpoints: dict[str, tuple[Path, Path]]) -> None:
    e = engine(checkpoints[fmt][0], "int8")
    layers = quantized_layers(e)
    assert {kind for kind, _ in layers.values()} == {"int8"}
    assert set(layers) == {f"layers.{i}.{n}" for i in range(LAYERS)
                           for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")} | {"lm_head"}
    tokens, _ = run(e)
    assert all(len(t) == MAX_TOKENS for t in tokens)


def test_fp8_weights_under_auto_are_refused_on_a_cpu(checkpoints: dict[str, tuple[Path, Path]]) -> None:
    with pytest.raises(ValueError, match=r"this compressed-tensors checkpoint holds fp8 weights \(quantization "
                                         r"auto\): quantization fp8 runs on CUDA .*int8, int4 and none dequantize"):
        engine(checkpoints["fp8"][0], "auto")
