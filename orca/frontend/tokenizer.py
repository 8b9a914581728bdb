"""The front end's text, in one place: a model's tokenizer behind the checks every caller needs.

Text turns into token ids before a request reaches the engine core (orca/core/engine.py holds no tokenizer),
and back into text after (orca/frontend/output_processor.py): the Triton model does both on its own threads, the
offline LLM in the caller's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orca.checkpoint import load_tokenizer
from orca.sampling_params import SamplingParams


def check_stop_strings(params: SamplingParams, has_tokenizer: bool) -> None:
    """Stop strings are text: a model without a tokenizer refuses them (ValueError), before the core."""
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer, and this model has none: use stop_token_ids")


class Tokenizer:
    """``hf`` is the checkpoint's transformers tokenizer, or None when it ships none: then every text
    method raises ValueError saying to send token ids."""

    def __init__(self, hf: Any | None, checkpoint: Path | str) -> None:
        self.hf = hf
        self.checkpoint = checkpoint

    @classmethod
    def load(cls, checkpoint: Path) -> Tokenizer:
        return cls(load_tokenizer(checkpoint), checkpoint)

    @property
    def available(self) -> bool:
        return self.hf is not None

    def eos_token_ids(self, model_eos: frozenset[int]) -> frozenset[int]:
        """The ids that end a request: the model's EOS ids and the tokenizer's own."""
        if self.hf is None or self.hf.eos_token_id is None:
            return frozenset(model_eos)
        return frozenset(model_eos) | {self.hf.eos_token_id}

    def _require(self) -> Any:
        if self.hf is None:
            raise ValueError(f"this model ({self.checkpoint}) has no tokenizer: send input_ids instead of text")
        return self.hf

    def encode(self, text: str) -> list[int]:
        return list(self._require().encode(text, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        tok = self._require()
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: send text_input instead of messages")
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return self._require().decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
