"""Host-to-device staging of an iteration's small inputs (token ids, positions, pool slots, sampling
options). On CUDA from pinned host memory with a non-blocking copy, so the host goes on preparing while
the copy runs, ordered before the kernels on the same stream; on the CPU a plain tensor."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def upload(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a 1-D tensor of `dtype` on `device` (pinned + non-blocking on CUDA)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def upload_arrays(arrays: Sequence[np.ndarray], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Host arrays (any shapes) as tensors of `dtype` on `device`, in one copy: laid out end to end in one
    host buffer (pinned on CUDA), each returned as a view of its part of the device buffer. One pinned
    copy per iteration, since pinning is a small copy's cost (docs/BENCHMARKS.md, "Where a decode
    iteration's time goes (`scripts/experiments/decode_host_profile.py`)")."""
    # Each part starts at a multiple of ALIGN elements: kernels compiled for aligned inputs stay aligned.
    sizes = [int(np.prod(a.shape)) for a in arrays]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // ALIGN) * ALIGN)
    host = torch.zeros(starts[-1], dtype=dtype, pin_memory=device.type == "cuda")
    flat = host.numpy()
    for a, start, n in zip(arrays, starts, sizes):
        flat[start:start + n] = np.asarray(a).reshape(-1)
    buffer = host.to(device, non_blocking=True) if device.type == "cuda" else host
    return [buffer[start:start + n].view(a.shape) for a, start, n in zip(arrays, starts, sizes)]


ALIGN = 16  # elements (64 bytes of int32)
