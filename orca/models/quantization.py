"""Quantized linear weights (EngineConfig.quantization): int8 and int4 weight-only, and FP8 weights and
activations, multiplied by PyTorch's own kernels.

A weight travels unpacked as QuantizedWeight from any source (quantized at load, GGUF, AWQ/GPTQ/
compressed-tensors: quantized_checkpoints.py) through sharding and fusion, and is packed for its kernel
only once it is this rank's (QuantizedLinear):

- int8: values in [-127, 127] (int8), one float scale per output channel: w = q * scale.
  Kernel: torch._weight_int8pack_mm (CPU; on CUDA a dequantizing matmul where torch has no kernel).
- int4: values in [0, 15] (uint8), a scale and an offset per group of `group_size` input columns:
  w = (q - 8) * scale + zero (tinygemm's convention; integer zero points z map as zero = (8 - z) * scale).
  Kernels: torch._weight_int4pack_mm_for_cpu (CPU), torch._weight_int4pack_mm (CUDA, bfloat16).
- fp8: float8 e4m3 values, one float32 scale per output channel: w = q * scale; activations are scaled
  per token to e4m3 at each call. Kernel: torch._scaled_mm (CUDA compute capability 8.9 and later).

On a CPU the int kernels are slow with float32 activations (docs/BENCHMARKS.md, "Results: quantized
weights and K/V"), so a float32 model runs them in bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from orca import tuning
from orca.parallel import ParallelContext, Shard, shard_tensor

KINDS = ("int8", "int4", "fp8")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 kernels take
INT4_ROW_TILE = 16  # they take output rows in multiples of this
INT8_COLUMN_TILE = 8  # torch's CPU int8 kernel takes input columns in multiples of this
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
FP8_MIN_CAPABILITY = (8, 9)
FP8_DIM_MULTIPLE = 16  # torch._scaled_mm's rule for both dimensions of its second matrix


@dataclass(frozen=True)
class QuantizedWeight:
    """One linear weight of shape (out, in), quantized, unpacked: what checkpoint readers produce and the
    loader shards, concatenates and hands to QuantizedLinear.

    qweight: (out, in); int8 (int8), uint8 in [0, 15] (int4) or float8_e4m3fn (fp8).
    scales: float32 (out, in // group_size); per output channel when group_size == in.
    zeros: int4 only, float32 like scales: w = (q - 8) * scale + zero.
    group_size: input columns per scale."""

    kind: str
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown quantized weight kind {self.kind!r} (one of {', '.join(KINDS)})")
        out, cols = self.qweight.shape
        if cols % self.group_size or self.scales.shape != (out, cols // self.group_size):
            raise ValueError(f"{self.kind} weight {tuple(self.qweight.shape)}: scales {tuple(self.scales.shape)} "
                             f"do not match groups of {self.group_size}")
        if (self.kind == "int4") != (self.zeros is not None):
            raise ValueError("int4 weights (and only they) carry zeros")

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def per_channel(self) -> bool:
        return self.group_size == self.qweight.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight (out, in) these values stand for."""
        scales = self.scales.float().repeat_interleave(self.group_size, dim=1)
        if self.kind == "int4":
            zeros = self.zeros.float().repeat_interleave(self.group_size, dim=1)  # type: ignore[union-attr]
            return ((self.qweight.float() - 8) * scales + zeros).to(dtype)
        return (self.qweight.float() * scales).to(dtype)

    def to_per_channel(self) -> QuantizedWeight:
        """int8 or fp8 in groups (GGUF's Q8_0) as one scale per output channel, what their kernels take:
        each row requantized (error at most half a step of the row's scale)."""
        if self.per_channel or self.kind == "int4":
            return self
        return quantize(self.dequantize(), self.kind)


def quantize(weight: torch.Tensor, kind: str, group_size: int = 32) -> QuantizedWeight:
    """A float weight (out, in) quantized: int8 and fp8 per output channel (symmetric, round to nearest),
    int4 asymmetric in groups of `group_size` input columns (a group's min..max over the 16 levels)."""
    w = weight.detach().float()
    out, cols = w.shape
    if kind == "int8":
        scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
        q = (w / scale).round().clamp(-127, 127).to(torch.int8)
        return QuantizedWeight("int8", q, scale, None, cols)
    if kind == "fp8":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return QuantizedWeight("fp8", q, scale, None, cols)
    if kind == "int4":
        if cols % group_size:
            fits = [str(g) for g in INT4_GROUP_SIZES if cols % g == 0]
            raise ValueError(f"int4 group size (quantization_group_size) {group_size} does not divide the layer's "
                             f"{cols} input columns: " + (f"use {' or '.join(fits)}" if fits else
                                                          "no int4 group size divides it; use int8 or none"))
        groups = w.view(out, cols // group_size, group_size)
        lo, hi = groups.amin(dim=2), groups.amax(dim=2)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        level = ((groups - lo.unsqueeze(2)) / scale.unsqueeze(2)).round().clamp(0, 15)
        zero = lo + 8 * scale  # w = (q - 8) * scale + zero = q * scale + lo
        return QuantizedWeight("int4", level.to(torch.uint8).view(out, cols), scale, zero, group_size)
    raise ValueError(f"unknown quantization {kind!r} (one of {', '.join(KINDS)})")


def shard_quantized(w: QuantizedWeight, rule: Shard, tp_rank: int, tp_size: int) -> QuantizedWeight:
    """This rank's piece of a quantized weight under a shard rule (orca/parallel.py), scales and zeros
    split with the values. A row split (input columns) must cut between groups."""
    if tp_size == 1 or rule.kind == "replicated":
        return w
    q = shard_tensor(w.qweight, rule, tp_rank, tp_size)
    if rule.kind != "row":  # output rows split: scales and zeros split along with them
        scales = shard_tensor(w.scales, rule, tp_rank, tp_size)
        zeros = None if w.zeros is None else shard_tensor(w.zeros, rule, tp_rank, tp_size)
        return replace(w, qweight=q, scales=scales, zeros=zeros)
    if w.per_channel:
        return replace(w, qweight=q, group_size=q.shape[1])
    cols = q.shape[1]
    if cols % w.group_size:
        raise ValueError(f"tensor_parallel_size {tp_size} splits a layer's {w.shape[1]} input columns into "
                         f"{cols}, which groups of {w.group_size} do not divide: use a tensor_parallel_size "
                         "whose share is a multiple of the group size")
    groups = cols // w.group_size
    scales = w.scales.narrow(1, tp_rank * groups, groups)
    zeros = None if w.zeros is None else w.zeros.narrow(1, tp_rank * groups, groups)
    return replace(w, qweight=q, scales=scales, zeros=zeros)


def concat_quantized(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Fused projections (q | k | v, gate | up): the parts stacked along the output rows. They must share
    kind, and int4 parts their group size; int8/fp8 parts in different groups are made per channel."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if first.kind != "int4" and any(p.group_size != first.group_size for p in parts):
        parts = [p.to_per_channel() for p in parts]  # int8 in groups (Q8_0) beside per-channel parts
        first = parts[0]
    if any(p.kind != first.kind or p.group_size != first.group_size for p in parts):
        raise ValueError("fused projections quantized differently: "
                         + ", ".join(f"{p.kind}/group {p.group_size}" for p in parts))
    return QuantizedWeight(
        first.kind, torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
        None if first.zeros is None else torch.cat([p.zeros for p in parts]),  # type: ignore[misc]
        first.group_size,
    )


# -- where each kind runs --------------------------------------------------------------------------------
def check_supported(kind: str, device: torch.device) -> None:
    """ValueError when `kind` cannot run on `device`, naming what would."""
    if kind == "fp8":
        if device.type != "cuda":
            raise ValueError(f"quantization fp8 runs on CUDA GPUs of compute capability 8.9 or later only, not on "
                             f"{device}: use int8, int4 or none")
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < FP8_MIN_CAPABILITY:
            raise ValueError(f"quantization fp8 needs a GPU of compute capability 8.9 or later; {device} is "
                             f"{major}.{minor}: use int8, int4 or none")
    elif kind not in ("int8", "int4"):
        raise ValueError(f"unknown quantization {kind!r} (one of {', '.join(KINDS)})")


def slow_kind_warning(kind: str, device: torch.device) -> str | None:
    """What to tell a user whose kind runs, but slowly, on `device` (measured), else None."""
    if kind == "int8" and device.type == "cuda":
        return ("quantization int8 on CUDA runs torch's int8 weight-only matmul (_weight_int8pack_mm), measured "
                "at 0.22x bfloat16's decode tokens/s at batch 1 and 0.08x at batch 16 on an H200 (1.1B Llama, "
                "docs/BENCHMARKS.md): fp8 (0.8x) or none are faster there")
    return None


def kernel_dtype(kind: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The activation dtype a kind's kernel runs in: bfloat16 for int4 on CUDA (tinygemm's one dtype) and
    for int8/int4 on a CPU when the model is float32 (their float32 paths are slow); the model's otherwise."""
    if kind == "fp8":
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if kind == "int4" else dtype
    return torch.bfloat16 if dtype == torch.float32 else dtype


class QuantizedLinear(nn.Module):
    """y = x W^T (+ b), W quantized, packed once into its format's kernel layout: one subclass per format
    (Int8Linear, Int4Linear, Fp8Linear); `QuantizedLinear(weight, ...)` builds weight.kind's. With `par`
    (row-parallel) partial products are all-reduced before the bias.

    With `float_copy` (linear_backend hybrid on a CPU) a oneDNN-packed dequantized copy multiplies inputs
    of tuning.HYBRID_QUANTIZED_MIN_ROWS[dtype][kind] rows or more, where the int kernels stop winning. An
    instance may be given another `matmul` of the same signature (a CPU graph fixes one of the two)."""

    kind: ClassVar[str]
    FORMATS: ClassVar[dict[str, type[QuantizedLinear]]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        QuantizedLinear.FORMATS[cls.kind] = cls

    def __new__(cls, weight: QuantizedWeight | None = None, *args: object, **kwargs: object) -> QuantizedLinear:
        if cls is QuantizedLinear and weight is not None:  # the format's class (copy.copy passes no weight)
            cls = QuantizedLinear.FORMATS[weight.kind]
        return super().__new__(cls)

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device,
                 dtype: torch.dtype, par: ParallelContext | None = None, float_copy: bool = False) -> None:
        super().__init__()
        check_supported(weight.kind, device)
        if weight.kind != self.kind:
            raise ValueError(f"{type(self).__name__} takes {self.kind} weights, not {weight.kind}")
        if self.kind != "int4":
            weight = weight.to_per_channel()
        self.group_size = weight.group_size
        self.out_features, self.in_features = weight.shape
        self.dtype, self.compute_dtype = dtype, kernel_dtype(weight.kind, device, dtype)
        self.par = par
        self.pad_columns = 0
        self._pack(weight, device)  # (buffers, not parameters: packed layouts are opaque)
        self.register_buffer("bias", None if bias is None else bias.detach().to(device, dtype), persistent=False)
        float_packed = None
        if float_copy and device.type == "cpu" and self.kind != "fp8":
            float_packed = torch.ops.mkldnn._reorder_linear_weight(weight.dequantize(dtype).to(device), None)
            self.float_min_rows = tuning.HYBRID_QUANTIZED_MIN_ROWS[dtype][weight.kind]
        self.register_buffer("float_packed", float_packed, persistent=False)

    def _pack(self, weight: QuantizedWeight, device: torch.device) -> None:
        raise NotImplementedError

    def quantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, in) times the quantized weight through the format's kernel, (T, out) in x's dtype."""
        raise NotImplementedError

    def float_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, in) times the float copy (oneDNN)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.float_packed, None, "none", [], "")

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.float_packed is not None and x.shape[0] >= self.float_min_rows:
            return self.float_matmul(x)
        return self.quantized_matmul(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self.matmul(x.reshape(-1, self.in_features))
        if self.par is not None:
            y = self.par.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.kind == "int4" else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}{group}, "
                f"compute_dtype={str(self.compute_dtype).removeprefix('torch.')}, bias={self.bias is not None}"
                + (", float_copy=True" if self.float_packed is not None else ""))


class Int8Linear(QuantizedLinear):
    """int8 weights, a scale per output channel: torch._weight_int8pack_mm (on CUDA where torch lacks it, a
    matmul that dequantizes)."""

    kind = "int8"

    def _pack(self, weight: QuantizedWeight, device: torch.device) -> None:
        cuda = device.type == "cuda"
        # torch's CPU kernel reads the input columns 8 at a time (and crashes on a remainder): zero columns
        # pad them, and the activations get as many zeros (INT8_COLUMN_TILE).
        self.pad_columns = -self.in_features % INT8_COLUMN_TILE if not cuda else 0
        q = F.pad(weight.qweight, (0, self.pad_columns)) if self.pad_columns else weight.qweight
        self.register_buffer("packed", q.to(device).contiguous(), persistent=False)
        self.register_buffer("scales", weight.scales.view(-1).to(device, self.compute_dtype), persistent=False)
        self._int8_kernel = not cuda or torch._C._dispatch_has_kernel_for_dispatch_key(
            "aten::_weight_int8pack_mm", "CUDA")

    def quantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if not self._int8_kernel:
            return (F.linear(x, self.packed.to(x.dtype)) * self.scales).to(self.dtype)
        return _int_linear(x, self.packed, self.scales, self.kind, self.group_size, self.pad_columns,
                           self.out_features)


class Int4Linear(QuantizedLinear):
    """int4 weights, a scale and an offset per group of input columns: torch's int4 kernels (tinygemm on
    CUDA)."""

    kind = "int4"

    def _pack(self, weight: QuantizedWeight, device: torch.device) -> None:
        if weight.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size {weight.group_size} is not one torch's kernels take "
                             f"({', '.join(map(str, INT4_GROUP_SIZES))})")
        # The kernels want the output rows in whole tiles of 16: zero rows pad them, sliced off the output.
        pad = -self.out_features % INT4_ROW_TILE
        q, scales, zeros = weight.qweight, weight.scales, weight.zeros
        if pad:
            q, scales, zeros = (F.pad(t, (0, 0, 0, pad)) for t in (q, scales, zeros))
        q = q.to(device)
        if device.type == "cuda":  # two values per byte, the even column in the high nibble
            tiles = next(t for t in (8, 4, 2) if self.in_features % (16 * t) == 0)
            packed = torch._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), tiles)
        else:
            packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # (in / group, out, 2): each group's scale and offset, in the activations' dtype.
        scales_zeros = torch.stack((scales.t(), zeros.t()), dim=-1)  # type: ignore[union-attr]
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales", scales_zeros.to(device, self.compute_dtype).contiguous(), persistent=False)

    def quantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _int_linear(x, self.packed, self.scales, self.kind, self.group_size, self.pad_columns,
                           self.out_features)


class Fp8Linear(QuantizedLinear):
    """float8 e4m3 weights, a scale per output channel, activations scaled per token: torch._scaled_mm."""

    kind = "fp8"

    def _pack(self, weight: QuantizedWeight, device: torch.device) -> None:
        # torch._scaled_mm needs both weight dimensions multiples of FP8_DIM_MULTIPLE: zero-pad them.
        self.pad_columns = -self.in_features % FP8_DIM_MULTIPLE
        pad_rows = -self.out_features % FP8_DIM_MULTIPLE
        q = weight.qweight
        if self.pad_columns or pad_rows:  # through float32: e4m3 values and zeros are exact there
            q = F.pad(q.float(), (0, self.pad_columns, 0, pad_rows)).to(FP8_DTYPE)
        scales = F.pad(weight.scales.view(-1).float(), (0, pad_rows), value=1.0)
        self.register_buffer("packed", q.to(device).contiguous(), persistent=False)
        self.register_buffer("scales", scales.view(1, -1).to(device), persistent=False)

    def quantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad_columns:
            x = F.pad(x, (0, self.pad_columns))
        return _fp8_linear(x, self.packed, self.scales, self.dtype)[:, :self.out_features]


def _int_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, kind: str, group_size: int,
                pad_columns: int, out_features: int) -> torch.Tensor:
    """x (T, in) times an int8 or int4 weight through torch's weight-only kernels (the CPU's; on CUDA
    tinygemm for int4, and int8's where torch has it), in the scales' dtype (the kernel's activation dtype),
    the result in x's dtype."""
    xq = x.to(scales.dtype)
    if kind == "int4":
        int4_mm = torch._weight_int4pack_mm if packed.is_cuda else torch._weight_int4pack_mm_for_cpu
        y = int4_mm(xq, packed, group_size, scales)
        if y.shape[1] != out_features:  # the padding rows (INT4_ROW_TILE) dropped
            y = y[:, :out_features].contiguous()
    else:
        if pad_columns:
            xq = F.pad(xq, (0, pad_columns))
        y = torch._weight_int8pack_mm(xq, packed, scales)
    return y.to(x.dtype)


def float_rows(model: nn.Module) -> int | None:
    """From how many rows an iteration takes the float copies of `model`'s quantized layers: the least of
    their thresholds, its LM head's left out (it runs after the forward pass, on the sampled rows alone,
    choosing by their count). None: no float copies."""
    head = getattr(model, "lm_head", None)
    rows = [m.float_min_rows for m in model.modules()
            if isinstance(m, QuantizedLinear) and m.float_packed is not None and m is not head]
    return min(rows) if rows else None


def _fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (T, in) in `dtype` times an e4m3 weight (out, in) with per-channel scales (1, out): x scaled per
    row to e4m3 (its largest magnitude to 448), one _scaled_mm with both scales applied to its output."""
    x_scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)  # (T, 1)
    xq = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=w_scales, out_dtype=dtype)
