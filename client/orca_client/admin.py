"""The admin key of Triton's administrative APIs, as a client sends it.

The launcher (orca_server) starts Triton with its model-repository, shared-memory, logging, trace and
statistics APIs restricted to requests carrying this key (README "Security"); orca-openai (its model index)
and orca-bench trace (its reloads) send it.
"""

from __future__ import annotations

import os
from pathlib import Path

ADMIN_KEY_HEADER = "admin-key"
"""The HTTP header that carries the admin key (the key of Triton's --http-restricted-api)."""

GRPC_ADMIN_KEY_HEADER = f"triton-grpc-protocol-{ADMIN_KEY_HEADER}"
"""The same key's gRPC metadata key: Triton prefixes the --grpc-restricted-protocol header's name so."""

ADMIN_KEY_ENV = "ORCA_ADMIN_KEY"
"""The environment variable the launcher, orca-openai and orca-bench read the admin key from."""


def admin_key(path: str | os.PathLike[str] | None = None) -> str | None:
    """The admin key: $ORCA_ADMIN_KEY, else the first line of the file at `path` (None when it does not exist
    yet: the launcher writes it at start), else None."""
    key = os.environ.get(ADMIN_KEY_ENV, "").strip()
    if key or path is None:
        return key or None
    try:
        return Path(path).read_text().strip() or None
    except FileNotFoundError:
        return None


def grpc_headers(key: str | None) -> dict[str, str] | None:
    """tritonclient.grpc's ``headers=`` for an administrative call (None without a key)."""
    return {GRPC_ADMIN_KEY_HEADER: key} if key else None
