"""Incremental detokenisation and stop strings.

Streaming text concatenates to exactly the non-streaming text: each step decodes a small window of recent
tokens (the previous delta as context, so leading spaces survive), emits only what is new, and waits while
the window ends in an incomplete UTF-8 sequence; text that could start a stop string is held back. Where
transformers' decode is the Rust tokenizer's, the windows are decoded by it, and a byte-level BPE uses
`tokenizers.decoders.DecodeStream` (which refuses a byte-fallback BPE's byte tokens): the fastest path, and
the detokenizer is the output side's largest cost (docs/BENCHMARKS.md, "Results: the host's share at batch 256").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

REPLACEMENT = "\ufffd"
SETTLE_CHARS = 512  # the live tail's text moves to the settled pieces in runs of at least this many characters


def rust_tokenizer(tokenizer: Any) -> Any | None:
    """The tokenizers.Tokenizer whose decode transformers' decode of `tokenizer` is, with special tokens
    skipped and spaces not cleaned up (TokenizersBackend's, where the class overrides neither decode nor
    _decode), or None."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # (an older transformers: its own decode)
        return None
    cls = type(tokenizer)
    if (isinstance(tokenizer, TokenizersBackend) and cls.decode is TokenizersBackend.decode
            and cls._decode is TokenizersBackend._decode):
        return tokenizer.backend_tokenizer
    return None


def window_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """ids -> text, skipping special tokens, without transformers' clean-up of spaces: the Rust tokenizer's
    decode where it is what transformers would call, else transformers' decode."""
    rust = rust_tokenizer(tokenizer)
    if rust is not None:
        return functools.partial(rust.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self._decode = window_decoder(tokenizer)
        self._rust = rust_tokenizer(tokenizer)
        self._stream = None
        if self._rust is not None:
            from tokenizers.decoders import ByteLevel, DecodeStream

            if isinstance(self._rust.decoder, ByteLevel):
                self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: context tokens already emitted
        self._read_offset = 0  # tokens before this are emitted
        # The text so far in two parts: settled pieces (too far back to hold a stop string), joined only when
        # `text` is read, and the live tail each step extends; one growing string would be copied per token.
        self._settled: list[str] = []
        self._settled_len = 0
        self._live = ""
        self._keep = max((len(stop) for stop in stop), default=1)  # the tail a stop string search needs
        self.emitted = 0  # characters of text already returned to the caller
        self.stopped = False

    @property
    def text(self) -> str:
        if len(self._settled) > 1:
            self._settled = ["".join(self._settled)]
        return (self._settled[0] if self._settled else "") + self._live

    def _length(self) -> int:
        return self._settled_len + len(self._live)

    def _append(self, piece: str) -> None:
        """Adds decoded text, looks for stop strings in it, and settles what no later step reads again."""
        start = self._length()
        self._live += piece
        self._find_stop(start)
        settle = min(self.emitted, self._length() - self._keep) - self._settled_len
        if settle > SETTLE_CHARS:
            self._settled.append(self._live[:settle])
            self._settled_len += settle
            self._live = self._live[settle:]

    def add(self, token_id: int, final: bool = False) -> str:
        """Adds one generated token; returns the text now safe to send. With final=True everything left
        is flushed. After a stop string is found, `stopped` is set and the text ends before it."""
        self._ids.append(token_id)
        if self._stream is not None:
            piece = self._stream.step(self._rust, token_id)  # None: nothing whole to add yet
            if piece is None and final:  # the stream holds an incomplete character: as the whole decode ends
                full, text = self._decode(self._ids), self.text
                piece = full[len(text):] if full.startswith(text) else None
            if piece:
                self._append(piece)
            return self.flush() if final or self.stopped else self._release()
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) > len(prefix) and (final or not window.endswith(REPLACEMENT)):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._append(window[len(prefix) :])
        return self.flush() if final or self.stopped else self._release()

    def flush(self) -> str:
        delta = self._live[self.emitted - self._settled_len :]
        self.emitted = self._length()
        return delta

    def _find_stop(self, new_from: int) -> None:
        """(Offsets are the text's; the search starts in the live tail: _keep characters before new_from.)"""
        if not self._stop:
            return
        search_from = max(0, new_from - self._keep + 1) - self._settled_len
        hits = [i for i in (self._live.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self._live = self._live[: min(hits)]
            self.stopped = True

    def _release(self) -> str:
        """Returns new text, keeping back a tail that is a prefix of some stop string."""
        hold = 0
        live = self._live
        for s in self._stop:
            for k in range(min(len(s) - 1, self._length() - self.emitted), 0, -1):
                if live.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        end = self._length() - hold
        delta = live[self.emitted - self._settled_len : end - self._settled_len]
        self.emitted = max(self.emitted, end)
        return delta
