"""The engine for synchronous callers: the token-only core with the front end around it, on one thread.

``LLMEngine`` = EngineCore + Tokenizer (text in) + OutputProcessor (RequestOutputs out); ``step()`` runs one
core iteration and processes its deltas at once. orca.LLM and the request-level baseline drive it; the
Triton model drives the core from its own thread instead (orca/core/engine_loop.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from orca.config import EngineConfig
from orca.core.engine import EngineCore
from orca.core.outputs import EngineStats, IterationStats
from orca.executor import Executor
from orca.frontend.generation_config import describe_sampling_defaults, read_sampling_defaults
from orca.frontend.output_processor import OutputProcessor, RequestOutput
from orca.frontend.structured_outputs import StructuredOutputCompiler
from orca.frontend.tokenizer import Tokenizer, check_stop_strings
from orca.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, executor: Executor | None = None) -> None:
        """`executor` replaces the default worker(s) (EngineCore's)."""
        self.core = EngineCore(config, executor)
        self.text = Tokenizer.load(self.core.checkpoint)
        # The model's recommended sampling (generation_config.json), for requests that give no SamplingParams.
        self.sampling_defaults = read_sampling_defaults(self.core.checkpoint)
        logger.info("%s", describe_sampling_defaults(self.sampling_defaults, self.core.checkpoint))
        self.output_processor = OutputProcessor(self.text)
        self.eos_token_ids = self.text.eos_token_ids(self.core.eos_token_ids)
        # Structured outputs compile on the caller's thread here (a synchronous caller waits anyway).
        self.structured_outputs = StructuredOutputCompiler(
            self.text.hf, self.core.model_config.vocab_size, self.eos_token_ids
        )

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams' defaults with the model's generation_config.json values (temperature, top_k,
        top_p where it gives them) in their place: what a request without SamplingParams gets."""
        return SamplingParams.from_dict(self.sampling_defaults)

    # -- what the core knows, for callers and benchmarks -------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def checkpoint(self) -> Any:
        return self.core.checkpoint

    @property
    def model_config(self) -> Any:
        return self.core.model_config

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def n_slots(self) -> int:
        return self.core.n_slots

    @property
    def block_size(self) -> int:
        return self.core.block_size

    @property
    def executor(self) -> Executor:
        return self.core.executor

    @property
    def timeline(self) -> Any:
        return self.core.timeline

    @property
    def last_iteration(self) -> IterationStats:
        return self.core.last_iteration

    @property
    def failed(self) -> str | None:
        return self.core.failed

    @property
    def profile(self) -> bool:
        """Time each iteration's phases (IterationStats.timings); costs device syncs."""
        return self.core.profile

    @profile.setter
    def profile(self, value: bool) -> None:
        self.core.profile = value

    @property
    def capture_logits(self) -> bool:
        """Attach each sampled row's logits to RequestOutput.logits."""
        return self.core.capture_logits

    @capture_logits.setter
    def capture_logits(self, value: bool) -> None:
        self.core.capture_logits = value

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's transformers tokenizer, or None."""
        return self.text.hf

    def stats(self) -> EngineStats:
        return self.core.stats()

    def request_ids(self) -> list[str]:
        return self.core.request_ids()

    # -- requests --------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: Any, params: SamplingParams, cache_salt: str | None = None) -> None:
        """The core's checks (the cache salt's included), and the front end's: stop strings need a tokenizer,
        a structured output must compile (it is compiled here, once: add_request finds it cached)."""
        self.core.validate(prompt_token_ids, params, cache_salt=cache_salt)
        check_stop_strings(params, self.text.available)
        if params.structured_outputs is not None:
            self.structured_outputs.compile(params.structured_outputs)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """`cache_salt`: requests with different salts never share cached keys and values (prefix
        caching, EngineConfig.enable_prefix_caching); None = no salt."""
        params = params or self.default_sampling_params()
        self.validate(prompt_token_ids, params, cache_salt)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        constraint = None
        if params.structured_outputs is not None:
            constraint = self.structured_outputs.constraint(params.structured_outputs)  # ValueError: refused
        self.core.add_request(
            request_id, prompt_token_ids, params, arrival_time, frozenset(self.eos_token_ids), cache_salt=cache_salt,
            constraint=constraint,
        )
        self.output_processor.add_request(request_id, len(prompt_token_ids), params, arrival_time)

    def abort_request(self, request_id: str) -> bool:
        """Aborts a request; its final output ("cancelled") comes from the next step(). False if unknown."""
        return self.core.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One iteration of the core; every output it reports, processed."""
        processed = self.output_processor.process(self.core.step())
        for request_id in processed.aborts:  # finished by a stop string: the core must stop too
            self.core.abort_request(request_id)
        return processed.outputs

    # -- text ------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.text.encode(text)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The chat's prompt ids, `tools` (OpenAI tool objects) rendered by the model's template (or in
        the Hermes format when it has no tools: orca/frontend/tokenizer.py)."""
        return self.text.apply_chat_template(messages, tools)

    def decode(self, token_ids: list[int]) -> str:
        return self.text.decode(token_ids)

    def shutdown(self) -> None:
        self.structured_outputs.shutdown()
        self.core.shutdown()
