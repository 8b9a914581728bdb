"""The output side of the front end: the engine core's deltas in, each request's RequestOutput out.

The core (orca/core/engine.py) reports per iteration only what changed for a request (EngineCoreOutput: new
token ids, their TokenLogprobs, how it finished). ``OutputProcessor`` keeps, per request, everything that
accumulates: the generated ids, the logprob entries and their sum, and the incremental detokenizer with
the stop strings (orca/frontend/detokenizer.py). It runs where outputs are consumed (the Triton model's response
thread, LLM.generate, the request-level baseline), never on the scheduler thread, and builds each
RequestOutput in O(new tokens): the cumulative fields (token_ids, logprobs, text) are read from the
request's history only when a consumer asks for them.

A stop string is text, so the core cannot see it: when the detokenizer finds one, the request finishes
here ("stop"; its text ends before the stop string) and the caller must abort it in the core
(``Processed.aborts``). What the core sends for it afterwards (a token of the next iteration, its
"cancelled" final output) is dropped: the client never sees it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from orca.core.outputs import EngineCoreOutput
from orca.core.plan import TokenLogprobs
from orca.core.request import FinishReason
from orca.frontend.detokenizer import IncrementalDetokenizer
from orca.frontend.tokenizer import Tokenizer
from orca.sampling_params import SamplingParams


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability at one output position and its rank there (1 = the most likely)."""

    logprob: float
    rank: int


def logprob_entry(t: TokenLogprobs) -> dict[int, Logprob]:
    """vLLM's layout of one position's logprobs: {token id: Logprob}, the drawn token first, then the top n."""
    entry = {t.token_id: Logprob(t.logprob, t.rank)}
    for rank, (token_id, logprob) in enumerate(zip(t.top_ids, t.top_logprobs), start=1):
        entry.setdefault(token_id, Logprob(logprob, rank))
    return entry


_ENDS_TEXT = (FinishReason.STOP, FinishReason.LENGTH)


class RequestOutput:
    """What one iteration did to one request (or, when finished, the final state).

    new_token_ids: generated in this iteration (empty on cancellation, error or a prompt chunk).
    token_ids: all generated so far. finish_reason: "length", "stop", "cancelled" or "error" once finished.
    num_cached_tokens: prompt tokens whose keys and values came from the prefix cache when the request was
    first admitted (EngineCoreOutput.num_cached_tokens); 0 before its admission and with caching off.
    text_delta / text: the new completion text and all of it so far (None when the model has no
    tokenizer). logits: the (V,) float32 row this iteration sampled from, when logits capture is on.
    With SamplingParams.logprobs set (else None): new_logprobs / logprobs give, for each of new_token_ids /
    token_ids, {token id: Logprob} (the drawn token first, then the top n); cumulative_logprob is their sum.

    Built by the OutputProcessor in O(new tokens): token_ids, logprobs and text are views of the request's
    history as it was at this output, copied only when read (num_output_tokens is their length, free).
    """

    __slots__ = (
        "request_id", "new_token_ids", "num_prompt_tokens", "finished", "finish_reason", "error", "text_delta",
        "arrival_time", "first_token_time", "finish_time", "logits", "new_logprobs", "cumulative_logprob",
        "num_output_tokens", "num_cached_tokens", "_token_ids", "_logprobs", "_text", "_text_len",
    )

    def __init__(
        self,
        request_id: str,
        new_token_ids: list[int],
        token_ids: list[int],
        num_prompt_tokens: int,
        finished: bool,
        finish_reason: str | None = None,
        error: str | None = None,
        text_delta: str | None = None,
        text: str | None = None,
        arrival_time: float = 0.0,
        first_token_time: float | None = None,
        finish_time: float | None = None,
        logits: Any = None,
        new_logprobs: list[dict[int, Logprob]] | None = None,
        logprobs: list[dict[int, Logprob]] | None = None,
        cumulative_logprob: float | None = None,
        num_cached_tokens: int = 0,
    ) -> None:
        self.request_id = request_id
        self.new_token_ids = new_token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.finished = finished
        self.finish_reason = finish_reason
        self.error = error
        self.text_delta = text_delta
        self.arrival_time = arrival_time
        self.first_token_time = first_token_time
        self.finish_time = finish_time
        self.logits = logits
        self.new_logprobs = new_logprobs
        self.cumulative_logprob = cumulative_logprob
        self.num_output_tokens = len(token_ids)
        self.num_cached_tokens = num_cached_tokens
        self._token_ids = token_ids  # kept, not copied: the history only grows, so [:num_output_tokens] is
        self._logprobs = logprobs  # this output's view of it
        self._text: Any = text  # a str, or the detokenizer whose .text starts with this output's text
        self._text_len = None if text is None else len(text)

    @classmethod
    def _view(cls, state: _RequestState, new_token_ids: list[int], new_logprobs: Any, text_delta: str | None,
              finish_reason: str | None, error: str | None, logits: Any) -> RequestOutput:
        """The output as `state` stands: its history lists shared (the constructor keeps references and
        their lengths), its text read from the detokenizer up to what it has emitted, when asked for."""
        out = cls(
            state.request_id, new_token_ids, state.token_ids, state.num_prompt_tokens, finish_reason is not None,
            finish_reason, error, text_delta, None, state.arrival_time, state.first_token_time, state.finish_time,
            logits, new_logprobs, state.logprobs, state.cumulative_logprob, state.num_cached_tokens,
        )
        detok = state.detokenizer
        if detok is not None:
            out._text, out._text_len = detok, detok.emitted
        return out

    @property
    def token_ids(self) -> list[int]:
        return self._token_ids[: self.num_output_tokens]

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        return None if self._logprobs is None else self._logprobs[: self.num_output_tokens]

    @property
    def text(self) -> str | None:
        source = self._text
        if source is None or isinstance(source, str):
            return source
        return source.text[: self._text_len]

    def replace(self, **changes: Any) -> RequestOutput:
        """A copy with `changes` (any constructor argument)."""
        values = {
            name: getattr(self, name) for name in (
                "request_id", "new_token_ids", "token_ids", "num_prompt_tokens", "finished", "finish_reason",
                "error", "text_delta", "text", "arrival_time", "first_token_time", "finish_time", "logits",
                "new_logprobs", "logprobs", "cumulative_logprob", "num_cached_tokens",
            )
        }
        values.update(changes)
        return RequestOutput(**values)

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, new_token_ids={self.new_token_ids}, "
                f"num_output_tokens={self.num_output_tokens}, finished={self.finished}, "
                f"finish_reason={self.finish_reason!r}, error={self.error!r})")


@dataclass(eq=False)
class _RequestState:
    request_id: str
    num_prompt_tokens: int
    arrival_time: float
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0  # the core's, from the request's first admission on


@dataclass
class Processed:
    """process()'s answer: the outputs to hand on, and the requests a stop string finished, which the
    caller must abort in the core."""

    outputs: list[RequestOutput]
    aborts: list[str]


class OutputProcessor:
    """Requests are added (before the core sees them) and outputs processed on any threads: the Triton
    model adds from execute's thread and processes on its response thread."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer if tokenizer is not None and tokenizer.available else None
        self._requests: dict[str, _RequestState] = {}
        self._lock = threading.Lock()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add_request(self, request_id: str, num_prompt_tokens: int, params: SamplingParams,
                    arrival_time: float) -> None:
        detok = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer.hf, params.stop)
        state = _RequestState(request_id, num_prompt_tokens, arrival_time, detok)
        if params.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        with self._lock:
            self._requests[request_id] = state

    def forget(self, request_id: str) -> None:
        """Drops a request without an output (one the core never took)."""
        with self._lock:
            self._requests.pop(request_id, None)

    def process(self, deltas: Iterable[EngineCoreOutput]) -> Processed:
        """The RequestOutput of every delta whose request is still open here, in order."""
        outputs: list[RequestOutput] = []
        aborts: list[str] = []
        with self._lock:
            for delta in deltas:
                state = self._requests.get(delta.request_id)
                if state is None:
                    continue  # finished here already (a stop string), or never added
                out = self._process(state, delta)
                if out.finished:
                    del self._requests[delta.request_id]
                    if delta.finish_reason is None:  # a stop string: the core goes on until aborted
                        aborts.append(delta.request_id)
                outputs.append(out)
        return Processed(outputs, aborts)

    def _process(self, state: _RequestState, delta: EngineCoreOutput) -> RequestOutput:
        reason = delta.finish_reason
        new = delta.new_token_ids
        new_logprobs = None
        detok = state.detokenizer
        text_delta = None if detok is None else ""
        if delta.num_cached_tokens:  # set on every output from the request's admission on
            state.num_cached_tokens = delta.num_cached_tokens
        if new:
            if state.first_token_time is None:
                state.first_token_time = delta.time
            if detok is not None:
                last = len(new) - 1
                for i, token in enumerate(new):  # the core's own stop (not a cancellation) flushes the text
                    text_delta += detok.add(token, final=i == last and reason in _ENDS_TEXT)
                    if detok.stopped:  # the text ends before the stop string; later tokens are never shown
                        reason = FinishReason.STOP
                        new = new[: i + 1]
                        break
            state.token_ids.extend(new)
            if state.logprobs is not None and delta.new_logprobs is not None:
                kept = delta.new_logprobs[: len(new)]
                new_logprobs = [logprob_entry(t) for t in kept]
                state.logprobs.extend(new_logprobs)
                for t in kept:
                    state.cumulative_logprob += t.logprob
        if state.logprobs is not None and new_logprobs is None:
            new_logprobs = []
        if reason is not None:
            state.finish_time = delta.time
        return RequestOutput._view(
            state, new, new_logprobs, text_delta, None if reason is None else reason.value, delta.error,
            delta.logits,
        )
