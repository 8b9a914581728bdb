"""Speculative decoding's proposer side (EngineConfig.speculative_method): the tokens a request proposes to
verify in its next iteration. Token ids only: the core calls it after each iteration that drew a request
a token. ``NgramProposer`` looks them up in the request's own tokens, ``DraftProposer`` takes what the
worker's draft model drafted; both adapt the length and pause after misses (``AdaptiveProposer``; the
limits are orca/tuning.py's). The flow and why the output is the target's exactly: docs/design.md,
"Speculative decoding".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from orca.checkpoint import ModelConfig
from orca.core.request import Request
from orca.tuning import SPEC_MAX_PAUSE, SPEC_MISSES_BEFORE_PAUSE


@dataclass
class _AdaptiveState:
    """A request's adaptive proposal length and pause (both methods)."""

    k: int = 0  # how many tokens to propose next (adapts)
    misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # iterations left without proposing
    last_pause: int = 0


@dataclass
class _NgramState(_AdaptiveState):
    """A request's prompt-lookup index: for each n, every n-gram of its tokens that ends before the last
    token, mapped to where its latest occurrence ends (exclusive)."""

    tokens: list[int] = field(default_factory=list)
    indexed_end: int = 0  # n-grams ending at positions <= this are in `latest`
    latest: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)


class AdaptiveProposer:
    """What both methods share: a request's proposal length adapts to what its verifications keep, and
    it pauses after repeated misses. `k` is the longest (num_speculative_tokens)."""

    state_class: type[_AdaptiveState] = _AdaptiveState

    def __init__(self, k: int) -> None:
        self.k = k

    def _state(self, req: Request) -> _AdaptiveState:
        if req.proposer_state is None:
            req.proposer_state = self.state_class(k=self.k)
        return req.proposer_state

    def _length(self, req: Request, state: _AdaptiveState) -> int:
        """How many tokens the request proposes now: its adaptive length, never beyond max_tokens (the
        last token drawn is the one after the proposals)."""
        return min(state.k, req.params.max_tokens - len(req.output_token_ids) - 1)

    def num_to_propose(self, req: Request, verifying: int) -> int:
        """At plan time: how many tokens the worker should draft for the member after its iteration
        (PlannedRequest.num_to_propose). 0: a proposer of the core's own (n-gram) needs no draft."""
        return 0

    def propose(self, req: Request, drafted: Sequence[int] = ()) -> list[int]:
        """After an iteration that drew the request's token(s): the tokens it proposes for its next one.
        `drafted`: what the worker drafted for it (StepResult.proposals; the draft method's)."""
        raise NotImplementedError

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


class NgramProposer(AdaptiveProposer):
    """Prompt lookup (EngineConfig.speculative_method ngram): propose what followed the latest earlier
    occurrence of the request's last n tokens, n from `n_max` down to `n_min`, up to `k` tokens."""

    state_class = _NgramState

    def __init__(self, k: int, n_min: int, n_max: int) -> None:
        super().__init__(k)
        self.n_min, self.n_max = n_min, n_max

    def propose(self, req: Request, drafted: Sequence[int] = ()) -> list[int]:
        """Up to k tokens to verify after the request's last token (fewer near its max_tokens; none when
        nothing matches or it is pausing). Looked up here: `drafted` is unused."""
        state = self._state(req)
        assert isinstance(state, _NgramState)
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
        k = self._length(req, state)
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


class DraftProposer(AdaptiveProposer):
    """A draft model (EngineConfig.speculative_method draft): the worker drafts each request's next
    tokens after the iteration that drew its last one; this side decides how many and takes them."""

    def num_to_propose(self, req: Request, verifying: int) -> int:
        """At plan time, for a member whose iteration draws its next token(s): how many tokens the worker
        should draft after it (PlannedRequest.num_to_propose). An upper bound: the iteration's outcome
        (`verifying` proposals checked) may lower the request's length, and its kept tokens its room
        before max_tokens (which the worker caps by); 0 while the request pauses."""
        state = self._state(req)
        if state.pause > 0:
            return 0
        k = min(self.k, state.k + 1) if verifying else state.k  # a full acceptance lengthens it by one
        # At least one token is kept, so at most max_tokens - (output + 1) - 1 fit.
        return max(0, min(k, req.params.max_tokens - len(req.output_token_ids) - 2))

    def propose(self, req: Request, drafted: Sequence[int] = ()) -> list[int]:
        """After the iteration: the tokens the worker drafted (StepResult.proposals), cut to the request's
        length and room; none while it pauses (counting the pause down)."""
        state = self._state(req)
        if state.pause > 0:
            state.pause -= 1
            return []
        return list(drafted[: max(0, self._length(req, state))])


def check_draft_model(draft: ModelConfig, target: ModelConfig, max_model_len: int, path: object) -> None:
    """Refuses (ValueError) a draft model (EngineConfig.speculative_model, at `path`) that cannot propose
    for the target: another vocabulary size (its draws are token ids of the target's vocabulary), or fewer
    positions than a request may reach (max_model_len)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_model {path} has a vocabulary of {draft.vocab_size} tokens and the model one of "
            f"{target.vocab_size}: a draft model must have the model's vocabulary size"
        )
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_model {path} takes {draft.max_position_embeddings} positions, fewer than max_model_len "
            f"{max_model_len}: give max_model_len <= {draft.max_position_embeddings} or a draft model with more"
        )


def make_proposer(method: str, k: int, n_min: int, n_max: int) -> AdaptiveProposer | None:
    """EngineConfig.speculative_method's proposer; None for off."""
    if method == "off":
        return None
    if method == "ngram":
        return NgramProposer(k, n_min, n_max)
    if method == "draft":
        return DraftProposer(k)
    raise ValueError(f"unknown speculative_method {method!r}")
