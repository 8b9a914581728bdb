"""Which backends a worker runs, and whether its device runs them.

resolve_backends turns the config's linear_backend, attention_backend and kv_cache_dtype into what this
worker uses (before any weight loads: auto's hybrid keeps a second copy of the weights only where it fits),
with the flex-by-default policy (why_not_flex_by_default: auto is flex on CUDA where its decode iterations
run in CUDA graphs). check_attention_support refuses, once the model's config is known, what the chosen
attention backend cannot run on this device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from orca.checkpoint import read_model_config, resolve_checkpoint
from orca.config import EngineConfig
from orca.models.attention import AttentionMetadata, get_backend, resolve_attention_backend
from orca.models.attention.flex import FLEX_MIN_HEAD_DIM
from orca.models.layers import resolve_linear_backend
from orca.models.loader import checkpoint_bytes
from orca.models.quantization import FP8_MIN_CAPABILITY
from orca.worker.cuda_graphs import why_no_graphs
from orca.worker.kv_cache import resolve_kv_cache_dtype

logger = logging.getLogger(__package__)  # "orca.worker": the worker's lines, whichever module says them


@dataclass(frozen=True)
class Backends:
    """What resolve_backends chose for one worker."""

    linear: str  # the linear backend (orca/models/layers.py)
    attention_backend: str  # the attention backend's name
    attention: type[AttentionMetadata]  # its metadata class (orca/models/attention/base.py)
    no_flex_reason: str | None  # why auto is not flex here (why_not_flex_by_default), None where it is
    kv_dtype: torch.dtype  # the K/V pool's dtype (kv_cache.py)


def resolve_backends(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, checkpoint: Path, ranks: int
) -> Backends:
    """The backends of a worker that is one of `ranks` (tensor x pipeline parallel), read before the weights
    load: the linear backend from this rank's share of the weights (estimated), the attention backend and
    its metadata class, the K/V pool's dtype."""
    # auto keeps a second copy of the weights (hybrid) only where it fits: this rank's share, estimated.
    weight_bytes = checkpoint_bytes(checkpoint, dtype) // ranks
    linear = resolve_linear_backend(config.linear_backend, device, dtype, weight_bytes)
    no_flex_reason = why_not_flex_by_default(config, device, checkpoint, ranks)
    attention_backend = resolve_attention_backend(config.attention_backend, device, no_flex_reason)
    if config.attention_backend == "auto" and device.type == "cuda" and no_flex_reason is not None:
        logger.info("attention_backend auto is batched, not flex, here: %s", no_flex_reason)
    # The backend: its metadata class, whose builder runs once per iteration and whose traits say what it
    # needs of the pool and of the load (orca/models/attention/base.py).
    attention: type[AttentionMetadata] = get_backend(attention_backend)
    # The K/V pool's dtype (kv_cache_dtype: the model's, or quantized values with scales), checked before the
    # weights load.
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
    logger.info("linear_backend %s -> %s, attention_backend %s -> %s (%s on %s; weights about %.0f MB)%s",
                config.linear_backend, linear, config.attention_backend, attention_backend,
                str(dtype).removeprefix("torch."), device, weight_bytes / 1e6,
                "; hybrid keeps them twice" if linear == "hybrid" else "")
    return Backends(linear, attention_backend, attention, no_flex_reason, kv_dtype)


def check_attention_support(backends: Backends, device: torch.device, head_dim: int) -> None:
    """Refuses what the attention backend cannot run on this device for a model of `head_dim` (flex's
    kernels on CUDA: the head size, a float8 pool's compute capability); logs the backend's own warning
    about the device, if any."""
    if backends.attention_backend == "flex" and device.type == "cuda" and head_dim < FLEX_MIN_HEAD_DIM:
        raise ValueError(f"attention_backend flex on CUDA needs head_dim >= {FLEX_MIN_HEAD_DIM} (torch's flex "
                         f"kernels); this model's is {head_dim}: choose batched or reference")
    if backends.attention_backend == "flex" and device.type == "cuda" and backends.kv_dtype == torch.float8_e4m3fn:
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:  # (Triton converts float8 e4m3 from compute capability 8.9 on)
            raise ValueError(
                "kv_cache_dtype fp8_e4m3 with attention_backend flex needs a GPU of compute capability 8.9 or "
                f"later (its paged decode kernel reads float8 e4m3); {device} is "
                f"{capability[0]}.{capability[1]}: choose kv_cache_dtype int8, or attention_backend batched")
    warning = backends.attention.device_warning(device)
    if warning is not None:
        logger.warning("%s", warning)


def why_not_flex_by_default(config: EngineConfig, device: torch.device, checkpoint: Path, ranks: int) -> str | None:
    """Why attention_backend auto is not flex on this configuration (resolve_attention_backend), or None when
    it is: flex is CUDA's default where its decode iterations run in CUDA graphs (why_no_graphs, on the
    checkpoint's config, read before the weights load) and it serves everything asked of it."""
    if device.type != "cuda":  # (why_no_graphs says so too; here before any checkpoint is read)
        return f"the device is {device.type}"
    if config.kv_cache_dtype != "auto":
        # flex reads a quantized pool (its paged decode kernel with the scales), but has not been measured
        # against batched on one: attention_backend flex chooses it.
        return (f"kv_cache_dtype {config.kv_cache_dtype} (flex over a quantized pool is not measured on a GPU "
                "yet; attention_backend flex chooses it)")
    if config.enable_lora:
        return "enable_lora (iterations with an adapter run without CUDA graphs)"
    checkpoints = [checkpoint] + ([resolve_checkpoint(config.speculative_model)]
                                  if config.speculative_method == "draft" and config.speculative_model else [])
    for path in checkpoints:
        mc, _ = read_model_config(path)
        reason = why_no_graphs(config.cuda_graphs, device, "flex", ranks, any(mc.moe_layers))
        if reason is not None:
            return reason
        if mc.head_dim < FLEX_MIN_HEAD_DIM:
            return f"head_dim {mc.head_dim} < {FLEX_MIN_HEAD_DIM} (torch's flex kernels)"
    return None
