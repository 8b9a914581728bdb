"""The paper's baseline: request-level batching (docs/design.md, "The problem Orca solves"), on the
same engine model code.

As FasterTransformer behind Triton's dynamic batcher, a batch is fixed when it starts and runs until its
longest member is done; no member is answered before. ``RequestLevelBatcher.run`` does it on an
``LLMEngine``: every member joins with the batch's largest max_tokens and its EOS ignored, and its tokens
are cut back afterwards at its own stop condition, so answers equal orca_gpt's. Where memory is short, a
member past its context idles until the batch ends, and a batch beyond n_slots runs as consecutive
sub-batches. With a trace on, the timeline says ``scheduling: "request-level"`` and adds ``batch`` records
(orca/core/timeline.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from orca.core.request import FinishReason, stop_reason
from orca.frontend.detokenizer import IncrementalDetokenizer
from orca.frontend.llm_engine import LLMEngine
from orca.frontend.output_processor import RequestOutput
from orca.sampling_params import SamplingParams

# FasterTransformer's engine: memory reserved up front, prompts whole, no prefix cache, no speculation.
REQUEST_LEVEL_OPTIONS = {"kv_admission": "reserve", "max_num_batched_tokens": None, "enable_prefix_caching": False,
                         "speculative_method": "off"}


@dataclass(frozen=True)
class SubBatch:
    """Members (indices into the batch) that run together, and how many tokens each one runs for."""

    members: tuple[int, ...]
    run_tokens: tuple[int, ...]


class RequestLevelBatcher:
    """Runs whole batches on an engine, request-level style. Not thread-safe: one batch at a time.

    The engine's max_bs bounds a sub-batch, so it must be at least the serving batcher's max batch size
    for a whole batch to run in one group of iterations.
    """

    def __init__(self, engine: LLMEngine, id_prefix: str = "batch-") -> None:
        for key, value in REQUEST_LEVEL_OPTIONS.items():
            if getattr(engine.config, key) != value:
                raise ValueError(f"a request-level batcher needs an engine with {key}={value!r}")
        self.engine = engine
        self._id_prefix = id_prefix
        self._next_batch = 0
        self.last_plan: list[SubBatch] = []
        if engine.timeline is not None:
            engine.timeline.set_info(scheduling="request-level")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None) -> None:
        """Raises ValueError naming what is wrong with one member (the engine's own checks). A cache salt
        is checked as orca_gpt checks it, and then changes nothing: the baseline has no prefix cache. The
        baseline serves no structured outputs (a padded batch runs to its longest member unconstrained)."""
        if params.structured_outputs is not None:
            raise ValueError("structured_outputs are not served by the request-level baseline: use orca_gpt")
        self.engine.validate(prompt_token_ids, params, cache_salt)

    def plan(self, batch: Sequence[tuple[list[int], SamplingParams]]) -> list[SubBatch]:
        """Splits a batch into sub-batches that fit max_bs and n_slots, in arrival order; one sub-batch
        whenever the memory allows (the normal case)."""
        engine = self.engine
        subs: list[SubBatch] = []
        group: list[int] = []
        for i in range(len(batch)):
            candidate = [*group, i]
            if group and (
                len(candidate) > engine.config.max_bs
                or self._reservation(batch, candidate) > engine.n_slots
            ):
                subs.append(self._sub_batch(batch, group))
                candidate = [i]
            group = candidate
        if group:
            subs.append(self._sub_batch(batch, group))
        return subs

    def run(
        self, batch: Sequence[tuple[list[int], SamplingParams]], arrival_times: Sequence[float | None] | None = None
    ) -> list[RequestOutput]:
        """Runs the batch to its end and returns every member's final output, in order. Raises ValueError
        (naming the member) before any work if a member is invalid. A member whose iteration failed gets
        finish_reason "error". `arrival_times`: when each member reached the server (time.monotonic();
        None: now), earlier than now when it waited for the batch to start: its arrival time, so its
        latency and its timeline's wait count from then."""
        for i, (prompt, params) in enumerate(batch):
            try:
                self.validate(prompt, params)
            except ValueError as exc:
                raise ValueError(f"batch member {i}: {exc}") from None
        if self.engine.has_unfinished():
            raise RuntimeError("the engine still has requests: a request-level batch needs it to itself")
        batch_id = self._next_batch
        self._next_batch += 1
        self.last_plan = self.plan(batch)
        arrivals = list(arrival_times) if arrival_times is not None else [None] * len(batch)
        if len(arrivals) != len(batch):
            raise ValueError(f"{len(arrivals)} arrival times for a batch of {len(batch)}")
        finals: dict[int, RequestOutput] = {}
        for sub in self.last_plan:
            finals.update(self._run_sub_batch(batch, sub, batch_id, arrivals))
        end = time.monotonic()  # nobody is answered before the last sub-batch ends
        outputs = []
        for i, (_, params) in enumerate(batch):
            out = finals[i]
            if out.finish_reason != FinishReason.ERROR.value:
                out = self._cut(out, params)
            out.finish_time = end
            outputs.append(out)
        if self.engine.timeline is not None:
            run_tokens = {i: n for sub in self.last_plan for i, n in zip(sub.members, sub.run_tokens)}
            self.engine.timeline.event("batch", end, batch=batch_id, members=[
                {"id": self._request_id(batch_id, i), "run_tokens": run_tokens[i], "kept_tokens": len(out.token_ids),
                 "reason": out.finish_reason}
                for i, out in enumerate(outputs)
            ])
        return outputs

    # -- internals -------------------------------------------------------------------------------
    def _run_tokens(self, batch: Sequence[tuple[list[int], SamplingParams]], members: list[int]) -> list[int]:
        longest = max(batch[i][1].max_tokens for i in members)
        # A member's own max_tokens always fits its context (validate), so this never goes below it.
        return [min(longest, self.engine.max_model_len - len(batch[i][0])) for i in members]

    def _reservation(self, batch: Sequence[tuple[list[int], SamplingParams]], members: list[int]) -> int:
        """K/V slots the members reserve: whole blocks each."""
        bs = self.engine.block_size
        return sum(-(-(len(batch[i][0]) + n) // bs) * bs for i, n in zip(members, self._run_tokens(batch, members)))

    def _sub_batch(self, batch: Sequence[tuple[list[int], SamplingParams]], members: list[int]) -> SubBatch:
        return SubBatch(tuple(members), tuple(self._run_tokens(batch, members)))

    def _run_sub_batch(
        self, batch: Sequence[tuple[list[int], SamplingParams]], sub: SubBatch, batch_id: int,
        arrivals: Sequence[float | None],
    ) -> dict[int, RequestOutput]:
        engine = self.engine
        index_of: dict[str, int] = {}
        for i, n in zip(sub.members, sub.run_tokens):
            prompt, params = batch[i]
            request_id = self._request_id(batch_id, i)
            index_of[request_id] = i
            # Every member runs the batch's length: its own stop conditions are applied afterwards.
            padded = replace(params, max_tokens=n, ignore_eos=True, stop=(), stop_token_ids=())
            engine.add_request(request_id, prompt, padded, arrival_time=arrivals[i])
        finals: dict[int, RequestOutput] = {}
        first = True
        while engine.has_unfinished():
            outputs = engine.step()
            if first and engine.last_iteration.batch_size != len(sub.members):
                # The plan fits max_bs and n_slots, so the scheduler admits everyone at once.
                raise RuntimeError(
                    f"the engine admitted {engine.last_iteration.batch_size} of {len(sub.members)} batch members"
                )
            first = False
            for out in outputs:
                if out.finished:
                    finals[index_of[out.request_id]] = out
        return finals

    def _request_id(self, batch_id: int, member: int) -> str:
        return f"{self._id_prefix}{batch_id}-{member}"

    def _cut(self, out: RequestOutput, params: SamplingParams) -> RequestOutput:
        """The member's tokens up to its own stop condition, by the engine's own rules: the core's token
        rules (orca/core/request.py stop_reason), then the front end's stop strings (the detokenizer's)."""
        engine = self.engine
        detok = None if engine.tokenizer is None else IncrementalDetokenizer(engine.tokenizer, params.stop)
        kept: list[int] = []
        reason: FinishReason | None = None
        for token in out.token_ids:
            kept.append(token)
            reason = stop_reason(token, len(kept), params, engine.eos_token_ids)
            if detok is not None:
                detok.add(token, final=reason is not None)
                if detok.stopped:
                    reason = FinishReason.STOP
            if reason is not None:
                break
        if reason is None:  # cannot happen: every member runs at least its own max_tokens
            raise RuntimeError(f"{out.request_id} ran {len(out.token_ids)} tokens, fewer than its max_tokens")
        text = None if detok is None else detok.text[: detok.emitted]
        return out.replace(new_token_ids=kept, token_ids=kept, finish_reason=reason.value, text_delta=text, text=text)


__all__ = ["REQUEST_LEVEL_OPTIONS", "RequestLevelBatcher", "SubBatch"]
