"""Structured outputs (orca/frontend/structured_outputs.py, orca/core/constraint.py): every constrained output
parses and validates, with three tokenizer kinds, greedy and sampled, alone and in a busy batch whose
unconstrained members keep exactly their tokens; bad schemas, regexes and grammars are clear errors.

The tiny models are random Llamas carrying a real tokenizer each: SmolLM2's (byte-level BPE, the default
model's), and two trained here on Python's own documentation text: a byte-level BPE (Llama 3's and Qwen's
kind) and a byte-fallback BPE with a "▁" word marker (Llama 2's and Mistral's sentencepiece kind). Their
logits vocabulary is padded past the tokenizer's, so the mask must also refuse ids no token has.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from _fixtures import smollm2
from checkpoints import make_llama
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca import LLM
from orca.frontend.grammar import choice_grammar
from orca.sampling_params import SamplingParams
from orca.structured_outputs_params import StructuredOutputs
from orca.worker.sampler import apply_allowed_tokens

# Every field bounded, so that even a random model's output completes within max_tokens.
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[a-z]{2}-[0-9]{2}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"]}},
        "status": {"enum": ["open", "paid", "shipped"]},
        "gift": {"type": "boolean"}},
     "required": ["id", "items", "status", "gift"]},
    {"type": "array", "minItems": 1, "maxItems": 3, "items": {"enum": ["red", "green", "blue", 7, None]}},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -50, "maximum": 50},
        "y": {"type": "integer", "minimum": -50, "maximum": 50}},
        "required": ["x", "y"]}, "label": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 5}]}},
     "required": ["point", "label"]},
]
REGEXES = [r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", r"\d{3}-\d{4}", r"(yes|no)(, because [a-z ]{1,12})?"]
CHOICES = [["positive", "negative", "neutral"], ['say "hi"', "back\\slash", "new\nline", "café ☕"]]
GRAMMAR = 'root ::= expr\nexpr ::= term ("+" term){0,3}\nterm ::= [1-9] | "(" expr ")"'
GRAMMAR_LANGUAGE = re.compile(r"^[0-9()+]+$")
PROMPTS = ["Answer in JSON: who are you?", "The order was", "Pick:", "x"]


def _corpus() -> list[str]:
    from pydoc_data.topics import topics

    return [t for _, t in sorted(topics.items())][:60]


def _byte_level_tokenizer(path: Path) -> Any:
    """Llama 3 / Qwen kind: byte-level BPE over a GPT-style pre-tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<|begin|>", "<|eot|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|eot|>")
    fast.save_pretrained(path)
    return fast


def _byte_fallback_tokenizer(path: Path) -> Any:
    """Llama 2 / Mistral kind: BPE over "▁"-marked words with <0xNN> byte-fallback tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    def build(model: Any) -> Any:
        tok = Tokenizer(model)
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        return tok

    trained = build(models.BPE(unk_token="<unk>"))
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<unk>", "<s>", "</s>"])
    trained.train_from_iterator(_corpus(), trainer)
    # The <0xNN> byte tokens are ordinary vocabulary (as in Llama 2's), not special tokens.
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for i in range(256):
        vocab.setdefault(f"<0x{i:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = build(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)
    return fast


def _smollm2_tokenizer(path: Path) -> Any:
    from orca.checkpoint import load_tokenizer, resolve_checkpoint

    tok = load_tokenizer(resolve_checkpoint(None))
    tok.save_pretrained(path)
    return tok


TOKENIZERS = {"smollm2": _smollm2_tokenizer, "byte_level": _byte_level_tokenizer,
              "byte_fallback": _byte_fallback_tokenizer}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = tmp_path_factory.mktemp(f"so-{request.param}")
    tok = TOKENIZERS[request.param](path)
    vocab = (len(tok) + 63) // 64 * 64 + 64  # padded: ids past the tokenizer's must never be drawn
    make_llama(path, vocab_size=vocab, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
               bos_token_id=tok.bos_token_id or 0)
    return LLM(str(path), max_bs=32, dtype="float32", torch_compile="off", quantization="none")


def _constrained(so: dict[str, Any], seed: int, greedy: bool, max_tokens: int = 160) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy else 1.0, seed=seed,
                          structured_outputs=so)


def _check(kind: str, spec: Any, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(spec, text), (spec, text)
    elif kind == "choice":
        assert text in spec, (spec, text)
    else:
        assert GRAMMAR_LANGUAGE.match(text) and eval(text) >= 1, text  # noqa: S307 - digits, + and ()


def _cases() -> list[tuple[str, Any, dict[str, Any]]]:
    cases: list[tuple[str, Any, dict[str, Any]]] = [
        ("json", s, {"json": s, "disable_any_whitespace": True}) for s in SCHEMAS
    ]
    cases += [("regex", r, {"regex": r}) for r in REGEXES]
    cases += [("choice", c, {"choice": c}) for c in CHOICES]
    cases += [("grammar", None, {"grammar": GRAMMAR})]
    return cases


def test_every_constrained_output_validates_in_a_busy_batch(tiny: LLM) -> None:
    """Each case greedy and with 3 seeds, all in one busy batch with unconstrained requests: every
    constrained output completes ("stop") and validates; the unconstrained ones are token for token what
    they are alone."""
    prompts, params, expect = [], [], []
    for i, (kind, spec, so) in enumerate(_cases()):
        for j, seed in enumerate((None, 11, 12, 13)):
            prompts.append(PROMPTS[(i + j) % len(PROMPTS)])
            params.append(_constrained(so, seed or 0, greedy=seed is None))
            expect.append((kind, spec))
    plain = [SamplingParams(max_tokens=24, temperature=t, seed=5, ignore_eos=True) for t in (0.0, 1.0, 0.7)]
    alone = tiny.generate(PROMPTS[:3], plain)
    outs = tiny.generate(PROMPTS[:3] + prompts, plain + params)
    for a, b in zip(alone, outs[:3]):
        assert a.token_ids == b.token_ids
    for (kind, spec), out in zip(expect, outs[3:]):
        assert out.finish_reason == "stop", (kind, spec, out.text, out.finish_reason)
        _check(kind, spec, out.text)


def test_json_object_and_the_default_whitespace(tiny: LLM) -> None:
    """json_object (any JSON object) and a schema with any whitespace allowed (vLLM's default): what
    completes parses; a completion cut by max_tokens is reported as "length", never as "stop"."""
    params = [_constrained({"json_object": True}, s, greedy=False, max_tokens=64) for s in range(4)]
    params += [_constrained({"json": SCHEMAS[0]}, s, greedy=s == 0, max_tokens=64) for s in range(4)]
    outs = tiny.generate(["{"] * len(params), params)
    for p, out in zip(params, outs):
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            _check(p.structured_outputs.kind, SCHEMAS[0] if p.structured_outputs.kind == "json" else None, out.text)


def test_the_default_model_answers_a_schema() -> None:
    """SmolLM2 (the shipped model) with its own tokenizer: a schema, a choice and a regex, greedy."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"]}
    params = [SamplingParams(max_tokens=48, temperature=0, structured_outputs={"json": schema}),
              SamplingParams(max_tokens=8, temperature=0, structured_outputs={"choice": ["Paris", "London"]}),
              SamplingParams(max_tokens=12, temperature=0, structured_outputs={"regex": r"[A-Z][a-z]+"})]
    outs = smollm2().generate(["What is the capital of France? Answer as JSON with city and country."] * 3, params)
    data = json.loads(outs[0].text)
    jsonschema.validate(data, schema)
    assert "Paris" in data["city"]
    assert outs[1].text == "Paris" and outs[1].finish_reason == "stop"
    assert re.fullmatch(r"[A-Z][a-z]+", outs[2].text)


def test_ignore_eos_still_stops_when_the_grammar_is_complete(tiny: LLM) -> None:
    out = tiny.generate(["Pick:"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                  structured_outputs={"choice": ["alpha", "beta"]}))[0]
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"


def test_preemption_keeps_the_grammar_state(tmp_path: Path) -> None:
    """A pool too small for every request: requests are preempted and recompute, and still validate."""
    _smollm2_tokenizer(tmp_path)
    make_llama(tmp_path, vocab_size=49216, max_position_embeddings=512, eos_token_id=2, bos_token_id=1)
    llm = LLM(str(tmp_path), max_bs=8, dtype="float32", torch_compile="off", quantization="none",
              kv_admission="on_demand", n_slots=192, block_size=16)
    so = {"json": SCHEMAS[1], "disable_any_whitespace": True}
    outs = llm.generate(["The order was"] * 6, [_constrained(so, s, greedy=False, max_tokens=120) for s in range(6)])
    assert llm.engine.stats().preemptions > 0
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMAS[1])


# -- the mask itself -------------------------------------------------------------------------------
def test_the_bitmask_masks_exactly_the_disallowed_tokens() -> None:
    rng = np.random.default_rng(0)
    vocab = 1000  # 32 words cover 1024 ids: the last 24 are past the vocabulary
    logits = torch.randn(5, vocab)
    words = [rng.integers(-(2**31), 2**31 - 1, size=32, dtype=np.int64).astype(np.int32) for _ in range(3)]
    masked = logits.clone()
    apply_allowed_tokens(masked, [(0, words[0].tobytes()), (2, words[1].tobytes()), (4, words[2].tobytes())])
    for row, w in zip((0, 2, 4), words):
        allowed = torch.tensor([bool((int(w[t // 32]) >> (t % 32)) & 1) for t in range(vocab)])
        assert torch.equal(masked[row][allowed], logits[row][allowed])
        assert torch.all(masked[row][~allowed] == float("-inf"))
    assert torch.equal(masked[1], logits[1]) and torch.equal(masked[3], logits[3])
    short = np.zeros(16, dtype=np.int32)  # a mask shorter than the logits: ids past it are disallowed
    short[0] = 1
    row = logits[:1].clone()
    apply_allowed_tokens(row, [(0, short.tobytes())])
    assert torch.isfinite(row[0]).nonzero().flatten().tolist() == [0]


def test_choice_grammar_escapes_every_character() -> None:
    assert choice_grammar(['a"b', "c\\d", "e\nf"]) == 'root ::= "a\\"b" | "c\\\\d" | "e\\u000af"'


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("so", "message"), [
    ({}, "exactly one of json, json_object, regex, choice, grammar, got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["a", ""]}, r"structured_outputs.choice\[1\] must be a non-empty string"),
    ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON object"),
    ({"json": "{bad"}, "structured_outputs.json is not valid JSON"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be true"),
    ({"regex": "  "}, "structured_outputs.regex must be a non-empty string"),
    ({"json": {}, "disable_any_whitespace": 1}, "disable_any_whitespace must be a boolean"),
    ({"json": {}, "backend": "outlines"}, "structured_outputs.backend must be"),
    ({"jsn": {}}, "unknown structured_outputs key"),
    ("not json", "structured_outputs is not valid JSON"),
])
def test_malformed_structured_outputs_name_the_field(so: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict({"structured_outputs": so})


def test_guided_decoding_is_the_older_name() -> None:
    p = SamplingParams.from_dict({"guided_decoding": {"regex": "[0-9]+"}})
    assert p.structured_outputs == StructuredOutputs("regex", "[0-9]+")
    assert SamplingParams.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="not both"):
        SamplingParams.from_dict({"guided_decoding": {"regex": "a"}, "structured_outputs": {"regex": "a"}})


@pytest.mark.parametrize(("so", "message"), [
    ({"json": {"type": "strin"}}, "structured_outputs.json is not a valid JSON Schema"),
    ({"json": {"type": "object", "properties": {"a": {"minimum": "3"}}}}, "not a valid JSON Schema at properties/a"),
    ({"json": {"not": {"type": "string"}}}, "the keyword 'not' .* is not supported"),
    ({"json": {"type": "object", "properties": {"a": {"if": {}, "then": {}}}}}, "'if' \\(at /properties/a\\)"),
    ({"json": {"allOf": [{"type": "object"}, {"required": ["a"]}]}}, "allOf with more than one subschema"),
    ({"json": {"$ref": "#/$defs/missing"}}, "structured_outputs.json is a JSON schema the grammar engine cannot"),
    ({"regex": "([a-z]"}, "structured_outputs.regex does not compile"),
    ({"grammar": 'root ::= "a" |'}, "structured_outputs.grammar is not a valid EBNF grammar"),
    ({"grammar": 'start ::= "a"'}, "root rule"),
])
def test_what_does_not_compile_is_refused_before_any_work(tiny: LLM, so: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=so))
    assert not tiny.engine.has_unfinished()
    assert tiny.generate(["x"], SamplingParams(max_tokens=2, temperature=0))[0].finish_reason == "length"


def test_a_model_without_a_tokenizer_refuses_structured_outputs(tmp_path: Path) -> None:
    llm = LLM(str(make_llama(tmp_path)), dtype="float32", torch_compile="off")
    with pytest.raises(ValueError, match="structured_outputs need a tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, structured_outputs={"regex": "a+"}))


_JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=6),
                         st.sampled_from(["string", "object", "array", "integer", "number", "null", "boolean"]))
_KEYS = st.sampled_from(["type", "properties", "items", "required", "enum", "minimum", "maxLength", "pattern",
                         "anyOf", "$ref", "additionalProperties", "const", "format", "x"])
_FUZZ_SCHEMAS = st.recursive(_JSON_LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(_KEYS, inner, max_size=4)), max_leaves=12)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=st.dictionaries(_KEYS, _FUZZ_SCHEMAS, max_size=4), grammar=st.text(max_size=30))
def test_fuzzed_schemas_and_grammars_compile_or_are_clear_errors(smollm2_compiler: Any, schema: dict[str, Any],
                                                                  grammar: str) -> None:
    for so in ({"json": schema}, {"grammar": grammar or "x"}, {"regex": grammar or "x"}):
        try:
            parsed = SamplingParams.from_dict({"structured_outputs": so}).structured_outputs
            smollm2_compiler.compile(parsed)
        except ValueError as exc:
            assert str(exc).startswith(("structured_outputs", "unknown structured_outputs")), exc


@pytest.fixture(scope="module")
def smollm2_compiler() -> Any:
    from orca.checkpoint import load_tokenizer, resolve_checkpoint
    from orca.frontend.structured_outputs import StructuredOutputCompiler

    return StructuredOutputCompiler(load_tokenizer(resolve_checkpoint(None)), 49152, {2})


def test_compiles_are_cached_and_bounded_in_time(smollm2_compiler: Any) -> None:
    import threading

    so = StructuredOutputs.parse({"json": SCHEMAS[1]})
    smollm2_compiler.compile(so)
    assert smollm2_compiler.cached(so)
    got: list[Any] = []
    smollm2_compiler.compile_async(so, lambda c, e: got.append((c, e)))  # cached: answered at once
    assert len(got) == 1 and got[0][1] is None and got[0][0].allowed_tokens()
    done = threading.Event()
    slow = StructuredOutputs.parse({"regex": "[a-z]{1,40}@[a-z]{1,40}\\.(com|org|net)"})
    timed_out = type(smollm2_compiler)(smollm2_compiler.tokenizer, 49152, {2}, timeout=0.0)
    answers: list[Any] = []
    timed_out.compile_async(slow, lambda c, e: (answers.append((c, e)), done.set()))
    assert done.wait(30)
    assert answers[0][0] is None and "took longer than 0 s to compile" in answers[0][1]
    timed_out.shutdown()


def test_bounded_strings_refuse_control_characters(smollm2_compiler: Any) -> None:
    """xgrammar's bounded-length strings let raw control characters through (orca patches its grammar):
    such an output would not be JSON."""
    import xgrammar

    so = StructuredOutputs.parse({"json": {"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}},
                                           "required": ["a"]}, "disable_any_whitespace": True})
    compiled = smollm2_compiler.compile(so)
    assert xgrammar.GrammarMatcher(compiled).accept_string('{"a": "ok"}')
    for bad in ('{"a": "o\x15"}', '{"a": "\t"}', '{"a": "\n"}'):
        assert not xgrammar.GrammarMatcher(compiled).accept_string(bad), repr(bad)


def test_the_timeline_marks_constrained_arrivals(tmp_path: Path) -> None:
    _smollm2_tokenizer(tmp_path)
    make_llama(tmp_path, vocab_size=49216, max_position_embeddings=512, eos_token_id=2, bos_token_id=1)
    trace = tmp_path / "run.jsonl"
    llm = LLM(str(tmp_path), dtype="float32", torch_compile="off", quantization="none", trace=str(trace))
    llm.generate(["a", "b"], [SamplingParams(max_tokens=4, structured_outputs={"choice": ["x", "y"]}),
                              SamplingParams(max_tokens=4)])
    llm.engine.shutdown()
    arrivals = [r for r in map(json.loads, trace.read_text().splitlines()) if r.get("type") == "arrival"]
    assert [r.get("constrained", False) for r in arrivals] == [True, False]
