"""What the engine core refuses of a request before it is added, each error naming the allowed range."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from orca.checkpoint import ModelConfig
from orca.core.errors import EngineFailedError
from orca.core.lora import LoRARequest
from orca.sampling_params import SamplingParams

MAX_CACHE_SALT_CHARS = 1024
"""The longest cache_salt a request may give."""



class RequestChecks:
    """EngineCore.validate, over the core's configuration (set in its __init__)."""

    failed: str | None
    model_config: ModelConfig
    max_model_len: int
    n_slots: int

    _lora: Callable[[str], LoRARequest]  # LoRAAdapters'

    def validate(self, prompt_token_ids: Any, params: SamplingParams, cache_salt: Any = None) -> None:
        """Raises ValueError naming what is wrong with a request and the allowed range (EngineFailedError
        once the engine has failed). Reads only immutable configuration, so any thread may call it: the
        front end calls it before add_request, which does not check again."""
        if self.failed is not None:
            raise EngineFailedError(f"the engine has failed and serves no more requests: {self.failed}")
        if cache_salt is not None and (
            not isinstance(cache_salt, str) or not 1 <= len(cache_salt) <= MAX_CACHE_SALT_CHARS
        ):
            got = f"{len(cache_salt)} characters" if isinstance(cache_salt, str) else type(cache_salt).__name__
            raise ValueError(
                f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters, got {got}"
            )
        if params.n != 1:
            raise ValueError(f"n must be 1 in the engine core, got n={params.n}: a front end fans n > 1 out into n "
                             "requests (orca/frontend/parallel_sampling.py; orca_gpt serves it)")
        if params.lora_name is not None:
            self._lora(params.lora_name)
        vocab = self.model_config.vocab_size
        if not isinstance(prompt_token_ids, (list, tuple)) or len(prompt_token_ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is out of range: ids must be integers in [0, {vocab - 1}]")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens; the context holds {self.max_model_len}, so a prompt may have "
                f"at most {self.max_model_len - 1}"
            )
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens {params.max_tokens} is too large: prompt ({n} tokens) + max_tokens must be <= "
                f"{self.max_model_len}, so max_tokens must be in [1, {self.max_model_len - n}]"
            )
        if n >= self.n_slots:
            raise ValueError(
                f"the prompt has {n} tokens; the K/V cache holds {self.n_slots} slots, so a prompt may have at "
                f"most {self.n_slots - 1}"
            )
        if n + params.max_tokens > self.n_slots:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the K/V cache of "
                f"{self.n_slots} slots: max_tokens must be in [1, {self.n_slots - n}]"
            )
