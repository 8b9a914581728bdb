"""The offline API, in the spirit of vLLM's: a list of prompts in, a list of completions out.

It drives the same LLMEngine (same scheduler, same step) as the Triton model, just from a loop in the
caller's thread instead of a background one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orca.config import EngineConfig
from orca.frontend.llm_engine import LLMEngine
from orca.frontend.output_processor import Logprob
from orca.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    text: str | None = None  # None when the model has no tokenizer
    # SamplingParams.logprobs set: per token {token id: Logprob} (the drawn token, then the top n); their sum
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache


class LLM:
    """``LLM(model=path_or_gguf, **EngineConfig options)``; ``model=None`` is SmolLM2-135M-Instruct.
    ``LLM(model, trace="run.jsonl")`` records the iteration timeline of every generate() in that file
    (orca/core/timeline.py; ``orca-bench timeline run.jsonl`` draws it)."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **options))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses when given no sampling_params (vLLM's name): SamplingParams' defaults
        with the checkpoint's generation_config.json temperature, top_k and top_p where it gives them. A
        SamplingParams you build keeps its own values (its fields all have values: none is "unset"); to
        start from the model's, ``dataclasses.replace(llm.get_default_sampling_params(), max_tokens=64)``."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | Sequence[str | None] | None = None,
    ) -> list[CompletionOutput]:
        """Generates for every prompt (token-id lists, or strings when the model has a tokenizer);
        outputs come back in input order. sampling_params None: get_default_sampling_params() (the
        model's generation_config.json defaults). `cache_salt` (one for every prompt, or one per prompt; None =
        no salt): prompts with different salts never share cached keys and values (prefix caching).
        Raises ValueError for invalid arguments before any work."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a list of prompts (strings or lists of token ids)")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
            if not all(isinstance(p, SamplingParams) for p in params):
                raise ValueError("sampling_params must be SamplingParams objects")
        if cache_salt is None or isinstance(cache_salt, str):
            salts = [cache_salt] * len(prompts)
        elif isinstance(cache_salt, Sequence) and not isinstance(cache_salt, bytes):
            salts = list(cache_salt)
            if len(salts) != len(prompts):
                raise ValueError(f"got {len(salts)} cache salts for {len(prompts)} prompts")
        else:
            raise ValueError(f"cache_salt must be a string, a list of one per prompt, or None, got {cache_salt!r}")
        token_prompts = [self.engine.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for ids, p, salt in zip(token_prompts, params, salts):
            self.engine.validate(ids, p, salt)  # fail before doing any work
        if self.engine.has_unfinished():
            raise RuntimeError("generate() is not re-entrant: the engine still has requests")
        ids_of = {f"offline-{i}": i for i in range(len(prompts))}
        results: list[CompletionOutput | None] = [None] * len(prompts)
        pending = list(ids_of)
        while pending or self.engine.has_unfinished():
            # Admit as many as the waiting queue takes; the rest join as earlier ones finish.
            while pending and self.engine.stats().waiting < self.engine.config.max_queue:
                rid = pending.pop(0)
                i = ids_of[rid]
                self.engine.add_request(rid, token_prompts[i], params[i], cache_salt=salts[i])
            for out in self.engine.step():
                if out.finished:
                    if out.error:
                        raise RuntimeError(f"generation failed: {out.error}")
                    i = ids_of[out.request_id]
                    results[i] = CompletionOutput(
                        token_prompts[i], out.token_ids, out.finish_reason or "", out.text, out.logprobs,
                        out.cumulative_logprob, out.num_cached_tokens,
                    )
        return [r for r in results if r is not None]
