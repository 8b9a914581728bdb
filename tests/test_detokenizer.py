"""Incremental detokenisation with SmolLM2's byte-level BPE tokenizer: streamed deltas concatenate to
exactly the one-shot decode, never carry a broken character, and stop strings never reach the client."""

from __future__ import annotations

from typing import Any

import pytest
from _fixtures import drain, smollm2

from orca import SamplingParams
from orca.frontend.detokenizer import REPLACEMENT, IncrementalDetokenizer

TEXTS = [
    "Hello, world! It's 3.14 -- isn't it?  Two  spaces,\ttabs\nand newlines.\n\n",
    " leading and trailing spaces ",
    "Café, naïve résumé: é è ê ü ß",
    "日本語のテキストです。東京は大きい。",
    "emoji 😀👍🏽 and a flag 🇫🇷, then text again!",
    "mixed: é日本語😀 «quotes» — dash… end",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return smollm2().engine.tokenizer


def decode_all(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def stream(tokenizer: Any, ids: list[int], stop: tuple[str, ...] = (), final: bool = True) -> tuple[list[str], Any]:
    """Feeds ids one by one (the last with final=True, as the engine does); returns the deltas."""
    detok = IncrementalDetokenizer(tokenizer, stop)
    deltas = []
    for i, token in enumerate(ids):
        deltas.append(detok.add(token, final=final and i == len(ids) - 1))
        if detok.stopped:
            break
    return deltas, detok


def single(tokenizer: Any, piece: str) -> int:
    ids = tokenizer.encode(piece, add_special_tokens=False)
    assert len(ids) == 1, f"{piece!r} is not one token: {ids}"
    return ids[0]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("final", [True, False])
def test_deltas_concatenate_to_the_full_decode(tokenizer: Any, text: str, final: bool) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = decode_all(tokenizer, ids)
    assert expected == text
    deltas, detok = stream(tokenizer, ids, final=final)
    assert "".join(deltas) == expected
    assert detok.text == expected and detok.emitted == len(expected) and not detok.stopped
    for delta in deltas:
        assert REPLACEMENT not in delta


def test_multibyte_characters_are_split_across_tokens(tokenizer: Any) -> None:
    """What makes the test above discriminating: single tokens of these texts decode to broken bytes, so a
    detokenizer that decoded token by token would emit U+FFFD."""
    ids = tokenizer.encode("日本語 😀👍🏽", add_special_tokens=False)
    assert any(REPLACEMENT in decode_all(tokenizer, [t]) for t in ids)
    naive = "".join(decode_all(tokenizer, [t]) for t in ids)
    assert REPLACEMENT in naive


def test_the_windows_are_decoded_by_the_rust_tokenizer_as_transformers_would(tokenizer: Any) -> None:
    """window_decoder takes transformers' decode's own call (SmolLM2's is a plain fast tokenizer): the same
    text for every window, special tokens and broken characters included; a tokenizer class that overrides
    decode keeps transformers' decode."""
    from orca.frontend.detokenizer import window_decoder

    decoder = window_decoder(tokenizer)
    assert getattr(decoder, "func", None) == tokenizer.backend_tokenizer.decode
    ids = tokenizer.encode("".join(TEXTS), add_special_tokens=False) + [tokenizer.eos_token_id, 0, 1]
    for start in range(0, len(ids), 3):
        for end in (start + 1, start + 4, start + 9):
            assert decoder(ids[start:end]) == decode_all(tokenizer, ids[start:end])

    class OwnDecode(type(tokenizer)):
        def decode(self, *args: Any, **kwargs: Any) -> str:
            return "own"

    tokenizer.__class__, original = OwnDecode, tokenizer.__class__
    try:
        assert window_decoder(tokenizer)([1, 2]) == "own"
        assert IncrementalDetokenizer(tokenizer)._stream is None  # the windows, through its own decode
    finally:
        tokenizer.__class__ = original


@pytest.mark.parametrize("stop", [(), ("é", "日本", "!", "  ")])
def test_the_rust_stream_and_the_windows_give_the_same_deltas(tokenizer: Any, stop: tuple[str, ...]) -> None:
    """DecodeStream (a token at a time in Rust) against the windows it stands in for, delta by delta, with
    and without stop strings; and an output cut inside a character (the stream holds its bytes) ends as the
    whole decode does."""
    ids = tokenizer.encode("".join(TEXTS), add_special_tokens=False)
    for cut in (len(ids), 7, 40, 46, 57, 58, 89):  # 46, 57, 58, 89: inside a character
        fast, slow = IncrementalDetokenizer(tokenizer, stop), IncrementalDetokenizer(tokenizer, stop)
        assert fast._stream is not None
        slow._stream = None
        for i, token in enumerate(ids[:cut]):
            final = i == cut - 1
            assert fast.add(token, final=final) == slow.add(token, final=final), (cut, i)
            assert fast.stopped == slow.stopped
            if fast.stopped:
                break
        assert fast.text == slow.text
        if not stop:
            assert fast.text == decode_all(tokenizer, ids[:cut])


@pytest.mark.parametrize("stop", [(), ("zebra",), ("a zebra crossing", "zebras")])
def test_a_long_output_settles_its_text_and_keeps_every_delta(tokenizer: Any, stop: tuple[str, ...]) -> None:
    """Past SETTLE_CHARS the emitted text moves out of the live tail (no copy of the whole text per token):
    the deltas still concatenate to the whole decode, a stop string is still found (here first after 6,000
    characters, across the tail's edge), and `text` is the same."""
    from orca.frontend.detokenizer import SETTLE_CHARS

    text = "".join(TEXTS) * 20 + " a zebra crossing" + "".join(TEXTS)
    ids = tokenizer.encode(text, add_special_tokens=False)
    for use_stream in (True, False):
        detok = IncrementalDetokenizer(tokenizer, stop)
        if not use_stream:
            detok._stream = None
        deltas = []
        for i, token in enumerate(ids):
            deltas.append(detok.add(token, final=i == len(ids) - 1))
            if detok.stopped:
                break
        assert len(detok._settled) > 1 and detok._settled_len > 5 * SETTLE_CHARS
        expected = text[:min(text.find(s) for s in stop if s in text)] if stop else text
        assert "".join(deltas) == expected == detok.text
        assert detok.stopped == bool(stop)


def test_special_tokens_are_skipped(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hi there", add_special_tokens=False)
    deltas, detok = stream(tokenizer, [*ids, eos])
    assert "".join(deltas) == "Hi there" == decode_all(tokenizer, [*ids, eos])


# -- stop strings ----------------------------------------------------------------------------------
def test_prefix_of_a_stop_string_is_held_back_until_resolved(tokenizer: Any) -> None:
    par, is_, dot, ian = (single(tokenizer, p) for p in (" Par", "is", ".", "ian"))
    detok = IncrementalDetokenizer(tokenizer, ("Paris.",))
    assert detok.add(par) == " "  # "Par" could start "Paris.": held
    assert detok.add(is_) == ""  # "Paris" still could
    assert detok.add(dot) == "" and detok.stopped  # it was: nothing of it is ever sent
    assert detok.text == " "

    detok = IncrementalDetokenizer(tokenizer, ("Paris.",))
    assert [detok.add(t) for t in (par, is_, ian)] == [" ", "", "Parisian"]  # it was not: released
    assert not detok.stopped
    assert detok.add(dot, final=True) == "."


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("The answer is 42. Then more text", (". ",)),
        ("Café au lait, s'il vous plaît", ("lait",)),
        ("one two three four", ("x", "three", "two t")),  # the earliest match wins
        ("日本語のテキストです。東京", ("。",)),
        ("emoji 😀👍🏽 end", ("👍",)),
        ("ab ab ab abc", ("abc",)),
        ("line one\n\nline two", ("\n\n",)),
    ],
)
def test_text_stops_before_the_stop_string(tokenizer: Any, text: str, stop: tuple[str, ...]) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    cut = min(i for i in (text.find(s) for s in stop) if i >= 0)
    deltas, detok = stream(tokenizer, ids, stop=stop, final=False)
    assert detok.stopped
    assert "".join(deltas) == text[:cut] == detok.text
    emitted = ""
    for delta in deltas:  # no delta ever runs ahead of the final text
        emitted += delta
        assert text[:cut].startswith(emitted)


def test_text_without_the_stop_string_is_complete(tokenizer: Any) -> None:
    text = "Paris is the capital of France, Pari"  # ends in a prefix of the stop string
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, detok = stream(tokenizer, ids, stop=("Paris.",), final=False)
    assert not detok.stopped and "".join(deltas) == "Paris is the capital of France, "  # "Pari" held
    assert detok.flush() == "Pari"


# -- through the engine ----------------------------------------------------------------------------
PROMPT = "The capital of France is"  # greedy: " Paris.\n\nThe answer is: 201"


def generate(params: SamplingParams) -> tuple[Any, str]:
    """Runs one request on the shared SmolLM2 engine; returns its final output and its streamed text."""
    engine = smollm2().engine
    engine.add_request("detok", engine.encode(PROMPT), params)
    streamed = ""
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            streamed += out.text_delta
            assert REPLACEMENT not in out.text_delta
            if out.finished:
                final = out
    return final, streamed


def test_engine_text_without_stop() -> None:
    out, streamed = generate(SamplingParams(temperature=0, max_tokens=12))
    assert out.finish_reason == "length"
    assert out.text == streamed == " Paris.\n\nThe answer is: 201"


@pytest.mark.parametrize(
    ("stop", "text"),
    [
        (["."], " Paris"),
        (["\n\nThe", "answer"], " Paris."),  # spans three tokens; the earliest of two stop strings wins
        ([" is:"], " Paris.\n\nThe answer"),
    ],
)
def test_engine_stop_string_ends_generation_and_is_not_returned(stop: list[str], text: str) -> None:
    out, streamed = generate(SamplingParams(temperature=0, max_tokens=12, stop=stop))
    assert out.finish_reason == "stop"
    assert out.text == streamed == text
    assert len(out.token_ids) < 12


def test_engine_stop_string_on_the_last_token_reports_stop() -> None:
    # " Paris" then "." : the second token is both the max_tokens-th and completes the stop string.
    out, _ = generate(SamplingParams(temperature=0, max_tokens=2, stop=["."]))
    assert out.text == " Paris"
    assert out.finish_reason == "stop"


def test_shared_engine_is_left_idle() -> None:
    engine = smollm2().engine
    assert not engine.has_unfinished() and engine.stats().kv_allocated_blocks == 0
    drain(engine)


def test_a_byte_fallback_tokenizer_streams_through_the_windows(tmp_path: Any) -> None:
    """A Llama 2 / Mistral kind of BPE (<0xNN> byte-fallback tokens, tests/test_structured_outputs.py's):
    DecodeStream refuses its byte tokens, so the windows run (through the Rust decode), and the deltas of a
    text full of characters outside its vocabulary concatenate to the whole decode."""
    from test_structured_outputs import _byte_fallback_tokenizer

    from orca.frontend.detokenizer import rust_tokenizer

    tok = _byte_fallback_tokenizer(tmp_path)
    ids = tok.encode("".join(TEXTS), add_special_tokens=False)
    assert any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)  # byte tokens in play
    deltas, detok = stream(tok, ids)
    assert detok._stream is None and rust_tokenizer(tok) is not None
    assert "".join(deltas) == decode_all(tok, ids)
