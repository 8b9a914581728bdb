"""Shared test resources, cached per test process (tests/conftest.py belongs to the launcher tests).

Each tiny checkpoint is built once and each reference model loaded once per session, however many test
modules ask for it: the builders below are memoised, and the fixtures in the test modules are thin
wrappers around them. Also the helpers that turn a transformers model into the reference we compare to.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from checkpoints import make_gpt2, make_llama
from transformers import AutoModelForCausalLM

from orca import (
    LLM,
    EngineConfig,
    EngineCore,
    EngineCoreOutput,
    LLMEngine,
    OutputProcessor,
    RequestOutput,
    SamplingParams,
)

FAMILIES = ("gpt2", "llama")


class FakeCodec:
    """A stand-in tokenizer for the serving layer's tests, with an obvious mapping: one id per character."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def __init__(self) -> None:
        self.seen: tuple[list, list | None] | None = None  # the last apply_chat_template's (messages, tools)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        self.seen = (messages, tools)
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(i) for i in token_ids)


def s(value: str) -> np.ndarray:
    """A one-element BYTES input tensor, as Triton hands a string input to the model."""
    return np.array([value.encode()], dtype=object)
@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Imported by a test module (autouse): its tests run on one torch thread. The tiny models' steps are
    too short for two threads to pay, and on a busy host their OpenMP team waits on each other (tens of
    times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_BUILDERS: dict[str, Callable[[Path], Path]] = {"gpt2": make_gpt2, "llama": make_llama}


@functools.cache
def _root() -> Path:
    path = Path(tempfile.mkdtemp(prefix="orca-tests-"))
    atexit.register(shutil.rmtree, path, True)
    return path


@functools.cache
def tiny_checkpoint(family: str) -> Path:
    """A tiny random checkpoint of `family` (see tests/checkpoints.py), built once per session."""
    return _BUILDERS[family](_root() / family)


@functools.cache
def tiny_reference(family: str) -> Any:
    """The transformers model for the same checkpoint, in fp32: the numerical reference."""
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family), dtype=torch.float32).eval()


def tiny_engine(family: str, **options: Any) -> LLMEngine:
    """A fresh engine over the tiny checkpoint (cheap: the weights are a few hundred kB)."""
    return LLMEngine(EngineConfig(model=str(tiny_checkpoint(family)), **options))


def tiny_core(family: str, **options: Any) -> EngineCore:
    """A fresh engine core (token ids only: no tokenizer, no output processing) over the tiny checkpoint."""
    return EngineCore(EngineConfig(model=str(tiny_checkpoint(family)), **options))


class RequestOutputs:
    """An EngineLoop's on_output that turns the core's deltas into RequestOutputs with the real
    OutputProcessor and hands those to `callback`, as the Triton model does on its response thread. The
    model registers each request before submitting it; here a request is registered at its first delta
    (the tiny models have no tokenizer, so only ids accumulate)."""

    def __init__(self, callback: Callable[[RequestOutput], None]) -> None:
        self.processor = OutputProcessor(None)
        self.callback = callback

    def __call__(self, delta: EngineCoreOutput) -> None:
        if delta.request_id not in self.processor:
            self.processor.add_request(delta.request_id, 0, SamplingParams(), 0.0)
        for out in self.processor.process((delta,)).outputs:
            self.callback(out)


@functools.cache
def smollm2() -> LLM:
    """The default model (SmolLM2-135M-Instruct GGUF) through orca.LLM(), loaded once per session, its
    weights dequantized (quantization none: the path whose numbers are transformers' on the same file;
    LLM() itself serves the file's Q4_1 weights as int4, tests/test_gguf.py). Tests that use its engine
    must leave it idle (every request finished)."""
    return LLM(quantization="none")


@torch.inference_mode()
def hf_last_logits(model: Any, token_ids: list[int]) -> torch.Tensor:
    """(V,) logits of the last position of a full forward pass over token_ids."""
    return model(torch.tensor([token_ids])).logits[0, -1].float()


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate with EOS disabled: exactly max_new_tokens tokens."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    tokens = out[0, len(prompt) :].tolist()
    assert len(tokens) == max_new_tokens
    return tokens


def record_logits(engine: LLMEngine, monkeypatch: Any) -> list[dict[str, torch.Tensor]]:
    """From now on, records each iteration's logits as {request id: (V,) row}: the rows the sampler drew
    from, through the engine's public logits capture (RequestOutput.logits). Wraps step() only to
    collect them; `monkeypatch` undoes that at the end of the test."""
    iterations: list[dict[str, torch.Tensor]] = []
    step = engine.step
    engine.capture_logits = True

    def recording_step() -> list[RequestOutput]:
        outputs = step()
        rows = {out.request_id: out.logits for out in outputs if out.logits is not None}
        if rows:
            iterations.append(rows)
        return outputs

    monkeypatch.setattr(engine, "step", recording_step)
    return iterations


@torch.inference_mode()
def greedy_with_first_logits(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt's greedy tokens (EOS ignored: max_tokens each) and the logits its first token was drawn
    from (the prompt's own iteration), in prompt order, all prompts in flight together."""
    engine.capture_logits = True
    first: dict[str, torch.Tensor] = {}
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            if out.logits is not None and out.request_id not in first:
                first[out.request_id] = out.logits
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[str(i)] for i in range(len(prompts))], [first[str(i)] for i in range(len(prompts))]


def drain(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    """Steps the engine until it has no request left; returns each request's final output."""
    final: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return final
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final, f"{out.request_id} finished twice"
                final[out.request_id] = out
    raise AssertionError(f"the engine did not finish its requests in {max_steps} steps")


def cpu_graphs(worker: Any) -> Any:
    """The worker's CPU graphs runner (orca/worker/cpu_graphs/), None when another runner runs it."""
    from orca.worker.cpu_graphs import CPUGraphs

    return worker.runner if isinstance(worker.runner, CPUGraphs) else None


def decode_graphs(worker: Any) -> Any:
    """The worker's CUDA graphs runner (orca/worker/cuda_graphs.py), None when another runner runs it."""
    from orca.worker.cuda_graphs import DecodeGraphs

    return worker.runner if isinstance(worker.runner, DecodeGraphs) else None
