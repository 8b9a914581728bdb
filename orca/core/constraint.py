"""What the engine core knows of a structured output: a token-level constraint, behind a Protocol.

The front end (orca/frontend/structured_outputs.py) compiles it; the core sees only token ids and a packed
bitmask, sent with the plan (PlannedRequest.allowed_tokens) for the sampler to mask with. Preemption needs
no rollback (a preempted request keeps its tokens); speculative decoding does: the core advances the state
over the proposals for their bitmasks, then rolls it back (docs/design.md, "Structured outputs").
"""

from __future__ import annotations

from typing import Protocol


class TokenConstraint(Protocol):
    """A request's grammar state over token ids."""

    def allowed_tokens(self) -> bytes:
        """The tokens allowed next as a packed bitmask: little-endian int32 words, bit j of word i set when
        token 32 * i + j is allowed, ceil(vocab / 32) words (xgrammar's and llguidance's layout)."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advances the state with the token drawn; False when the grammar does not allow it."""
        ...

    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted its end (a stop token): the request must stop."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last num_tokens accept()s."""
        ...
