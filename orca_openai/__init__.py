"""orca-openai: an OpenAI-compatible HTTP API (completions, chat completions, models) in front of Triton.

It talks to Triton over tritonclient's asyncio gRPC client, one bidirectional stream per request, so it can
front a local or a remote tritonserver serving orca models (decoupled, with orca_gpt's inputs).
The README ("Use it from the OpenAI client") says what it supports and what it refuses.
"""

from orca_openai.app import Settings, create_app

__all__ = ["Settings", "create_app"]
