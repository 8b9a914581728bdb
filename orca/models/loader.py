"""Loading a checkpoint's weights into our selectively-batched models (the workers' side; the driver only
reads the checkpoint's config, orca/checkpoint.py). Weights are read with safetensors."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from orca.checkpoint import ModelConfig, read_model_config
from orca.config import QUANTIZATIONS
from orca.models.gpt2 import GPT2Model
from orca.models.layers import HYBRID_KEEPS_WEIGHTS, RowParallelLinear, prepack_linears
from orca.models.llama import LlamaModel
from orca.models.moe import SparseMoE
from orca.models.quantization import (
    QuantizedLinear,
    QuantizedWeight,
    check_supported,
    concat_quantized,
    quantize,
    shard_quantized,
    slow_kind_warning,
)
from orca.models.quantized_checkpoints import QuantizedCheckpoint, open_quantized_checkpoint
from orca.parallel import ParallelContext, Source, shard_tensor

logger = logging.getLogger("orca.loader")

MODEL_CLASSES: dict[str, type[nn.Module]] = {"gpt2": GPT2Model, "llama": LlamaModel}


class _SafetensorsReader:
    """Reads named tensors from one or many .safetensors files (a sharded index or single file)."""

    def __init__(self, checkpoint: Path) -> None:
        index = checkpoint / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self._where = {name: checkpoint / fname for name, fname in weight_map.items()}
        else:
            files = sorted(checkpoint.glob("*.safetensors"))
            if not files:
                raise ValueError(f"{checkpoint} has no *.safetensors weights (pickle checkpoints are not loaded)")
            self._where = {}
            for f in files:
                with safe_open(f, framework="pt") as sf:
                    self._where.update({name: f for name in sf.keys()})
        self._open: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> set[str]:
        return set(self._where)

    def numel(self, name: str) -> int:
        """Elements of a tensor, from the file's header (nothing is read)."""
        return math.prod(self._file(self._where[name]).get_slice(name).get_shape())

    def _file(self, f: Path) -> Any:
        if f not in self._open:
            self._open[f] = safe_open(f, framework="pt")
        return self._open[f]

    def get(self, name: str) -> torch.Tensor:
        return self._file(self._where[name]).get_tensor(name)


def _hf_name_aliases(name: str, reader: _SafetensorsReader) -> str:
    """Checkpoints saved from the bare model (GPT2Model, LlamaModel) lack the LM wrapper's prefix."""
    if name in reader:
        return name
    for prefix in ("transformer.", "model."):
        if name.startswith(prefix) and name[len(prefix) :] in reader:
            return name[len(prefix) :]
    raise ValueError(f"checkpoint is missing tensor {name!r}")


def checkpoint_bytes(checkpoint: Path, dtype: torch.dtype) -> int:
    """What the checkpoint's tensors take in `dtype` (the whole model's weights, from the files' headers)."""
    reader = _SafetensorsReader(checkpoint)
    return sum(reader.numel(name) for name in reader.names()) * dtype.itemsize


def load_model(
    checkpoint: Path, dtype: torch.dtype, device: torch.device, par: ParallelContext | None = None,
    linear_backend: str = "reference", quantization: str = "none", group_size: int = 32,
) -> tuple[nn.Module, ModelConfig]:
    """Builds our selectively-batched model for a Hugging Face checkpoint directory: the whole model, or
    with `par` one rank's part of it (its stage's layers, its tensor-parallel shard of each).

    `quantization` picks the layers that become QuantizedLinear (plan_quantization), read quantized where
    the checkpoint stores them so, else quantized from the float weight, then sharded and packed; they hold
    no float weight during the load. With linear_backend "onednn" or "hybrid" the remaining float linears
    are packed for oneDNN (layers.py PackedLinear); hybrid also keeps float weights (HYBRID_KEEPS_WEIGHTS)
    and float copies of quantized layers (orca/tuning.py's thresholds)."""
    cfg, _ = read_model_config(checkpoint)
    cls = MODEL_CLASSES[cfg.architecture]
    par = par or ParallelContext.single(cfg.num_layers)
    stored = open_quantized_checkpoint(checkpoint)
    plan = plan_quantization(quantization, stored, device, group_size)
    float_copy = linear_backend == "hybrid"  # quantized layers keep a float copy for large iterations too
    weight_map = cls.hf_weight_map(cfg, par)
    # Our linear weights to load quantized: those every HF tensor of which is loaded quantized.
    quantize_names = {ours for ours, sources in weight_map.items()
                      if all(plan.kind_of(stored, s.name) is not None for s in sources)}

    with torch.device("meta"):
        model = cls(cfg, par)  # no memory and no random init: every weight is copied from the checkpoint
        # The linears to quantize give up their float weight before any memory is allocated for it.
        quantized = _detach_quantized_weights(model, quantize_names.__contains__)
    model = model.to_empty(device=device).to(dtype)
    if hasattr(model, "rotary"):
        # Buffers computed at construction were lost on the meta device; build them for real.
        model.rotary = type(model.rotary)(cfg).to(device)
    reader = _SafetensorsReader(checkpoint)
    params = dict(model.named_parameters())
    if set(weight_map) != set(params) | set(quantized):
        raise RuntimeError(f"weight map and model disagree: {sorted(set(weight_map) ^ (set(params) | set(quantized)))}")

    no_float = set() if stored is None else stored.stored_names()  # read these dequantized

    def read_float(source: Source) -> torch.Tensor:
        name = source.name
        if name in no_float:
            return stored.get(name).dequantize(dtype)  # type: ignore[union-attr]
        t = reader.get(_hf_name_aliases(name, reader))
        return t.t() if source.conv1d else t

    with torch.no_grad():
        for ours, sources in weight_map.items():
            if ours in quantized:
                continue
            parts = [shard_tensor(read_float(s), s.shard, par.tp_rank, par.tp_size) for s in sources]
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            _check_shape(ours, tuple(tensor.shape), tuple(params[ours].shape), par)
            params[ours].copy_(tensor)
        for ours, (parent, attr, shape) in quantized.items():
            names = [s.name for s in weight_map[ours]]
            kind = plan.head_kind(stored, names[0]) if ours == "lm_head.weight" else plan.fused_kind(stored, names)
            weight = concat_quantized([
                shard_quantized(_read_quantized(s, plan, stored, read_float, kind), s.shard, par.tp_rank, par.tp_size)
                for s in weight_map[ours]
            ])
            _check_shape(ours, tuple(weight.shape), shape, par)
            linear = getattr(parent, attr)
            layer_par = par if isinstance(linear, RowParallelLinear) else None
            setattr(parent, attr, QuantizedLinear(weight, linear.bias, device, dtype, layer_par, float_copy))
        head = _tied_head_source(model, weight_map, params, par)
        head_kind = None if head is None else plan.head_kind(stored, head.name)
        if head_kind is not None:
            weight = shard_quantized(_read_quantized(head, plan, stored, read_float, head_kind),
                                     head.shard, par.tp_rank, par.tp_size)
            model.lm_head = QuantizedLinear(weight, None, device, dtype, float_copy=float_copy)
    model.eval()
    if linear_backend in ("onednn", "hybrid"):
        prepack_linears(model, keep_weights=linear_backend == "hybrid" and dtype in HYBRID_KEEPS_WEIGHTS)
    return model, cfg


def _check_shape(ours: str, got: tuple[int, ...], expected: tuple[int, ...], par: ParallelContext) -> None:
    if got != expected:
        raise ValueError(
            f"{ours}: checkpoint shape {got} != expected {expected}"
            + (f" (tensor-parallel rank {par.tp_rank} of {par.tp_size})" if par.tp_size > 1 else "")
        )


# -- quantization (EngineConfig.quantization) ----------------------------------------------------------------
@dataclass(frozen=True)
class QuantizationPlan:
    """What EngineConfig.quantization means for one checkpoint on one device.

    kind: the kind every linear weight is brought to (quantized at load when stored float, dequantized and
    quantized again when stored in another kind), or None. keep_stored: weights the checkpoint stores
    quantized stay in their own kind (quantization auto); a float one stays float."""

    kind: str | None
    keep_stored: bool
    group_size: int

    def kind_of(self, stored: QuantizedCheckpoint | None, name: str) -> str | None:
        """The kind HF tensor `name` is loaded as, or None (float)."""
        if self.keep_stored:
            return None if stored is None else stored.kind_of(name)
        return self.kind

    def fused_kind(self, stored: QuantizedCheckpoint | None, names: list[str]) -> str:
        """The kind of one of our weights made of several HF tensors (q | k | v, gate | up): theirs when
        they agree, else the widest (int8; a GGUF file mixing Q4_0 and Q8_0), the others requantized."""
        kinds = {self.kind_of(stored, name) for name in names}
        return kinds.pop() if len(kinds) == 1 else min(kinds, key=KIND_WIDTH_ORDER.index)  # type: ignore[arg-type]

    def head_kind(self, stored: QuantizedCheckpoint | None, name: str) -> str | None:
        """The LM head's kind (its own weight, or the embedding's `name` for a tied head): as stored under
        auto; int8 where the plan is int4, since its error goes straight into the logits (docs/BENCHMARKS.md,
        "Quality: perplexity (`orca-bench perplexity`)"); the plan's kind otherwise."""
        kind = self.kind_of(stored, name)
        return "int8" if not self.keep_stored and kind == "int4" else kind


KIND_WIDTH_ORDER = ("fp8", "int8", "int4")  # widest first: where one layer's parts are stored in several


def plan_quantization(choice: str, stored: QuantizedCheckpoint | None, device: torch.device,
                      group_size: int = 32) -> QuantizationPlan:
    """EngineConfig.quantization for a checkpoint (`stored`: its quantized tensors, None for a float one)
    on a device; ValueError where a kind cannot run there."""
    if choice not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {choice!r}")
    if choice == "auto":
        if stored is None:
            return QuantizationPlan(None, False, group_size)
        for kind in sorted(stored.kinds()):
            try:
                check_supported(kind, device)
            except ValueError as e:
                raise ValueError(f"this {stored.format} checkpoint holds {kind} weights (quantization auto): {e}; "
                                 "int8, int4 and none dequantize them at load") from None
            _warn_if_slow(kind, device)
        return QuantizationPlan(None, True, group_size)
    if choice == "none":
        return QuantizationPlan(None, False, group_size)
    check_supported(choice, device)
    _warn_if_slow(choice, device)
    return QuantizationPlan(choice, False, group_size)


def _warn_if_slow(kind: str, device: torch.device) -> None:
    warning = slow_kind_warning(kind, device)
    if warning:
        logger.warning(warning)


def _quantizable(parent: nn.Module, child: nn.Module) -> bool:
    """The linear layers quantization applies to: every plain and row-parallel linear but a mixture's
    router (a few columns that decide which experts run: kept float, as vLLM keeps it)."""
    return type(child) in (nn.Linear, RowParallelLinear) and not isinstance(parent, SparseMoE)


def _detach_quantized_weights(
    model: nn.Module, to_quantize: Callable[[str], bool]
) -> dict[str, tuple[nn.Module, str, tuple[int, int]]]:
    """On the meta device: drops the float weight of every quantizable linear whose weight `to_quantize`
    (the bias stays a parameter, loaded as usual), so none is ever allocated. Returns {our weight name:
    (parent, attribute, shape)}."""
    detached = {}
    for parent_name, parent in list(model.named_modules()):
        for attr, child in list(parent.named_children()):
            name = f"{parent_name}.{attr}.weight" if parent_name else f"{attr}.weight"
            if _quantizable(parent, child) and to_quantize(name):
                detached[name] = (parent, attr, tuple(child.weight.shape))
                del child.weight
                child.register_parameter("weight", None)
    return detached


def _read_quantized(source: Source, plan: QuantizationPlan, stored: QuantizedCheckpoint | None,
                    read_float: Callable[[Source], torch.Tensor], kind: str | None = None) -> QuantizedWeight:
    """One HF tensor as a QuantizedWeight of `kind` (default: the plan's for it): as stored where it is
    stored in that kind, else quantized from its float (dequantized) form."""
    kind = kind or plan.kind_of(stored, source.name)
    if kind is None:
        raise ValueError(f"{source.name} is stored float, but quantization auto asked for it quantized")
    if stored is not None and stored.kind_of(source.name) == kind:
        return stored.get(source.name)  # type: ignore[return-value]
    try:
        return quantize(read_float(source), kind, plan.group_size)
    except ValueError as e:
        raise ValueError(f"quantization {kind}, {source.name}: {e}") from None


def _tied_head_source(model: nn.Module, weight_map: dict[str, list[Source]], params: dict[str, nn.Parameter],
                      par: ParallelContext) -> Source | None:
    """The embedding's source when this rank computes logits through a head tied to it, else None."""
    if not par.is_last_stage or not model.config.tie_word_embeddings or model.input_embedding is None:
        return None
    embedding = model.input_embedding.weight
    for ours, sources in weight_map.items():
        if params.get(ours) is embedding:
            return sources[0]
    raise RuntimeError("the tied LM head's embedding is not in the weight map")
