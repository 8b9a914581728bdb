"""How the engine core refuses a request (QueueFullError) and how it fails (EngineFailedError, fatal_error)."""

from __future__ import annotations

FATAL_ERROR_MARKERS = (
    "CUDA error", "AcceleratorError", "device-side assert", "illegal memory access", "unspecified launch failure",
    "CUBLAS_STATUS_", "CUDNN_STATUS_", "NCCL error", "misaligned address", "illegal instruction",
)
"""Words of an iteration's error that say the device is broken (after a CUDA error every later launch fails),
so the engine fails at once; out-of-memory is not among them: a smaller batch may fit."""


def fatal_error(error: str) -> bool:
    """Whether an iteration's error is fatal by its kind (FATAL_ERROR_MARKERS)."""
    return any(marker in error for marker in FATAL_ERROR_MARKERS)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound (EngineConfig.max_queue): retry later."""


class EngineFailedError(RuntimeError):
    """The engine's workers failed (died, hung, an iteration raised in a worker process, a device error,
    or max_consecutive_failures iterations in a row failed): it serves no more requests. Its message says
    what happened."""
