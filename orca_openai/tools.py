"""Tool calls in the model's text: the grammar orca_gpt enforces for tool_choice "required" or a named
function, and the parsers that turn generated text into OpenAI's ``tool_calls`` (whole or streamed).

orca-openai sees text only (orca_gpt decodes with special tokens skipped), so every format is recognised
by its text:

- ``hermes`` (Qwen2.5, Hermes, and orca's own rendering for templates without tools):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (or, newer,
  ``[TOOL_CALLS]name[ARGS]{...}``); [TOOL_CALLS] is a special token that orca_gpt's text leaves out, so
  a bare JSON array of {name, arguments} objects at the start counts too;
- ``llama3_json`` (Llama 3.1/3.2): ``<|python_tag|>`` (also a special token) then ``{"name": ...,
  "parameters": {...}}``, several separated by ``;``, the whole answer being calls;
- ``auto``: whichever of these the text shows first.

The bare JSON forms (an answer starting with ``{`` or ``[``) are calls only when every name is one of
the request's tools; otherwise the text is the content, unchanged.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("auto", "hermes", "mistral", "llama3_json")

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
MISTRAL_START = "[TOOL_CALLS]"
LLAMA_START = "<|python_tag|>"


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


# -- the grammars of tool_choice "required" and a named function ------------------------------------------
def tool_parameters(tool: dict[str, Any]) -> dict[str, Any] | None:
    return tool["function"].get("parameters")


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """tool_choice "required" (vLLM's): a JSON array of one or more {"name": <a tool>, "parameters": <its
    parameters>} objects (one at most when parallel_tool_calls is false)."""
    variants = [{
        "properties": {
            "name": {"type": "string", "enum": [tool["function"]["name"]]},
            "parameters": tool_parameters(tool) or {"type": "object", "properties": {}},
        },
        "required": ["name", "parameters"],
    } for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """tool_choice naming a function: the output is that function's arguments."""
    return tool_parameters(tool) or {"type": "object"}


# -- events -----------------------------------------------------------------------------------------------
@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=call_id)


@dataclass
class Delta:
    """What one piece of text adds to the message: content, or a tool call's start or arguments."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's streamed tool_calls entries

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


def _arguments_text(value: Any) -> str:
    if isinstance(value, str):  # some models write the arguments as JSON text
        return value
    return json.dumps({} if value is None else value, ensure_ascii=False)


def _call_of(
    obj: Any, names: frozenset[str] | None, keys: tuple[str, ...] = ("arguments", "parameters")
) -> Call | None:
    """{"name": str, "arguments"|"parameters": object} as a Call; None when it is not one (or, with
    ``names``, names another function)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if not isinstance(args, (dict, str)) and args is not None:
        return None
    return Call(obj["name"], _arguments_text(args))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


# -- the parser of tool_choice "auto" ---------------------------------------------------------------------
class AutoParser:
    """Incremental: ``feed`` each new piece of text, ``finish`` at the end; each returns a :class:`Delta`.

    Content passes through as it comes, except text that could be the start of a call marker (held until
    it is known not to be). From a marker on (or, for the bare JSON forms, from the first character) the
    text is buffered; each call is handed out when it is complete: a delta with its index, id, type and
    name (arguments ""), then one with its arguments. Text that turns out not to be a call is content."""

    def __init__(self, parser: str, tools: list[dict[str, Any]], parallel: bool = True) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown tool call parser {parser!r}: one of {', '.join(PARSERS)}")
        self.names = frozenset(t["function"]["name"] for t in tools)
        self.parallel = parallel
        hermes, mistral, llama = (parser in ("auto", p) for p in ("hermes", "mistral", "llama3_json"))
        self.markers = [m for m, on in ((HERMES_START, hermes), (MISTRAL_START, mistral), (LLAMA_START, llama)) if on]
        self.bare = "[" * mistral + "{" * llama  # first characters of a bare JSON answer
        self.buffer = ""  # text not handed out yet
        self.mode = "start"  # start (nothing but whitespace seen), content, hermes, between, mistral, llama, bare
        self.calls: list[Call] = []
        self.leading = ""  # whitespace held at the very start

    # the public side
    def feed(self, text: str) -> Delta:
        self.buffer += text
        return self._step(final=False)

    def finish(self) -> Delta:
        return self._step(final=True)

    # the machinery
    def _emit(self, delta: Delta, call: Call) -> None:
        if not self.parallel and self.calls:
            return
        index = len(self.calls)
        self.calls.append(call)
        delta.calls.append({"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
        delta.calls.append({"index": index, "function": {"arguments": call.arguments}})

    def _step(self, final: bool) -> Delta:
        delta = Delta()
        while True:
            before = (self.mode, len(self.buffer))
            getattr(self, f"_{self.mode}")(delta, final)
            if (self.mode, len(self.buffer)) == before:
                return delta

    def _start(self, delta: Delta, final: bool) -> None:
        stripped = self.buffer.lstrip()
        if not stripped:
            if final and self.buffer:
                delta.content += self.buffer
                self.buffer = ""
            return
        if any(m.startswith(stripped[: len(m)]) for m in self.markers):  # a marker, or maybe the start of one
            if not final and any(m.startswith(stripped) and m != stripped for m in self.markers):
                return
            self.mode = "content"
        elif stripped[0] in self.bare:
            self.leading, self.buffer, self.mode = self.buffer[: len(self.buffer) - len(stripped)], stripped, "bare"
        else:
            self.mode = "content"

    def _content(self, delta: Delta, final: bool) -> None:
        found = [(self.buffer.find(m), m) for m in self.markers]
        found = [(i, m) for i, m in found if i >= 0]
        if found:
            i, marker = min(found)
            delta.content += self.buffer[:i]
            self.buffer = self.buffer[i + len(marker):]
            self.mode = {HERMES_START: "hermes", MISTRAL_START: "mistral", LLAMA_START: "llama"}[marker]
            return
        keep = 0 if final else _held(self.buffer, self.markers)
        cut = len(self.buffer) - keep
        delta.content += self.buffer[:cut]
        self.buffer = self.buffer[cut:]

    def _hermes(self, delta: Delta, final: bool) -> None:
        end = self.buffer.find(HERMES_END)
        if end < 0 and not final:
            return
        body = self.buffer if end < 0 else self.buffer[:end]
        call = _call_of(_loads(body.strip()), None)
        rest = "" if end < 0 else self.buffer[end + len(HERMES_END):]
        if call is None:  # not a call after all: the block is content
            delta.content += HERMES_START + body + ("" if end < 0 else HERMES_END)
            self.buffer, self.mode = rest, "content"
        else:
            self._emit(delta, call)
            self.buffer, self.mode = rest, "between"

    def _between(self, delta: Delta, final: bool) -> None:
        """After a call: whitespace is dropped; anything else (another call's marker) is content mode's."""
        self.buffer = self.buffer.lstrip()
        if self.buffer:
            self.mode = "content"

    def _mistral(self, delta: Delta, final: bool) -> None:
        # the array (or the name[ARGS]{...} list) is parsed whole, at the end
        self._whole(delta, final, MISTRAL_START, _mistral_calls, None)

    def _llama(self, delta: Delta, final: bool) -> None:
        self._whole(delta, final, LLAMA_START, _llama_calls, None)

    def _bare(self, delta: Delta, final: bool) -> None:
        parse = _mistral_calls if self.buffer.lstrip().startswith("[") else _llama_calls
        self._whole(delta, final, self.leading, parse, self.names)

    def _whole(self, delta: Delta, final: bool, prefix: str,
               parse: Callable[[str, frozenset[str] | None], list[Call] | None],
               names: frozenset[str] | None) -> None:
        """A format read whole at the end of the answer: its calls, or (not calls after all) `prefix` and the
        text as content."""
        if not final:
            return
        text, self.buffer = self.buffer.strip(), ""
        calls = parse(text, names)
        if calls is None:
            delta.content += prefix + text
        else:
            for call in calls:
                self._emit(delta, call)
        self.mode = "content"


def _held(text: str, markers: list[str]) -> int:
    """How many characters at the end of text could begin a marker."""
    for n in range(min(len(text), max((len(m) for m in markers), default=0) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def _mistral_calls(text: str, names: frozenset[str] | None) -> list[Call] | None:
    """[{"name", "arguments"}, ...] or name[ARGS]{...}name[ARGS]{...} (Mistral's newer tokenizers)."""
    if text.startswith("["):
        items = _loads(text)
        if not isinstance(items, list) or not items:
            return None
        calls = [_call_of(item, names) for item in items]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]
    calls: list[Call] = []
    decoder = json.JSONDecoder()
    while text:
        name, sep, rest = text.partition("[ARGS]")
        if not sep:
            name, brace, rest = text.partition("{")
            rest = brace + rest
        name = name.strip().removeprefix(MISTRAL_START).strip()
        try:
            args, end = decoder.raw_decode(rest.lstrip())
        except (ValueError, RecursionError):
            return None
        call = _call_of({"name": name, "arguments": args}, names)
        if call is None:
            return None
        calls.append(call)
        text = rest.lstrip()[end:].strip()
    return calls or None


def _llama_calls(text: str, names: frozenset[str] | None) -> list[Call] | None:
    """{"name", "parameters"|"arguments"} objects separated by ";" (Llama 3.x's JSON tool calls)."""
    calls: list[Call] = []
    decoder = json.JSONDecoder()
    text = text.strip()
    while text:
        try:
            obj, end = decoder.raw_decode(text)
        except (ValueError, RecursionError):
            return None
        call = _call_of(obj, names)
        if call is None:
            return None
        calls.append(call)
        text = text[end:].strip()
        if text.startswith(";"):
            text = text[1:].strip()
        elif text:
            return None
    return calls or None


# -- the parsers of grammar-enforced output -----------------------------------------------------------------
class NamedParser:
    """tool_choice naming a function: the whole text is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self.call = Call(name, "")
        self.started = False
        self.calls: list[Call] = [self.call]

    def _start(self, delta: Delta) -> None:
        if not self.started:
            self.started = True
            delta.calls.append({"index": 0, "id": self.call.id, "type": "function",
                                "function": {"name": self.call.name, "arguments": ""}})

    def feed(self, text: str) -> Delta:
        delta = Delta()
        self._start(delta)
        if text:
            self.call.arguments += text
            delta.calls.append({"index": 0, "function": {"arguments": text}})
        return delta

    def finish(self) -> Delta:
        delta = Delta()
        self._start(delta)
        return delta


class RequiredParser:
    """tool_choice "required": a JSON array of {"name", "parameters"} objects; each call is handed out as
    soon as its object is complete (a scan of the array's top level: strings, escapes, nesting)."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # scanned up to here
        self.depth = 0
        self.in_string = self.escaped = False
        self.item_start: int | None = None
        self.calls: list[Call] = []

    def feed(self, text: str) -> Delta:
        self.text += text
        delta = Delta()
        while self.pos < len(self.text):
            ch = self.text[self.pos]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2 and ch == "{":
                    self.item_start = self.pos
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and ch == "}" and self.item_start is not None:
                    call = _call_of(_loads(self.text[self.item_start:self.pos + 1]), None, ("parameters", "arguments"))
                    self.item_start = None
                    if call is not None:
                        index = len(self.calls)
                        self.calls.append(call)
                        delta.calls.append({"index": index, "id": call.id, "type": "function",
                                            "function": {"name": call.name, "arguments": ""}})
                        delta.calls.append({"index": index, "function": {"arguments": call.arguments}})
            self.pos += 1
        return delta

    def finish(self) -> Delta:
        # nothing parsed (the output was cut short before a whole call): the text is the content
        return Delta(content=self.text) if not self.calls else Delta()


def make_parser(tool_choice: Any, tools: list[dict[str, Any]], parser: str, parallel: bool = True) -> Any:
    """The parser of a request's output, or None when its text is only content (no tools, or "none")."""
    if not tools or tool_choice == "none":
        return None
    if tool_choice == "required":
        return RequiredParser()
    if isinstance(tool_choice, dict):
        return NamedParser(tool_choice["function"]["name"])
    return AutoParser(parser, tools, parallel)


def parse_all(parser: Any, text: str) -> tuple[str, list[Call]]:
    """The whole text's content and calls (what streaming would hand out, at once)."""
    first, last = parser.feed(text), parser.finish()
    return first.content + last.content, list(parser.calls)
