"""Client side of orca_gpt: a small library over tritonclient gRPC streaming, the orca-client CLI and
the orca-bench benchmarks.

The client classes load on first use (PEP 562), so a module that needs no tritonclient
(orca_client.bench.decode, run on a GPU machine that has only torch and transformers) imports without it."""

from __future__ import annotations

from typing import Any

__all__ = ["Chunk", "OrcaClient", "OrcaError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from orca_client import client

        return getattr(client, name)
    raise AttributeError(f"module 'orca_client' has no attribute {name!r}")
