"""Client side of orca_gpt: a small library over tritonclient gRPC streaming, the orca-client CLI and
the orca-bench benchmarks."""

from orca_client.client import Chunk, OrcaClient, OrcaError

__all__ = ["Chunk", "OrcaClient", "OrcaError"]
