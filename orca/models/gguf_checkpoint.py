"""GGUF (llama.cpp) checkpoints, llama architecture: Q8_0, Q4_0 and Q4_1 linear weights as QuantizedWeight.

A row of `in` values is a run of blocks of 32, each a float16 d (and for Q4_1 a float16 m) then the values:
Q8_0 32 int8, w = d * q; Q4_0 and Q4_1 16 bytes, low nibbles values 0..15, high nibbles 16..31, w = d * (q - 8)
(Q4_0) or d * q + m (Q4_1): int4 in groups of 32 with zero 0 or m + 8 d. llama.cpp interleaves the rows of
attn_q and attn_k (each head's rotary halves, pair by pair); we undo it, as transformers does. Parsing a GGUF
takes seconds, so it is done once, at conversion (export_gguf_quantized); loads read its safetensors output.
Other quantized types (K-quants, Q5_*, IQ*) are served from the float weights transformers dequantized.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from orca.checkpoint import CONVERTED_FORMAT, GGUF_QUANTIZED_FILE, gguf_source
from orca.models.quantization import QuantizedWeight
from orca.models.quantized_checkpoints import QuantizedCheckpoint

logger = logging.getLogger(__name__)

GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")  # served from the converted directory's float tensors
GGUF_LAYERS_KEY = "orca_gguf_layers"  # GGUF_QUANTIZED_FILE's metadata: {name: {kind, group_size, gguf_type}}
GGUF_QUANTIZED_KINDS = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4"}
GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_hf_name(gguf_name: str) -> str | None:
    """The Hugging Face llama name of a GGUF linear weight ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight"), None for the others (norms, rope_freqs)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m[2] in GGUF_LAYER_NAMES:
        return f"model.layers.{m[1]}.{GGUF_LAYER_NAMES[m[2]]}.weight"
    return None


def gguf_unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row indices that undo llama.cpp's rotary permutation of attn_q / attn_k (`heads` heads of `rows`
    rows in all): weight_hf = weight_gguf[index], transformers' reverse permute (each head's rows
    interleaved pair by pair become its two halves again)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    """uint8 (..., 2) little-endian float16 bytes -> float32 (...)."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _gguf_weight(tensor: Any, heads: int | None) -> QuantizedWeight:
    """One GGUF tensor's Q8_0 / Q4_0 / Q4_1 blocks (a gguf.ReaderTensor) unpacked, the rows of attn_q and
    attn_k (`heads` their head count; None for the others) unpermuted."""
    cols, rows = (int(n) for n in tensor.shape)  # GGUF lists the fastest-varying dimension first
    qtype = tensor.tensor_type.name
    blocks = torch.from_numpy(tensor.data.copy()).view(rows, cols // 32, -1)  # 32 values a block
    if qtype == "Q8_0":  # d, 32 x int8
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, cols)
        scales, zeros = _fp16(blocks[..., 0:2]), None
    else:  # Q4_0: d, 16 bytes; Q4_1: d, m, 16 bytes; low nibbles values 0..15, high nibbles 16..31
        packed = blocks[..., -16:]
        q = torch.cat((packed & 0xF, packed >> 4), dim=-1).reshape(rows, cols)
        scales = _fp16(blocks[..., 0:2])
        zeros = torch.zeros_like(scales) if qtype == "Q4_0" else _fp16(blocks[..., 2:4]) + 8 * scales
    if heads is not None:
        index = gguf_unpermute_rows(rows, heads)
        q, scales = q[index], scales[index]
        zeros = None if zeros is None else zeros[index]
    return QuantizedWeight(GGUF_QUANTIZED_KINDS[qtype], q, scales, zeros, 32)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 (out, in) values in [0, 15] -> uint8 (out, in / 2): column 2j in the low nibble, 2j + 1 in the
    high one."""
    return (q[:, 0::2] | q[:, 1::2] << 4).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4 undone: uint8 (out, in / 2) -> uint8 (out, in)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).view(packed.shape[0], -1)


def export_gguf_quantized(gguf_path: Path, directory: Path) -> dict[str, Any]:
    """At conversion (orca.checkpoint.write_gguf_quantized; the one time orca parses a GGUF file itself):
    a llama GGUF file's Q8_0, Q4_0 and Q4_1 linear weights unpacked (q/k rows unpermuted) into
    directory / GGUF_QUANTIZED_FILE, one safetensors file holding per Hugging Face weight name x.weight:

      x.weight.qweight  int8 (out, in) (int8), or uint8 (out, in / 2), two int4 values a byte (pack_int4)
      x.weight.scales   float32 (out, in / 32)
      x.weight.zeros    float32 (out, in / 32), int4 only: w = (q - 8) * scale + zero

    and in its header's metadata GGUF_LAYERS_KEY: JSON {x.weight: {"kind", "group_size", "gguf_type"}}.
    Other types, and other architectures, are left to transformers' dequantized float weights. Returns
    GGUF_SOURCE_FILE's record: {"architecture", "quantized": the file or None, "dequantized_only": {name: type}}."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    architecture = str(reader.fields["general.architecture"].contents())
    dequantized_only = {t.name: t.tensor_type.name for t in reader.tensors
                        if t.tensor_type.name not in (*GGUF_QUANTIZED_KINDS, *GGUF_FLOAT_TYPES)}
    summary: dict[str, Any] = {"architecture": architecture, "quantized": None, "dequantized_only": dequantized_only}
    if architecture != "llama":
        return summary
    heads = int(reader.fields["llama.attention.head_count"].contents())
    kv_field = reader.fields.get("llama.attention.head_count_kv")
    kv_heads = heads if kv_field is None else int(kv_field.contents())
    permuted = {"self_attn.q_proj": heads, "self_attn.k_proj": kv_heads}
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, Any]] = {}
    for t in reader.tensors:
        hf_name = gguf_hf_name(t.name)
        if hf_name is None or t.tensor_type.name not in GGUF_QUANTIZED_KINDS:
            continue
        layer = hf_name.removesuffix(".weight")
        heads_of = next((n for p, n in permuted.items() if layer.endswith(p)), None)
        if heads_of is not None and int(t.shape[1]) % (2 * heads_of):
            raise ValueError(f"{gguf_path}: {t.name} has {int(t.shape[1])} rows, which {heads_of} heads of "
                             "rotary pairs do not divide")
        w = _gguf_weight(t, heads_of)
        tensors[f"{hf_name}.qweight"] = pack_int4(w.qweight) if w.kind == "int4" else w.qweight
        tensors[f"{hf_name}.scales"] = w.scales.contiguous()
        if w.zeros is not None:
            tensors[f"{hf_name}.zeros"] = w.zeros.contiguous()
        layers[hf_name] = {"kind": w.kind, "group_size": w.group_size, "gguf_type": t.tensor_type.name}
    if layers:
        path = directory / GGUF_QUANTIZED_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, path, metadata={GGUF_LAYERS_KEY: json.dumps(layers), "source": gguf_path.name})
        summary["quantized"] = GGUF_QUANTIZED_FILE
    return summary


class GgufCheckpoint(QuantizedCheckpoint):
    """A llama-architecture GGUF file's Q8_0, Q4_0 and Q4_1 linear weights, memory-mapped from what the
    conversion unpacked (GGUF_QUANTIZED_FILE); the GGUF file itself is never opened. get() returns None for
    other tensors (read as floats) and for "lm_head.weight" when the embedding is tied."""

    format = "gguf"

    def __init__(self, checkpoint: Path, path: Path, layers: dict[str, dict[str, Any]]) -> None:
        super().__init__(checkpoint, {name: layer["kind"] for name, layer in layers.items()})
        self._path = path
        self._group_sizes = {name: int(layer["group_size"]) for name, layer in layers.items()}
        self._file: Any = None

    @classmethod
    def open(cls, checkpoint: Path, marker: dict[str, Any]) -> GgufCheckpoint | None:
        """The reader for `checkpoint`, a directory convert_gguf wrote; None when the conversion wrote no
        GGUF_QUANTIZED_FILE. ValueError when another CONVERTED_FORMAT wrote it, or its GGUF file is gone
        or changed since (size or modification time)."""
        path = Path(marker["path"])
        if marker.get("converted_format") != CONVERTED_FORMAT:
            raise ValueError(f"{checkpoint} was converted from {path} by another version of orca (converted "
                             f"format {marker.get('converted_format', 2)}, this one reads {CONVERTED_FORMAT}): "
                             "convert it again (give the .gguf file as the model)")
        if not path.is_file():
            raise ValueError(f"{checkpoint} was converted from {path}, which is gone")
        if gguf_source(path) != {k: marker.get(k) for k in ("path", "size", "mtime_ns")}:
            raise ValueError(f"{checkpoint} was converted from {path}, which has changed since (size or "
                             "modification time): convert it again (give the .gguf file as the model)")
        if marker.get("quantized") is None:
            return None
        quantized = checkpoint / marker["quantized"]
        with safe_open(quantized, framework="pt") as f:
            layers = json.loads((f.metadata() or {})[GGUF_LAYERS_KEY])
        if marker.get("dequantized_only"):
            logger.info("%s: %d GGUF tensors of types orca does not read quantized (%s) are served from the "
                        "converted float weights", checkpoint, len(marker["dequantized_only"]),
                        ", ".join(sorted(set(marker["dequantized_only"].values()))))
        return cls(checkpoint, quantized, layers)

    def stored_names(self) -> set[str]:
        """No names: the converted directory holds every weight dequantized as well."""
        return set()

    def _read(self, hf_name: str) -> QuantizedWeight:
        if self._file is None:
            self._file = safe_open(self._path, framework="pt")
        kind = self._layer_kinds[hf_name]
        q = self._file.get_tensor(f"{hf_name}.qweight")
        scales = self._file.get_tensor(f"{hf_name}.scales")
        if kind == "int4":
            return QuantizedWeight(kind, unpack_int4(q), scales, self._file.get_tensor(f"{hf_name}.zeros"),
                                   self._group_sizes[hf_name])
        return QuantizedWeight(kind, q, scales, None, self._group_sizes[hf_name])
