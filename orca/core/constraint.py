"""What the engine core knows of a structured output: a token-level constraint, behind a Protocol.

The front end (orca/frontend/structured_outputs.py) compiles a request's JSON schema, regex, choice or
grammar with the model's tokenizer and hands the core a ``TokenConstraint``: the core never sees the
grammar, the text or a tensor, only token ids and a packed bitmask. Per iteration, for each constrained
request that samples, the core asks for the bitmask of the tokens allowed next and sends it to the workers
with the plan (PlannedRequest.allowed_tokens); the sampler masks that request's logits row with it, in the
same batched call as every other row. When the token returns, the core advances the constraint with it.

Preemption needs no rollback here: a preempted request keeps the tokens it generated (it recomputes their
keys and values when readmitted), so its constraint's state stays the state after its last token.
Speculative decoding does (orca/core/speculative.py): the core advances the state over a request's
proposed tokens to get the bitmask at each proposed position (and to drop the proposals the grammar
refuses), then rolls it back; the tokens the iteration keeps advance it as usual.
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
