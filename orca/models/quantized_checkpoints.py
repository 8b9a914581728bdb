"""The linear weights of quantized checkpoints as QuantizedWeight (orca/models/quantization.py), unpacked
from the checkpoint's own integers and scales: nothing is dequantized and quantized again.

open_quantized_checkpoint(directory) gives a reader for a Hugging Face checkpoint directory: a GGUF file's
converted directory (orca/models/gguf_checkpoint.py) or one whose config.json has a quantization_config.
Names are Hugging Face's and every weight is in nn.Linear's (out, in) orientation. The formats:

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
  or one value per tensor; w = q * scale. x.input_scale is not used: our FP8 layers scale activations
  per token at each call.

AWQ and GPTQ store no x.weight for a quantized layer and compressed-tensors stores it in float8:
stored_names() lists those names, whose float tensor the loader must not read.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from orca.checkpoint import GGUF_SOURCE_FILE
from orca.models.quantization import QuantizedWeight

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output AWQ_PACK_ORDER[i] of its 8
AWQ_REVERSE_ORDER = tuple(AWQ_PACK_ORDER.index(c) for c in range(8))  # (0, 4, 1, 5, 2, 6, 3, 7)
GPTQ_FORMATS = ("gptq", "gptq_v2")
COMPRESSED_TENSORS_FORMATS = ("float-quantized", "naive-quantized")
FP8_STRATEGIES = ("channel", "tensor")
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
        """Hugging Face weight names the loader must read with get() only: absent as floats (AWQ, GPTQ's
        x.qweight) or stored as float8 values (compressed-tensors' x.weight)."""
        return set(self._layer_kinds)

    @abstractmethod
    def _read(self, hf_name: str) -> QuantizedWeight:
        """Unpacks one weight that this checkpoint stores quantized."""


def open_quantized_checkpoint(checkpoint_dir: Path) -> QuantizedCheckpoint | None:
    """A reader for the quantized weights of a Hugging Face checkpoint directory, or None for a float one:
    a converted GGUF directory's (GgufCheckpoint.open), else by config.json's quantization_config
    (awq, gptq or compressed-tensors). ValueError, naming the checkpoint, the field, its value and what
    is supported, for a quantization we do not read or cannot make sense of."""
    checkpoint_dir = Path(checkpoint_dir)
    marker = checkpoint_dir / GGUF_SOURCE_FILE
    if marker.is_file():
        from orca.models.gguf_checkpoint import GgufCheckpoint  # imports this module

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
