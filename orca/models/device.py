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


def upload_array(array: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host array (any shape) as a tensor of `dtype` on `device`: on CUDA copied into pinned memory, then
    copied over without blocking, as upload does (torch.tensor cannot pin what it builds from numpy)."""
    host = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
