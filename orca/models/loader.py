"""Loading a checkpoint's weights into our selectively-batched models (the workers' side; the driver only
reads the checkpoint's config, orca/checkpoint.py). Weights are read with safetensors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from orca.checkpoint import ModelConfig, read_model_config
from orca.models.gpt2 import GPT2Model
from orca.models.layers import prepack_linears
from orca.models.llama import LlamaModel
from orca.parallel import ParallelContext, shard_tensor

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
    linear_backend: str = "reference",
) -> tuple[nn.Module, ModelConfig]:
    """Builds our selectively-batched model for a Hugging Face checkpoint directory: the whole model, or
    with `par` one rank's part of it (its stage's layers, its tensor-parallel shard of each). With
    linear_backend "onednn" or "hybrid" (EngineConfig.linear_backend, resolved) its linear weights are then
    packed for oneDNN (orca/models/layers.py PackedLinear); hybrid keeps the checkpoint's weights too."""
    cfg, _ = read_model_config(checkpoint)
    cls = MODEL_CLASSES[cfg.architecture]
    par = par or ParallelContext.single(cfg.num_layers)
    with torch.device("meta"):
        model = cls(cfg, par)  # no memory and no random init: every weight is copied from the checkpoint
    model = model.to_empty(device=device).to(dtype)
    if hasattr(model, "rotary"):
        # Buffers computed at construction were lost on the meta device; build them for real.
        model.rotary = type(model.rotary)(cfg).to(device)
    reader = _SafetensorsReader(checkpoint)
    params = dict(model.named_parameters())
    weight_map = cls.hf_weight_map(cfg, par)
    if set(weight_map) != set(params):
        raise RuntimeError(f"weight map and model disagree: {sorted(set(weight_map) ^ set(params))}")
    with torch.no_grad():
        for ours, sources in weight_map.items():
            parts = []
            for source in sources:  # each HF tensor sharded before the fused ones are concatenated
                t = reader.get(_hf_name_aliases(source.name, reader))
                parts.append(shard_tensor(t.t() if source.conv1d else t, source.shard, par.tp_rank, par.tp_size))
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if tensor.shape != params[ours].shape:
                raise ValueError(
                    f"{ours}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(params[ours].shape)}"
                    + (f" (tensor-parallel rank {par.tp_rank} of {par.tp_size})" if par.tp_size > 1 else "")
                )
            params[ours].copy_(tensor)
    model.eval()
    if linear_backend in ("onednn", "hybrid"):
        prepack_linears(model, keep_weights=linear_backend == "hybrid")
    return model, cfg
