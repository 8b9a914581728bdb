"""What the orca-bench commands share that needs neither tritonclient nor a server: the machine record and
the JSON output every command writes, and driving transformers' continuous batching (the in-process
reference of `orca-bench offline` and `orca-bench decode`). orca_client.bench.decode imports only this,
so it runs where only torch and transformers are installed."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    cpu, flags = None, []
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():  # the first processor's
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu is None:
                cpu = value.strip()
            elif key.strip() == "flags":
                flags = value.split()
                break
    return {
        "cpu": cpu or platform.processor() or platform.machine(),
        # what decides the dtype and the kernels on a CPU (orca.config's bfloat16 rule, oneDNN's paths)
        "cpu_flags": [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags],
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(path: str, result: dict[str, Any], quiet: bool = False) -> None:
    """`result` as JSON at `path`, replaced whole (written beside it, then renamed: a reader never sees half)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    partial.write_text(json.dumps(result, indent=1, allow_nan=False, default=_json_default) + "\n")
    partial.replace(target)
    if not quiet:
        print(f"wrote {path}")


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def cb_page_size(config: Any) -> int:
    """Tokens per K/V page of transformers' continuous batching: ``page_size`` since transformers 5.17's
    successors, ``block_size`` in 5.17 itself (the GPU machine's)."""
    size = getattr(config, "page_size", None)
    return int(size if size is not None else config.block_size)


def cb_generate(
    manager: Any, prompts: Sequence[list[int]], max_new: Sequence[int], ids: Sequence[str]
) -> list[list[int]]:
    """Each prompt through transformers' continuous batching (`manager`, from
    model.continuous_batching_context_manager) as request ids[i] with max_new[i] new tokens, EOS disabled;
    waits for all of them and returns their generated tokens in order."""
    for request_id, prompt, n in zip(ids, prompts, max_new):
        manager.add_request(prompt, request_id=request_id, max_new_tokens=n, eos_token_id=-1)
    finished: dict[str, Any] = {}
    while len(finished) < len(ids):
        out = manager.get_result(timeout=600)
        if out is None:
            raise RuntimeError(f"transformers' continuous batching stopped with {len(ids) - len(finished)} left")
        if out.is_finished():
            if out.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed {out.request_id}: {out.error}")
            finished[out.request_id] = out
    return [list(finished[i].generated_tokens) for i in ids]
