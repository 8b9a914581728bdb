"""A model's recommended sampling: the defaults its checkpoint's generation_config.json gives.

Models ship the sampling their authors recommend in generation_config.json; vLLM uses it by default
(``--generation-config auto``). The front end reads it once per model (read_sampling_defaults) and
fills in the keys a request leaves out (with_sampling_defaults): temperature, top_k and top_p where
present (the SamplingParams fields such a file can hold; its max_new_tokens is not a default, as in
vLLM's OpenAI server). A request's own value always wins. A value SamplingParams would refuse is left
out with a warning, so a bad file never fails every request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orca.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
SAMPLING_DEFAULT_KEYS = ("temperature", "top_k", "top_p")
"""The keys of generation_config.json that become sampling defaults."""


def read_sampling_defaults(checkpoint: Path | str) -> dict[str, Any]:
    """{key: value} of SAMPLING_DEFAULT_KEYS that the checkpoint's generation_config.json gives (not
    null, and valid as a SamplingParams value); {} when it has none or no such file."""
    path = Path(checkpoint) / GENERATION_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s: %s", path, exc)
        return {}
    if not isinstance(raw, dict):
        logger.warning("ignoring %s: not a JSON object", path)
        return {}
    defaults: dict[str, Any] = {}
    for key in SAMPLING_DEFAULT_KEYS:
        value = raw.get(key)
        if value is None:
            continue
        try:
            SamplingParams(**{key: value})
        except ValueError as exc:
            logger.warning("ignoring %s's %s: %s", path, key, exc)
            continue
        defaults[key] = value
    return defaults


def with_sampling_defaults(values: Mapping[str, Any], defaults: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's sampling values (the keys it gave) over the model's defaults: a given key wins."""
    return {**(defaults or {}), **values}


def describe_sampling_defaults(defaults: Mapping[str, Any], checkpoint: Path | str) -> str:
    """One line for the load log: which defaults apply to a request that leaves them out."""
    base = SamplingParams()
    if defaults:
        given = ", ".join(f"{k}={defaults[k]}" for k in SAMPLING_DEFAULT_KEYS if k in defaults)
        rest = [k for k in SAMPLING_DEFAULT_KEYS if k not in defaults]
        others = f"; {', '.join(f'{k}={getattr(base, k)}' for k in rest)}" if rest else ""
        return (f"sampling defaults from {Path(checkpoint) / GENERATION_CONFIG_FILE}: {given}{others} "
                "(a request's own values win)")
    return (f"sampling defaults: temperature={base.temperature}, top_k={base.top_k} (off), top_p={base.top_p} "
            f"(off); {Path(checkpoint) / GENERATION_CONFIG_FILE} gives no temperature, top_k or top_p")


__all__ = ["GENERATION_CONFIG_FILE", "SAMPLING_DEFAULT_KEYS", "describe_sampling_defaults", "read_sampling_defaults",
           "with_sampling_defaults"]
