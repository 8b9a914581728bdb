"""Host-to-device staging of an iteration's small inputs (token ids, positions, pool slots, sampling
options).

On CUDA each list is laid out in pinned (page-locked) host memory and copied with a non-blocking copy: the
host goes on preparing the rest of the iteration while the copy runs, ordered before the kernels that
read it on the same stream (a copy from pageable memory would make the host wait for it). Torch's caching
host allocator keeps the pinned buffers for reuse and frees each one only after its copy is done. On the
CPU the list simply becomes a tensor: nothing is pinned, nothing costs more."""

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
    host buffer (pinned on CUDA, then copied over without blocking, as upload does), each returned as a
    view of its part of the one device buffer. One pinned buffer and one copy per iteration, not one per
    array (pinning is the costly part of a small copy: docs/BENCHMARKS.md, "Where a decode iteration's
    time goes")."""
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
