"""The linear weights of quantized checkpoints as QuantizedWeight (orca/models/quantization.py), unpacked
from the checkpoint's own integers and scales: nothing is dequantized and quantized again.

open_quantized_checkpoint(directory) gives a reader for a Hugging Face checkpoint directory: a GGUF file's
converted directory (orca/checkpoint.py: GGUF_SOURCE_FILE names the GGUF, GGUF_QUANTIZED_FILE holds its
blocks, unpacked at conversion) or a directory whose config.json has a quantization_config. Names are
Hugging Face's ("model.layers.0.self_attn.q_proj.weight") and every weight is in nn.Linear's (out, in)
orientation. The formats, as their writers lay them out:

- GGUF (llama.cpp), llama architecture. A row of `in` values is a run of blocks of 32, each a float16 d
  (and for Q4_1 a float16 m) then the values: Q8_0 32 int8, w = d * q; Q4_0 and Q4_1 16 bytes whose low
  nibbles are values 0..15 and high nibbles values 16..31, w = d * (q - 8) (Q4_0) or d * q + m (Q4_1).
  Hence int8 in groups of 32 with scale d; int4 in groups of 32 with scale d and zero 0 (Q4_0) or
  m + 8 d (Q4_1). llama.cpp's converter interleaves the rows of attn_q and attn_k (each head's two
  rotary halves, pair by pair); transformers undoes it when it reads GGUF, and so do we, on the values,
  scales and zeros alike. Tensor names: token_embd, output, blk.N.{attn_q, attn_k, attn_v, attn_output,
  ffn_gate, ffn_up, ffn_down}. Parsing a GGUF file takes seconds (gguf's reader walks the tokenizer's
  arrays in Python), so it is done once, at conversion (export_gguf_quantized), which writes the weights in
  QuantizedWeight's layout to a safetensors file that loads read as the other formats' are. Other
  quantized GGUF types (K-quants, Q5_0/Q5_1, IQ*) are not read quantized: those tensors are served from the
  float weights transformers dequantized into the converted directory (their get() is None), and the
  directory's GGUF_SOURCE_FILE lists them ("dequantized_only").
- AWQ (AutoAWQ, version "gemm"), 4 bits in groups of G inputs: qweight int32 (in, out / 8), qzeros int32
  (in / G, out / 8), scales float16 (in / G, out). A word holds 8 consecutive outputs, output 8j + c in
  nibble AWQ_PACK_ORDER.index(c) (the order AutoAWQ packs in: 0, 2, 4, 6, 1, 3, 5, 7). w = (q - z) * s.
- GPTQ (AutoGPTQ, GPTQModel), 4 bits in groups of G inputs (G = -1: one group): qweight int32
  (in / 8, out), a word holding inputs 8i..8i+7 from the lowest nibble up; qzeros int32 (in / G, out / 8),
  outputs 8j..8j+7 from the lowest nibble up; scales float16 (in / G, out); g_idx int32 (in), each
  input's group. w = (q - z) * s where z is the stored zero plus 1 (checkpoint_format "gptq", the v1
  convention) or the stored zero ("gptq_v2").
- compressed-tensors FP8 ("float-quantized" or "naive-quantized"; weights 8-bit "float", strategy
  "channel" or "tensor"): x.weight float8_e4m3fn (out, in) and x.weight_scale float32 (out, 1) per channel
  or one value per tensor; w = q * scale. x.input_scale (static activation scales) is not used: our FP8
  layers scale activations per token at each call.

An AWQ or GPTQ checkpoint has no x.weight for a quantized layer (x.qweight, x.qzeros, x.scales, x.g_idx
instead) and a compressed-tensors one stores x.weight in float8: stored_names() lists those names, whose
float tensor the loader must not read. A converted GGUF directory has the dequantized float tensors too.
"""

from __future__ import annotations

import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from orca.checkpoint import CONVERTED_FORMAT, GGUF_QUANTIZED_FILE, GGUF_SOURCE_FILE, gguf_source
from orca.models.quantization import QuantizedWeight

logger = logging.getLogger(__name__)

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output AWQ_PACK_ORDER[i] of its 8
AWQ_REVERSE_ORDER = tuple(AWQ_PACK_ORDER.index(c) for c in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)
GPTQ_FORMATS = ("gptq", "gptq_v2")
COMPRESSED_TENSORS_FORMATS = ("float-quantized", "naive-quantized")
FP8_STRATEGIES = ("channel", "tensor")
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
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


class QuantizedCheckpoint(ABC):
    """The quantized linear weights of one checkpoint, read on demand by Hugging Face name."""

    format: str  # "gguf", "awq", "gptq" or "compressed-tensors"

    def __init__(self, checkpoint: Path, layer_kinds: dict[str, str]) -> None:
        self.checkpoint = checkpoint
        self._layer_kinds = layer_kinds  # Hugging Face weight name -> QuantizedWeight kind

    def get(self, hf_name: str) -> QuantizedWeight | None:
        """The weight `hf_name` ("model.layers.0.self_attn.q_proj.weight", exactly as the checkpoint names
        it) unpacked, or None when the checkpoint stores it as a float tensor (read it from the
        safetensors as usual)."""
        return self._read(hf_name) if hf_name in self._layer_kinds else None

    def kind_of(self, hf_name: str) -> str | None:
        """The kind get(hf_name) would return (nothing is read), or None for a float tensor."""
        return self._layer_kinds.get(hf_name)

    def kinds(self) -> set[str]:
        """The QuantizedWeight kinds of the weights get() returns ({"int4", "int8"} for a Q4_1 GGUF file
        with a Q8_0 embedding)."""
        return set(self._layer_kinds.values())

    def stored_names(self) -> set[str]:
        """Hugging Face weight names whose float tensor the safetensors lack (AWQ, GPTQ: x.qweight and its
        companions instead of x.weight) or hold as quantized values that are not the weight without their
        scale (compressed-tensors: x.weight in float8): read them with get() only."""
        return set(self._layer_kinds)

    @abstractmethod
    def _read(self, hf_name: str) -> QuantizedWeight:
        """Unpacks one weight that this checkpoint stores quantized."""


def open_quantized_checkpoint(checkpoint_dir: Path) -> QuantizedCheckpoint | None:
    """A reader for the quantized weights of a Hugging Face checkpoint directory, or None for a float one.

    A converted GGUF directory (one with orca.checkpoint.GGUF_SOURCE_FILE) reads what its conversion
    unpacked (GgufCheckpoint.open); other directories by their config.json's quantization_config
    (quant_method awq, gptq or compressed-tensors). ValueError, naming the checkpoint, the field, its value
    and what is supported, for a quantization we do not read or a description we cannot make sense of."""
    checkpoint_dir = Path(checkpoint_dir)
    marker = checkpoint_dir / GGUF_SOURCE_FILE
    if marker.is_file():
        return GgufCheckpoint.open(checkpoint_dir, json.loads(marker.read_text()))
    config = json.loads((checkpoint_dir / "config.json").read_text())
    qcfg = config.get("quantization_config")
    if qcfg is None:
        return None
    if not isinstance(qcfg, dict):
        raise ValueError(f"{checkpoint_dir}: quantization_config = {qcfg!r} is not an object")
    readers: dict[str, Callable[[Path, dict[str, Any]], QuantizedCheckpoint]] = {
        "awq": AwqCheckpoint, "gptq": GptqCheckpoint, "compressed-tensors": CompressedTensorsCheckpoint,
    }
    method = qcfg.get("quant_method")
    if method not in readers:
        raise _unsupported(checkpoint_dir, "quant_method", method, f"supported: {', '.join(readers)}")
    return readers[method](checkpoint_dir, qcfg)


def _unsupported(checkpoint: Path, field: str, value: Any, supported: str) -> ValueError:
    shown = "missing" if value is None else repr(value)
    return ValueError(f"{checkpoint}: quantization_config.{field} = {shown} is not supported ({supported})")


class _Safetensors:
    """A checkpoint directory's *.safetensors tensors (one file or shards) by name, read on demand."""

    def __init__(self, checkpoint: Path) -> None:
        self._where: dict[str, Path] = {}
        for f in sorted(checkpoint.glob("*.safetensors")):
            with safe_open(f, framework="pt") as sf:
                self._where.update(dict.fromkeys(sf.keys(), f))
        self._open: dict[Path, Any] = {}

    def names(self) -> set[str]:
        return set(self._where)

    def _file(self, name: str) -> Any:
        f = self._where[name]
        if f not in self._open:
            self._open[f] = safe_open(f, framework="pt")
        return self._open[f]

    def dtype(self, name: str) -> str:
        """The safetensors dtype ("F8_E4M3", "I32", ...), from the file's header."""
        return self._file(name).get_slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 (..., n) -> (..., n, 8): each word's eight 4-bit values, lowest bits first."""
    return (words.unsqueeze(-1) >> _SHIFTS) & 0xF


def _int4(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group_size: int) -> QuantizedWeight:
    """w = (q - z) * s, with q (out, in) and z, s (in / group_size, out), as QuantizedWeight's
    w = (q - 8) * scale + zero: zero = (8 - z) * s, exact in float32 (a float16 times a small integer)."""
    s = s.float()
    zeros = (8 - z).float() * s
    return QuantizedWeight("int4", q.to(torch.uint8).contiguous(), s.t().contiguous(), zeros.t().contiguous(),
                           group_size)


# -- AWQ and GPTQ: 4-bit integers packed in int32 words, groups along the inputs ------------------------
class _PackedInt4Checkpoint(QuantizedCheckpoint):
    """AWQ and GPTQ: every layer with a x.qweight is quantized (x.qzeros, x.scales beside it); the
    subclasses differ in how the words are packed."""

    def __init__(self, checkpoint: Path, qcfg: dict[str, Any]) -> None:
        bits = qcfg.get("bits")
        if bits != 4:
            raise _unsupported(checkpoint, "bits", bits, f"{self.format} checkpoints are read with 4 bits only")
        group_size = qcfg.get("group_size")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size == 0 or group_size < -1:
            raise _unsupported(checkpoint, "group_size", group_size,
                               "a positive number of input columns per scale, or -1 for one group per row")
        self.group_size = group_size
        self.tensors = _Safetensors(checkpoint)
        layers = sorted(n.removesuffix(".qweight") for n in self.tensors.names() if n.endswith(".qweight"))
        for layer in layers:
            missing = [f"{layer}.{t}" for t in ("qzeros", "scales") if f"{layer}.{t}" not in self.tensors.names()]
            if missing:
                raise ValueError(f"{checkpoint}: {layer}.qweight without {', '.join(missing)}")
        super().__init__(checkpoint, {f"{layer}.weight": "int4" for layer in layers})

    def _read(self, hf_name: str) -> QuantizedWeight:
        layer = hf_name.removesuffix(".weight")
        qweight, qzeros, scales = (self.tensors.get(f"{layer}.{t}") for t in ("qweight", "qzeros", "scales"))
        q, z = self._unpack(qweight, qzeros)  # (out, in), (groups, out)
        out, cols = q.shape
        group = cols if self.group_size == -1 else self.group_size
        if cols % group or z.shape != (cols // group, out) or scales.shape != (cols // group, out):
            raise ValueError(f"{self.checkpoint}: {layer} ({out} outputs, {cols} inputs) has qzeros "
                             f"{tuple(qzeros.shape)} and scales {tuple(scales.shape)}, which do not match "
                             f"quantization_config.group_size = {self.group_size}")
        return _int4(q, z, scales, group)

    @abstractmethod
    def _unpack(self, qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The 4-bit values (out, in) and the integer zero points (in / group, out) of one layer."""


class AwqCheckpoint(_PackedInt4Checkpoint):
    """AutoAWQ's GEMM layout (quant_method "awq", version "gemm", zero_point true)."""

    format = "awq"

    def __init__(self, checkpoint: Path, qcfg: dict[str, Any]) -> None:
        version = qcfg.get("version", "gemm")
        if not isinstance(version, str) or version.lower() != "gemm":
            raise _unsupported(checkpoint, "version", version, "the gemm layout only")
        if qcfg.get("zero_point", True) is not True:
            raise _unsupported(checkpoint, "zero_point", qcfg["zero_point"], "zero_point true only")
        super().__init__(checkpoint, qcfg)

    def _unpack(self, qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = list(AWQ_REVERSE_ORDER)
        q = _nibbles(qweight)[..., order].flatten(1)  # (in, out)
        z = _nibbles(qzeros)[..., order].flatten(1)
        return q.t(), z


class GptqCheckpoint(_PackedInt4Checkpoint):
    """AutoGPTQ's and GPTQModel's layout (quant_method "gptq", checkpoint_format "gptq" or "gptq_v2").

    Act-order checkpoints (desc_act with a g_idx that is not each input's own position's group) are
    refused: their groups gather scattered inputs, which groups of consecutive columns cannot express."""

    format = "gptq"

    def __init__(self, checkpoint: Path, qcfg: dict[str, Any]) -> None:
        checkpoint_format = qcfg.get("checkpoint_format", "gptq")
        if checkpoint_format not in GPTQ_FORMATS:
            raise _unsupported(checkpoint, "checkpoint_format", checkpoint_format,
                               f"supported: {', '.join(GPTQ_FORMATS)}")
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0  # v1 stores each zero point minus 1
        super().__init__(checkpoint, qcfg)
        for name in sorted(self.tensors.names()):
            if name.endswith(".g_idx"):
                g_idx = self.tensors.get(name)
                group = len(g_idx) if self.group_size == -1 else self.group_size
                if not torch.equal(g_idx.long(), torch.arange(len(g_idx)) // group):
                    raise ValueError(
                        f"{checkpoint}: {name} assigns inputs to groups out of order (act-order, "
                        f"quantization_config.desc_act = {qcfg.get('desc_act')!r}), which is not supported: "
                        "use a checkpoint quantized with desc_act false (or static_groups true)"
                    )

    def _unpack(self, qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = _nibbles(qweight.t().contiguous()).flatten(1)  # (out, in / 8, 8) -> (out, in)
        z = _nibbles(qzeros).flatten(1) + self.zero_offset
        return q, z


# -- compressed-tensors FP8 -------------------------------------------------------------------------------
class CompressedTensorsCheckpoint(QuantizedCheckpoint):
    """compressed-tensors' FP8 weights (llm-compressor's FP8 and FP8_DYNAMIC schemes): every x.weight with
    a x.weight_scale beside it is quantized (layers in the config's "ignore" list have none)."""

    format = "compressed-tensors"

    def __init__(self, checkpoint: Path, qcfg: dict[str, Any]) -> None:
        supported = f"supported: {', '.join(COMPRESSED_TENSORS_FORMATS)}"
        if qcfg.get("format") not in COMPRESSED_TENSORS_FORMATS:
            raise _unsupported(checkpoint, "format", qcfg.get("format"), supported)
        groups = qcfg.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise _unsupported(checkpoint, "config_groups", groups, "an object of quantization schemes")
        for gname, group in groups.items():
            if not isinstance(group, dict):
                raise _unsupported(checkpoint, f"config_groups.{gname}", group, "an object")
            if "format" in group and group["format"] not in COMPRESSED_TENSORS_FORMATS:
                raise _unsupported(checkpoint, f"config_groups.{gname}.format", group["format"], supported)
            weights = group.get("weights") or {}
            for field, value, allowed in (("num_bits", 8, "8"), ("type", "float", "float: FP8")):
                if weights.get(field) != value:
                    raise _unsupported(checkpoint, f"config_groups.{gname}.weights.{field}", weights.get(field),
                                       f"weights are read as {allowed} only")
            if weights.get("strategy") not in FP8_STRATEGIES:
                raise _unsupported(checkpoint, f"config_groups.{gname}.weights.strategy",
                                   weights.get("strategy"), f"supported: {', '.join(FP8_STRATEGIES)}")
        self.tensors = _Safetensors(checkpoint)
        layers = sorted(n.removesuffix(".weight_scale") for n in self.tensors.names() if n.endswith(".weight_scale"))
        for layer in layers:
            dtype = self.tensors.dtype(f"{layer}.weight")
            if dtype != "F8_E4M3":
                raise ValueError(f"{checkpoint}: {layer}.weight is {dtype}; FP8 weights are read in e4m3 "
                                 "(F8_E4M3) only")
        super().__init__(checkpoint, {f"{layer}.weight": "fp8" for layer in layers})

    def _read(self, hf_name: str) -> QuantizedWeight:
        weight = self.tensors.get(hf_name)
        scale = self.tensors.get(f"{hf_name}_scale").float()
        out, cols = weight.shape
        if scale.numel() == 1:  # strategy "tensor": the one scale for every row
            scale = scale.reshape(1, 1).expand(out, 1).contiguous()
        elif scale.numel() == out:
            scale = scale.reshape(out, 1)
        else:
            raise ValueError(f"{self.checkpoint}: {hf_name}_scale {tuple(scale.shape)} is neither per channel "
                             f"({out}, 1) nor per tensor")
        return QuantizedWeight("fp8", weight, scale, None, cols)


# -- GGUF -------------------------------------------------------------------------------------------------
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
    Quantized tensors of other types (K-quants, Q5_0, IQ*...) are left to the converted directory's float
    weights, which transformers dequantized (get() returns None for them), as is every tensor of a GGUF of
    another architecture (whose q/k rows llama.cpp lays out otherwise). Returns what the directory's
    GGUF_SOURCE_FILE records of this: {"architecture", "quantized": GGUF_QUANTIZED_FILE or None when
    nothing was written, "dequantized_only": {GGUF tensor name: type}}."""
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
    """A llama-architecture GGUF file's Q8_0, Q4_0 and Q4_1 linear weights, read from what the conversion
    unpacked (export_gguf_quantized: GGUF_QUANTIZED_FILE in the converted directory, memory-mapped, each
    weight when get() asks for it); the GGUF file itself is never opened. Tensors of other types (F32, F16,
    BF16, and the quantized types we do not read: the marker's "dequantized_only") are read as floats from
    the converted directory (get() returns None). Tied embeddings: there is no output tensor, so
    get("lm_head.weight") is None and the head is get("model.embed_tokens.weight")."""

    format = "gguf"

    def __init__(self, checkpoint: Path, path: Path, layers: dict[str, dict[str, Any]]) -> None:
        super().__init__(checkpoint, {name: layer["kind"] for name, layer in layers.items()})
        self._path = path
        self._group_sizes = {name: int(layer["group_size"]) for name, layer in layers.items()}
        self._file: Any = None

    @classmethod
    def open(cls, checkpoint: Path, marker: dict[str, Any]) -> GgufCheckpoint | None:
        """The reader for `checkpoint`, a directory convert_gguf wrote, from its GGUF_SOURCE_FILE (`marker`)
        and the header of its GGUF_QUANTIZED_FILE; None when the conversion wrote none (a GGUF of another
        architecture, or without Q8_0/Q4_0/Q4_1 linear weights: the converted float weights are the model).
        ValueError when the directory was converted by an orca that wrote another CONVERTED_FORMAT, or its
        GGUF file is gone or changed since the conversion (size or modification time: a stat, the file is
        not read)."""
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
