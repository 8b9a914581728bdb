"""EngineConfig's options given as strings: a Triton config.pbtxt's `parameters` (EngineConfig.from_parameters)
and a control_address host taken from an environment variable. Pure parsing: EngineConfig validates the values."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

INT_OPTIONS = (
    "max_bs", "n_slots", "kv_cache_bytes", "max_queue", "n_workers", "max_model_len", "seed", "block_size",
    "max_num_batched_tokens", "tensor_parallel_size", "pipeline_parallel_size", "local_workers",
    "trace_max_bytes", "trace_backups", "quantization_group_size", "num_speculative_tokens", "prompt_lookup_min",
    "prompt_lookup_max", "speculative_disable_by_batch_size", "max_loras", "max_lora_rank",
    "max_consecutive_failures",
)
FLOAT_OPTIONS = ("gpu_memory_utilization", "worker_timeout")
BOOL_OPTIONS = ("enable_prefix_caching", "enable_lora", "allow_runtime_lora_updating")
BOOL_VALUES = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
"""The spellings a boolean parameter may take (case-insensitive)."""


def options_from_parameters(
    names: Iterable[str],
    raw: Mapping[str, str],
    fixed: Mapping[str, Any] | None = None,
    not_settable: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """EngineConfig's keyword arguments from string options `raw` (see EngineConfig.from_parameters), `names`
    its fields. Empty means the default; an empty `model` falls back to $ORCA_MODEL. ValueError names an
    unknown key, a key in `not_settable` (with its reason) or a malformed value."""
    not_settable = dict(not_settable or {})
    options: dict[str, Any] = dict(fixed or {})
    values = {k: v.strip() for k, v in raw.items() if v.strip()}
    if "model" not in values and os.environ.get("ORCA_MODEL"):
        values["model"] = os.environ["ORCA_MODEL"]
    allowed = [n for n in names if n not in not_settable and n not in options]
    for key, value in values.items():
        if key in not_settable:
            raise ValueError(f"parameter {key!r} cannot be set here: {not_settable[key]}")
        if key not in allowed:
            raise ValueError(f"unknown parameter {key!r}; allowed: {', '.join(allowed)}")
        if key in INT_OPTIONS:
            try:
                options[key] = int(value)
            except ValueError:
                raise ValueError(f"parameter {key} must be an integer, got {value!r}") from None
        elif key in BOOL_OPTIONS:
            if value.lower() not in BOOL_VALUES:
                raise ValueError(f"parameter {key} must be true or false, got {value!r}")
            options[key] = BOOL_VALUES[value.lower()]
        elif key in FLOAT_OPTIONS:
            try:
                options[key] = float(value)
            except ValueError:
                raise ValueError(f"parameter {key} must be a number, got {value!r}") from None
        else:
            options[key] = value
    return options


def host_from_environment(address: str) -> str:
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
