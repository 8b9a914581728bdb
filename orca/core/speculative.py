"""Speculative decoding's proposer side (EngineConfig.speculative_method): the tokens a request proposes to
verify in its next iteration. Token ids only, no tensors: the core calls it after each iteration that
drew a request a token, and the scheduler feeds what it proposed with the request's last token.

How a request's proposed tokens flow through an iteration (docs/design.md, "Speculative decoding"):

1. After an iteration draws a request's token(s), ``Proposer.propose`` looks up what followed the latest
   earlier occurrence of the request's last n tokens in its own prompt and output (prompt lookup,
   n = prompt_lookup_max down to prompt_lookup_min) and keeps up to k of them in
   ``Request.spec_token_ids``.
2. The scheduler selects the request as an increment (one token, its last), admits prompt work, then
   extends each selected increment with its proposals while the token budget and free blocks allow
   (orca/core/scheduler.py): proposals never take budget or memory a prompt needed.
3. The worker feeds the last token and the k proposals at consecutive positions in the one flattened
   iteration, with everyone else, and draws the target's own token at each of the k + 1 positions, with
   the sampler's counter-based randomness for output steps s .. s + k (orca/worker/sampler.py). It keeps
   the draws up to and including the first that differs from the proposal at its position: the accepted
   proposals and one more token (the target's correction, or a bonus token when all k are accepted).
4. The core appends them one at a time under the stop rules (an EOS, a stop token or max_tokens inside
   the run ends the request there), counts the request's computed tokens as the accepted ones only (the
   slots of rejected proposals are overwritten by the next iteration's tokens, never read: attention reads
   a request's positions below its computed length), and asks for the next proposals.

Why the output is the target's exactly: the token drawn at output step s is a function of the logits at
that position, the request's seed and s alone (the exponential race over hashed uniforms), and the
logits at a position depend only on the tokens before it. A proposal is kept only when it equals the
target's own draw there, so every kept token is the token speculation off would have drawn, greedy or
sampled: the standard rejection rule for a proposer that proposes one token with certainty (accept x with
probability p(x); on rejection draw from p without x), realised with the draw speculation off makes.

Adaptive length: a request whose proposals keep failing proposes fewer tokens, and after
SPEC_MISSES_BEFORE_PAUSE verifications in a row that kept none it stops proposing for a while (twice as
long each time, up to SPEC_MAX_PAUSE iterations), so a workload where lookup does not pay costs little.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orca.core.request import Request

SPEC_MISSES_BEFORE_PAUSE = 3
"""Verifications in a row that accepted no proposal before a request pauses proposing."""
SPEC_MAX_PAUSE = 64
"""The longest pause, in the request's iterations."""


@dataclass
class _NgramState:
    """A request's prompt-lookup index: for each n, every n-gram of its tokens that ends before the last
    token, mapped to where its latest occurrence ends (exclusive)."""

    tokens: list[int] = field(default_factory=list)
    indexed_end: int = 0  # n-grams ending at positions <= this are in `latest`
    latest: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    k: int = 0  # how many tokens to propose next (adapts)
    misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # iterations left without proposing
    last_pause: int = 0


class NgramProposer:
    """Prompt lookup (EngineConfig.speculative_method ngram): propose what followed the latest earlier
    occurrence of the request's last n tokens, n from `n_max` down to `n_min`, up to `k` tokens."""

    def __init__(self, k: int, n_min: int, n_max: int) -> None:
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, req: Request) -> list[int]:
        """Up to k tokens to verify after the request's last token (fewer near its max_tokens; none when
        nothing matches or it is pausing)."""
        state = req.proposer_state
        if state is None:
            state = req.proposer_state = _NgramState(k=self.k)
        if state.pause > 0:
            state.pause -= 1
            return []
        length = req.num_tokens
        state.tokens.extend(req.token_ids(len(state.tokens), length - len(state.tokens)))
        # Index the n-grams ending before the last token (the last one's own would find itself).
        tokens = state.tokens
        for end in range(max(state.indexed_end + 1, self.n_min), length):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                state.latest.setdefault(n, {})[tuple(tokens[end - n:end])] = end
        state.indexed_end = max(state.indexed_end, length - 1)
        # Never beyond max_tokens: the last token drawn is the one after the proposals.
        k = min(state.k, req.params.max_tokens - len(req.output_token_ids) - 1)
        if k <= 0:
            return []
        for n in range(min(self.n_max, length), self.n_min - 1, -1):
            end = state.latest.get(n, {}).get(tuple(tokens[length - n:]))
            if end is not None:
                # Copy forward from the match; past the current end the copy reads its own proposals,
                # which continues a repetition shorter than k (a period of the text).
                out: list[int] = []
                for j in range(k):
                    pos = end + j
                    out.append(tokens[pos] if pos < length else out[pos - length])
                return out
        return []

    def verified(self, req: Request, proposed: int, accepted: int) -> None:
        """A verification's outcome: `accepted` of `proposed` tokens kept. Adapts the request's length."""
        state = req.proposer_state
        if state is None or proposed == 0:
            return
        if accepted == proposed:
            state.k = min(self.k, state.k + 1)
        else:
            state.k = max(1, accepted + 1)
        if accepted:
            state.misses, state.last_pause = 0, 0
            return
        state.misses += 1
        if state.misses >= SPEC_MISSES_BEFORE_PAUSE:
            state.last_pause = min(SPEC_MAX_PAUSE, max(1, 2 * state.last_pause))
            state.pause, state.misses, state.k = state.last_pause, 0, self.k


def make_proposer(method: str, k: int, n_min: int, n_max: int) -> NgramProposer | None:
    """EngineConfig.speculative_method's proposer; None for off."""
    if method == "off":
        return None
    if method == "ngram":
        return NgramProposer(k, n_min, n_max)
    raise ValueError(f"unknown speculative_method {method!r}")
