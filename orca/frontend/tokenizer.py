"""The front end's text, in one place: a model's tokenizer behind the checks every caller needs.

Text turns into token ids before a request reaches the engine core (orca/core/engine.py holds no tokenizer),
and back into text after (orca/frontend/output_processor.py): the Triton model does both on its own threads, the
offline LLM in the caller's.
"""

from __future__ import annotations

import json
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

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The chat's prompt ids, ending with the assistant's turn. ``tools`` (OpenAI's tool objects) go to
        the model's own template; a template that knows no tools (no ``tools`` in it, like SmolLM2's) gets
        them, the assistants' tool_calls and the tool messages rendered as text in the Hermes format of
        Qwen2.5's template (:func:`hermes_messages`)."""
        tok = self._require()
        template = getattr(tok, "chat_template", None)
        if not template:
            raise ValueError("this model's tokenizer has no chat template: send text_input instead of messages")
        if not isinstance(template, str) or "tools" not in template:
            messages, tools = hermes_messages(messages, tools), None
        else:
            messages = [{**m, "content": ""} if m.get("content") is None else m for m in messages]
        text = tok.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return self._require().decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)
"""The system prompt's tools section of Qwen2.5's chat template (the Hermes format)."""


def hermes_tool_call(name: str, arguments: Any) -> str:
    """One call as Qwen2.5's template writes it (and orca-openai's hermes parser reads it)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n</tool_call>"


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """Plain {role, content} messages that carry the tools as Qwen2.5's template renders them, for a
    template that knows no tools: the tools (one JSON object a line inside <tools></tools>, with the
    instruction to answer <tool_call>{"name", "arguments"}</tool_call>) appended to the system message
    (one is prepended when there is none); an assistant's tool_calls as those <tool_call> blocks after its
    content; a run of tool messages as one user message of <tool_response>...</tool_response> blocks."""
    out: list[dict[str, str]] = []
    if tools:
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        section = HERMES_TOOLS_PROMPT.format(tools=listed)
        if messages and messages[0].get("role") == "system":
            out.append({"role": "system", "content": f"{messages[0].get('content') or ''}\n\n{section}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": section})
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_responses"):
                out[-1]["content"] += f"\n{block}"
            else:
                out.append({"role": "user", "content": block, "tool_responses": "1"})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = [hermes_tool_call(c["function"]["name"], _arguments(c["function"].get("arguments")))
                     for c in m["tool_calls"]]
            content = "\n".join([content, *calls] if content else calls)
        out.append({"role": role, "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return {} if arguments is None else arguments
