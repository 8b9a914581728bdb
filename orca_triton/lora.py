"""LoRA adapters in the Triton model (README.md, "LoRA adapters in Triton and the OpenAI API"): which adapters it
serves at load (vllm_backend's multi_lora.json beside the config's lora_modules) and the in-band control requests
that list, load and unload adapters while it runs (the `lora_control` input; orca-openai's /v1/models,
/v1/load_lora_adapter and /v1/unload_lora_adapter use them). A run-time load reads only from inside the
model's lora_root (confine_lora_path), and reads the files on its caller's thread, not the engine's
(load_at_run_time, through EngineLoop.add_lora). Nothing here calls into Triton."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orca.config import EngineConfig, parse_lora_modules
from orca.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

logger = logging.getLogger("orca_gpt")

MULTI_LORA_FILENAME = "multi_lora.json"
"""vllm_backend's file of adapters, {"adapter name": "adapter directory"}, in the model's version directory
(beside model.py, where vllm_backend reads it: pb_utils.get_model_dir())."""

CONTROL_INPUT = "lora_control"
"""The optional input of a control request: a JSON object {"action": "list" | "load" | "unload", "lora_name",
"lora_path"}; its one response carries a JSON object in text_output."""

CONTROL_ACTIONS = ("list", "load", "unload")


def read_multi_lora(version_dir: str | Path, config: EngineConfig) -> dict[str, str]:
    """The adapters of `version_dir`/multi_lora.json ({} without one), paths made absolute against the file's
    directory. ValueError naming the fix for a file without enable_lora true, a malformed one, or a name the
    config's lora_modules also gives (the two lists are merged: each name once)."""
    path = Path(version_dir) / MULTI_LORA_FILENAME
    if not path.is_file():
        return {}
    if not config.enable_lora:
        raise ValueError(f"{path} lists LoRA adapters but enable_lora is off: set the parameter enable_lora to "
                         '"true" in config.pbtxt to serve them (or remove the file)')
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a JSON object of adapter names and paths: {exc}") from None
    if not isinstance(raw, dict) or not all(isinstance(k, str) and k.strip() and isinstance(v, str) and v.strip()
                                            for k, v in raw.items()):
        raise ValueError(f'{path} must be a JSON object {{"adapter name": "adapter directory", ...}}, got {raw!r}')
    in_config = parse_lora_modules(config.lora_modules)
    if both := sorted(set(raw) & set(in_config)):
        raise ValueError(f"{path} and the parameter lora_modules both name adapter(s) {', '.join(both)}: name each "
                         "adapter once")
    return {name: str((path.parent / p).resolve()) for name, p in raw.items()}


@dataclass(frozen=True)
class ControlRequest:
    action: str
    lora_name: str | None = None
    lora_path: str | None = None


def parse_control(text: str) -> ControlRequest:
    """The lora_control input's JSON; ValueError naming what is wrong."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{CONTROL_INPUT} must be a JSON object: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{CONTROL_INPUT} must be a JSON object, got {raw!r}")
    unknown = set(raw) - {"action", "lora_name", "lora_path"}
    if unknown:
        raise ValueError(f"{CONTROL_INPUT}: unknown key(s) {', '.join(sorted(unknown))}")
    action = raw.get("action")
    if action not in CONTROL_ACTIONS:
        raise ValueError(f"{CONTROL_INPUT}: action must be one of {', '.join(CONTROL_ACTIONS)}, got {action!r}")
    name, path = raw.get("lora_name"), raw.get("lora_path")
    if action != "list" and (not isinstance(name, str) or not name.strip()):
        raise ValueError(f"{CONTROL_INPUT}: {action} needs lora_name, the adapter's name (a non-empty string)")
    if action == "load" and (not isinstance(path, str) or not path.strip()):
        raise ValueError(f"{CONTROL_INPUT}: load needs lora_path, the adapter's directory on the Triton host")
    return ControlRequest(action, name, path)


def check_control(req: ControlRequest, config: EngineConfig, model_name: str) -> None:
    """ValueError naming the fix when the model may not carry out `req`: load and unload need enable_lora and
    allow_runtime_lora_updating (list is always answered)."""
    if req.action == "list":
        return
    if not config.enable_lora:
        raise ValueError(f'{model_name} serves no LoRA adapters: set its parameter enable_lora to "true" to load them')
    if not config.allow_runtime_lora_updating:
        raise ValueError(f"{model_name} does not load or unload LoRA adapters at run time: set its parameter "
                         'allow_runtime_lora_updating to "true" to allow it')
    if req.action == "load" and not config.lora_root:
        raise ValueError(f"{model_name} loads no LoRA adapters at run time without lora_root: set its parameter "
                         "lora_root to the directory they may be loaded from")


def confine_lora_path(name: str, lora_path: str, lora_root: str) -> str:
    """The adapter directory a run-time load may read: `lora_path` (absolute, or relative to lora_root)
    resolved (symlinks followed, `..` collapsed), which must lie inside lora_root and hold adapter_config.json
    and adapter_model.safetensors, regular files that resolve inside lora_root too. Anything else is one
    ValueError, the same text whatever the reason (outside the root, missing, not an adapter), so that the
    answer tells a client nothing of the host's directories; the reason goes to the server's log."""
    directory, reason = _adapter_under(lora_path, lora_root)
    if directory is None:
        logger.warning("run-time load of LoRA adapter %r from %r refused: %s", name, lora_path, reason)
        raise ValueError(f"LoRA adapter {name!r}: lora_path {lora_path!r} is not an adapter directory under "
                         "lora_root")
    return str(directory)


def _adapter_under(lora_path: str, lora_root: str) -> tuple[Path | None, str]:
    """(the resolved adapter directory, ""), or (None, why lora_path is none under lora_root)."""
    try:
        root = Path(lora_root).resolve(strict=True)
        if not root.is_dir():
            return None, f"lora_root {lora_root} is not a directory"
        directory = (root / lora_path).resolve()  # an absolute lora_path replaces root
        if not directory.is_relative_to(root):
            return None, f"it resolves to {directory}, outside lora_root {root}"
        if not directory.is_dir():
            return None, f"{directory} is no directory"
        for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            target = (directory / file).resolve()
            if not target.is_relative_to(root):
                return None, f"{directory / file} resolves to {target}, outside lora_root {root}"
            if not target.is_file():  # (a FIFO or a device would hang or flood the read)
                return None, f"{directory} has no {file} (a regular file)"
    except (OSError, RuntimeError, ValueError) as exc:  # unreadable, a symlink loop, a NUL byte
        return None, f"{type(exc).__name__}: {exc}"
    return directory, ""


def load_at_run_time(loop: Any, req: ControlRequest) -> Any:
    """A lora_control load on `loop` (an EngineLoop; check_control passed): the path confined to lora_root
    (confine_lora_path), then EngineLoop.add_lora, which reads and checks the adapter's files here, on the
    caller's thread, and registers it on the engine's thread between iterations: a slow disk holds up this
    load, never an iteration (the workers get the adapter as read here with the next plan: none reads the
    files again). Returns the LoRARequest; ValueError (LoRAError among them) names the adapter and the
    reason."""
    path = confine_lora_path(req.lora_name, req.lora_path, loop.core.config.lora_root)
    return loop.add_lora(req.lora_name, path)


def adapters_json(loras: list[Any]) -> list[dict[str, str]]:
    """The served adapters (LoRARequests) as the list action answers them."""
    return [{"name": lora.name, "path": lora.path} for lora in loras]
