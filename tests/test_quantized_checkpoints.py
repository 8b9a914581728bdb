"""Readers of quantized checkpoints (orca/models/quantized_checkpoints.py): each format's weights, packed
here from a tiny random llama the way each format's writer packs them (AutoAWQ, AutoGPTQ/GPTQModel,
compressed-tensors, llama.cpp's gguf package), come back as QuantizedWeight whose dequantization is the
format's own formula applied to the packed integers; and the shipped SmolLM2 GGUF file's weights, unpacked
from its blocks at conversion, equal what transformers dequantized into the converted directory, and are
read back without parsing the GGUF file."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from orca.checkpoint import (
    CONVERTED_FORMAT,
    GGUF_QUANTIZED_FILE,
    GGUF_SOURCE_FILE,
    default_model_path,
    gguf_source,
    resolve_checkpoint,
    write_gguf_quantized,
)
from orca.models.gguf_checkpoint import pack_int4, unpack_int4
from orca.models.quantized_checkpoints import open_quantized_checkpoint

LAYERS = 2
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LINEARS = [f"model.layers.{i}.{p}.weight" for i in range(LAYERS) for p in PROJECTIONS]
FLOATS = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
          "model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"]
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map: nibble i holds output AWQ_PACK_ORDER[i] of 8
Packer = Callable[[torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random llama (64 hidden, 128 intermediate, 4 heads, 2 KV heads, 2 layers), saved as transformers
    saves it (one model.safetensors)."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def quantized_copy(src: Path, dst: Path, qcfg: dict, pack: Packer) -> dict[str, torch.Tensor]:
    """`src` with each linear weight x.weight replaced by the tensors pack(weight) names (relative to x),
    and config.json's quantization_config; returns each weight's reference dequantization."""
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg}))
    tensors = load_file(src / "model.safetensors")
    references = {}
    for name in LINEARS:
        packed, references[name] = pack(tensors.pop(name))
        layer = name.removesuffix(".weight")
        tensors.update({f"{layer}.{suffix}": t for suffix, t in packed.items()})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return references


def check_reader(checkpoint: Path, fmt: str, kind: str, references: dict[str, torch.Tensor],
                 stored: bool = True) -> None:
    """Every linear weight dequantizes exactly to its reference; the float tensors are not the reader's."""
    reader = open_quantized_checkpoint(checkpoint)
    assert reader is not None and reader.format == fmt
    assert reader.kinds() == {kind}
    assert reader.stored_names() == (set(references) if stored else set())
    for name, reference in references.items():
        weight = reader.get(name)
        assert weight is not None and weight.kind == kind and weight.shape == reference.shape, name
        assert torch.equal(weight.dequantize(), reference), name
    for name in FLOATS:
        assert reader.get(name) is None, name


# -- int4 in groups along the inputs (AWQ, GPTQ) ---------------------------------------------------------
def int4_groups(w: torch.Tensor, group: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (out, in) quantized as AutoAWQ / AutoGPTQ do it: per group of `group` inputs a float16 scale and
    an integer zero point; values q = clamp(round(w / s) + z, 0, 15). Returns q (out, in), z and s
    (in / group, out), the layout of their qzeros and scales."""
    out, cols = w.shape
    g = w.float().view(out, cols // group, group)
    if symmetric:  # GPTQ sym: zero point 8, range -amax..amax
        s = (g.abs().amax(-1) * 2 / 15).clamp(min=1e-5).half()
        z = torch.full_like(s, 8, dtype=torch.int64)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        s = ((hi - lo) / 15).clamp(min=1e-5).half()
        z = (-lo / s.float()).round().clamp(0, 15).long()
    q = (g / s.float().unsqueeze(-1) + z.unsqueeze(-1)).round().clamp(0, 15).long().view(out, cols)
    return q, z.t().contiguous(), s.t().contiguous()


def int4_reference(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    """w = (q - z) * s, both formats' dequantization, in float32; z and s (in / group, out)."""
    return (q - z.t().repeat_interleave(group, dim=1)).float() * s.t().float().repeat_interleave(group, dim=1)


def pack_nibbles(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """(rows, cols) integers in [0, 15] -> int32 (rows, cols / 8): word j's nibble i (bits 4i..4i+3) holds
    column 8j + order[i]."""
    v = values.view(values.shape[0], -1, 8)[..., order].numpy().astype(np.uint32)
    words = np.zeros(v.shape[:2], dtype=np.uint32)
    for i in range(8):
        words |= v[..., i] << np.uint32(4 * i)
    return torch.from_numpy(words.view(np.int32))


# Each format's quantization_config and packer (shared with tests/test_quantized_formats_e2e.py).
def awq_format(group: int) -> tuple[dict, Packer]:
    """AutoAWQ's GEMM layout, asymmetric, in groups of `group` inputs."""
    def pack(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q, z, s = int4_groups(w, group, symmetric=False)
        packed = {"qweight": pack_nibbles(q.t().contiguous(), AWQ_PACK_ORDER),  # (in, out / 8)
                  "qzeros": pack_nibbles(z, AWQ_PACK_ORDER), "scales": s}
        return packed, int4_reference(q, z, s, group)

    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}, pack


def gptq_format(checkpoint_format: str, group_size: int, symmetric: bool) -> tuple[dict, Packer]:
    """AutoGPTQ's (checkpoint_format "gptq": zero points stored minus 1) or GPTQModel's ("gptq_v2")
    layout, in groups of `group_size` inputs (-1: one group per row), without act-order."""
    def pack(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        cols = w.shape[1]
        group = cols if group_size == -1 else group_size
        q, z, s = int4_groups(w, group, symmetric)
        stored_zeros = z - 1 if checkpoint_format == "gptq" else z  # v1 stores zero points minus 1
        packed = {"qweight": pack_nibbles(q, list(range(8))).t().contiguous(),  # (in / 8, out)
                  "qzeros": pack_nibbles(stored_zeros, list(range(8))), "scales": s,
                  "g_idx": (torch.arange(cols) // group).int()}
        return packed, int4_reference(q, z, s, group)

    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": symmetric,
            "checkpoint_format": checkpoint_format}
    return qcfg, pack


def fp8_format(strategy: str) -> tuple[dict, Packer]:
    """compressed-tensors FP8 (llm-compressor's FP8 scheme: static input scales, which we do not use),
    weight scales per channel or per tensor, lm_head left float."""
    def pack(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
        scale = (amax / 448).float()  # (out, 1) or (1,)
        q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        packed = {"weight": q, "weight_scale": scale, "input_scale": torch.ones(1)}
        return packed, q.float() * scale

    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    qcfg = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": {**weights, "strategy": "tensor"}}}}
    return qcfg, pack


def test_awq(tiny_llama: Path, tmp_path: Path) -> None:
    qcfg, pack = awq_format(32)
    check_reader(tmp_path / "awq", "awq", "int4", quantized_copy(tiny_llama, tmp_path / "awq", qcfg, pack))


@pytest.mark.parametrize("checkpoint_format, group_size, symmetric",
                         [("gptq", 32, True), ("gptq_v2", 32, False), ("gptq_v2", -1, False)])
def test_gptq(tiny_llama: Path, tmp_path: Path, checkpoint_format: str, group_size: int, symmetric: bool) -> None:
    qcfg, pack = gptq_format(checkpoint_format, group_size, symmetric)
    check_reader(tmp_path / "gptq", "gptq", "int4", quantized_copy(tiny_llama, tmp_path / "gptq", qcfg, pack))


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_fp8(tiny_llama: Path, tmp_path: Path, strategy: str) -> None:
    qcfg, pack = fp8_format(strategy)
    path = tmp_path / "fp8"
    check_reader(path, "compressed-tensors", "fp8", quantized_copy(tiny_llama, path, qcfg, pack))


# -- GGUF ------------------------------------------------------------------------------------------------
def _no_gguf_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a load parsed the GGUF file")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(gguf.gguf_reader, "GGUFReader", refuse)


def test_shipped_gguf_matches_the_converted_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2's Q4_1 blocks (and the Q8_0 embedding), unpacked at conversion with llama.cpp's q/k row
    permutation undone, equal the float tensors transformers wrote into the converted directory: the name
    mapping, the permutation and the formulas are transformers' own. Reading them back never parses the
    GGUF file (its reader takes seconds on the tokenizer's arrays)."""
    checkpoint = resolve_checkpoint(None)
    marker = json.loads((checkpoint / GGUF_SOURCE_FILE).read_text())
    assert {k: marker[k] for k in ("path", "size", "mtime_ns")} == gguf_source(default_model_path())
    assert marker["converted_format"] == CONVERTED_FORMAT and marker["architecture"] == "llama"
    assert marker["quantized"] == GGUF_QUANTIZED_FILE and marker["dequantized_only"] == {}
    # The loader's float weights are the directory's *.safetensors: the quantized file is not among them.
    assert [f.name for f in checkpoint.glob("*.safetensors")] == ["model.safetensors"]
    _no_gguf_parsing(monkeypatch)
    reader = open_quantized_checkpoint(checkpoint)
    assert reader is not None and reader.format == "gguf"
    assert reader.kinds() == {"int4", "int8"}
    assert reader.stored_names() == set()  # the converted directory holds every weight dequantized too
    names = ["model.embed_tokens.weight"] + [f"model.layers.{i}.{p}.weight" for i in (0, 29) for p in PROJECTIONS]
    with safe_open(checkpoint / "model.safetensors", framework="pt") as converted:
        for name in names:
            weight = reader.get(name)
            assert weight is not None and weight.group_size == 32, name
            assert weight.kind == ("int8" if "embed" in name else "int4"), name
            assert torch.equal(weight.dequantize(), converted.get_tensor(name)), name
    for name in ("lm_head.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert reader.get(name) is None, name  # tied head; F32 norms


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]) -> Path:
    """A GGUF file of one block, 4 heads and 2 KV heads, holding `tensors` (float data, quantized here with
    the gguf package's reference quantizers; or raw bytes for types it cannot quantize)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    for name, (data, qtype) in tensors.items():
        raw = data if data.dtype == np.uint8 else gguf.quants.quantize(data, qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def converted_dir(path: Path, gguf_path: Path) -> Path:
    """A stand-in for convert_gguf's directory: what the reader needs of it (write_gguf_quantized:
    GGUF_QUANTIZED_FILE and GGUF_SOURCE_FILE), not transformers' float weights."""
    path.mkdir()
    write_gguf_quantized(gguf_path, path)
    return path


def test_tiny_gguf_types_and_permutation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Q8_0, Q4_0 and Q4_1 against the gguf package's own dequantization, with transformers' reverse
    permutation of attn_q (4 heads) and attn_k (2 KV heads), written at conversion (int4 two values a
    byte) and read back without the GGUF file's reader; F16 and F32 tensors are left as floats."""
    rng = np.random.default_rng(0)
    T = gguf.GGMLQuantizationType
    types = {"token_embd.weight": ((128, 64), T.Q8_0), "blk.0.attn_q.weight": ((64, 64), T.Q4_0),
             "blk.0.attn_k.weight": ((32, 64), T.Q4_1), "blk.0.attn_v.weight": ((32, 64), T.Q4_1),
             "blk.0.ffn_down.weight": ((64, 128), T.F16), "blk.0.attn_norm.weight": ((64,), T.F32)}
    tensors = {name: (rng.standard_normal(shape).astype(np.float32), qtype) for name, (shape, qtype) in types.items()}
    gguf_path = write_gguf(tmp_path / "tiny.gguf", "llama", tensors)
    converted = converted_dir(tmp_path / "converted", gguf_path)
    with safe_open(converted / GGUF_QUANTIZED_FILE, framework="pt") as f:
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight.qweight").get_shape() == [64, 32]
        assert f.get_slice("model.embed_tokens.weight.qweight").get_dtype() == "I8"
    _no_gguf_parsing(monkeypatch)
    reader = open_quantized_checkpoint(converted)
    assert reader is not None and reader.kinds() == {"int8", "int4"}
    processor = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    expected = {"token_embd.weight": ("model.embed_tokens.weight", "int8"),
                "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight", "int4"),
                "blk.0.attn_k.weight": ("model.layers.0.self_attn.k_proj.weight", "int4"),
                "blk.0.attn_v.weight": ("model.layers.0.self_attn.v_proj.weight", "int4")}
    for gguf_name, (hf_name, kind) in expected.items():
        data, qtype = tensors[gguf_name]
        dequantized = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)
        reference = torch.from_numpy(processor.process(dequantized, gguf_name).weights.copy())
        weight = reader.get(hf_name)
        assert weight is not None and weight.kind == kind and weight.group_size == 32, hf_name
        assert torch.equal(weight.dequantize(), reference), hf_name
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight"):
        assert reader.get(name) is None, name


def test_int4_packing_round_trips() -> None:
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (3, 32) and packed[0, 0] == q[0, 0] | q[0, 1] << 4
    assert torch.equal(unpack_int4(packed), q)


def test_gguf_types_we_do_not_read_are_served_from_the_float_weights(tmp_path: Path) -> None:
    """A K-quant tensor (and any quantized type but Q8_0, Q4_0, Q4_1) is left to the converted
    directory's float weights, which transformers dequantized: get() and kind_of() are None for it, the
    marker lists it; the file's other tensors are read quantized. A GGUF of another architecture, or
    without a tensor we read, writes no quantized file: its reader is None."""
    weights = np.ones((4, 256), dtype=np.float32)
    k_quant = np.zeros((4, 144), dtype=np.uint8)  # 4 rows of one 256-value Q4_K block (144 bytes)
    T = gguf.GGMLQuantizationType
    mixed = write_gguf(tmp_path / "k.gguf", "llama", {"blk.0.attn_q.weight": (k_quant, T.Q4_K),
                                                       "blk.0.attn_k.weight": (weights, T.Q4_0)})
    converted = converted_dir(tmp_path / "k", mixed)
    marker = json.loads((converted / GGUF_SOURCE_FILE).read_text())
    assert marker["dequantized_only"] == {"blk.0.attn_q.weight": "Q4_K"}
    reader = open_quantized_checkpoint(converted)
    assert reader is not None and reader.kinds() == {"int4"}
    assert reader.kind_of("model.layers.0.self_attn.q_proj.weight") is None
    assert reader.get("model.layers.0.self_attn.q_proj.weight") is None
    assert reader.kind_of("model.layers.0.self_attn.k_proj.weight") == "int4"
    only_k = write_gguf(tmp_path / "only-k.gguf", "llama", {"blk.0.attn_q.weight": (k_quant, T.Q4_K)})
    assert open_quantized_checkpoint(converted_dir(tmp_path / "only-k", only_k)) is None
    qwen = write_gguf(tmp_path / "qwen.gguf", "qwen2", {"blk.0.attn_q.weight": (weights, T.Q4_0)})
    converted = converted_dir(tmp_path / "qwen", qwen)
    assert not (converted / GGUF_QUANTIZED_FILE).exists()
    assert open_quantized_checkpoint(converted) is None


def test_gguf_refusals(tmp_path: Path) -> None:
    """A directory converted by an orca that wrote another format (no quantized file: it read the GGUF
    at each load), or from a GGUF changed or gone since its conversion, is refused."""
    weights = np.ones((8, 256), dtype=np.float32)  # 4 heads of 2 rows
    q4_0 = gguf.GGMLQuantizationType.Q4_0
    llama = write_gguf(tmp_path / "llama.gguf", "llama", {"blk.0.attn_q.weight": (weights, q4_0)})
    old = tmp_path / "old"
    old.mkdir()
    (old / GGUF_SOURCE_FILE).write_text(json.dumps(gguf_source(llama)))  # what CONVERTED_FORMAT 2 wrote
    with pytest.raises(ValueError, match=r"by another version of orca \(converted format 2, this one reads 3\)"):
        open_quantized_checkpoint(old)
    converted = converted_dir(tmp_path / "llama", llama)
    assert open_quantized_checkpoint(converted) is not None
    os.utime(llama, ns=(0, 0))
    with pytest.raises(ValueError, match="which has changed since"):
        open_quantized_checkpoint(converted)
    llama.unlink()
    with pytest.raises(ValueError, match="which is gone"):
        open_quantized_checkpoint(converted)


# -- refusals --------------------------------------------------------------------------------------------
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
FP8_WEIGHTS = {"num_bits": 8, "type": "float", "strategy": "channel"}
FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized",
       "config_groups": {"group_0": {"targets": ["Linear"], "weights": FP8_WEIGHTS}}}


@pytest.mark.parametrize("qcfg, message", [
    ({"quant_method": "bitsandbytes"}, r"quant_method = 'bitsandbytes' is not supported \(supported: awq, gptq"),
    ({**AWQ, "bits": 8}, r"quantization_config\.bits = 8 is not supported"),
    ({k: v for k, v in AWQ.items() if k != "group_size"}, r"quantization_config\.group_size = missing"),
    ({**AWQ, "version": "gemv"}, r"quantization_config\.version = 'gemv'"),
    ({**AWQ, "quant_method": "gptq", "checkpoint_format": "marlin"}, r"checkpoint_format = 'marlin'"),
    ({**FP8, "format": "pack-quantized"}, r"format = 'pack-quantized'"),
    ({**FP8, "config_groups": {"group_0": {"weights": {**FP8_WEIGHTS, "type": "int"}}}},
     r"config_groups\.group_0\.weights\.type = 'int'"),
    ({**FP8, "config_groups": {"group_0": {"weights": {**FP8_WEIGHTS, "strategy": "block"}}}},
     r"config_groups\.group_0\.weights\.strategy = 'block'"),
])
def test_unsupported_quantization_config(tmp_path: Path, qcfg: dict, message: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qcfg}))
    with pytest.raises(ValueError, match=message) as info:
        open_quantized_checkpoint(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_gptq_act_order_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    def pack(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q, z, s = int4_groups(w, 32, symmetric=True)
        g_idx = (torch.arange(w.shape[1]) % (w.shape[1] // 32)).int()  # inputs dealt round the groups
        packed = {"qweight": pack_nibbles(q, list(range(8))).t().contiguous(),
                  "qzeros": pack_nibbles(z - 1, list(range(8))), "scales": s, "g_idx": g_idx}
        return packed, int4_reference(q, z, s, 32)

    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True}
    quantized_copy(tiny_llama, tmp_path / "gptq", qcfg, pack)
    with pytest.raises(ValueError, match=r"g_idx .*act-order.*desc_act = True"):
        open_quantized_checkpoint(tmp_path / "gptq")


def test_fp8_e5m2_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    def pack(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        scale = w.abs().amax(dim=1, keepdim=True) / 57344
        return {"weight": (w / scale).to(torch.float8_e5m2), "weight_scale": scale}, w

    quantized_copy(tiny_llama, tmp_path / "fp8", FP8, pack)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj\.weight is F8_E5M2; FP8 weights are read in e4m3"):
        open_quantized_checkpoint(tmp_path / "fp8")


def test_float_checkpoint_has_no_reader(tiny_llama: Path) -> None:
    assert open_quantized_checkpoint(tiny_llama) is None
