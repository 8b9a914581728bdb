"""A thin, typed wrapper over tritonclient's gRPC streaming for orca_gpt's tensor interface."""

from __future__ import annotations

import itertools
import json
import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


class OrcaError(RuntimeError):
    """An error response from the server (status is the Triton status, e.g. StatusCode.INVALID_ARGUMENT)."""

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Chunk:
    """One response: the ids (and text, when the model has a tokenizer) it carries."""

    output_ids: list[int]
    text: str | None
    final: bool
    # The vllm_backend outputs, each present when its return_* flag was true (OrcaClient.generate asks for
    # these three): finish_reason on the final response (None before it), the prompt's tokens, and this
    # response's tokens (len(output_ids))
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    # return_logprobs: per token of this response {token id: {"logprob", "rank", "decoded_token"}} (None when
    # not asked, or when the request named no sampling parameter logprobs)
    logprobs: list[dict[int, dict[str, Any]]] | None = None
    cumulative_logprob: float | None = None  # return_cumulative_logprob: the sum so far
    num_cached_tokens: int | None = None  # on the final response: prompt tokens found in the prefix cache
    time: float = field(default_factory=time.perf_counter)


def build_inputs(
    input_ids: list[int] | None = None,
    text: str | None = None,
    messages: list[dict[str, str]] | None = None,
    stream: bool = True,
    exclude_input_in_output: bool = True,
    return_finish_reason: bool | None = None,
    return_num_input_tokens: bool | None = None,
    return_num_output_tokens: bool | None = None,
    return_logprobs: bool | None = None,
    return_cumulative_logprob: bool | None = None,
    cache_salt: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    **sampling: Any,
) -> list[grpcclient.InferInput]:
    """The request tensors for orca_gpt; `sampling` holds SamplingParams keys (max_tokens, logprobs, ...).
    The return_* flags (vllm_backend's) are sent when not None (the server sends an additional output only
    when its flag is true); `logprobs=n` with `return_logprobs=True` gets each token's log-probability and
    the top n. `exclude_input_in_output` must stay true when streaming (the server refuses false).
    `cache_salt` (sent when not None): requests with different salts never share the prefix cache's keys
    and values. `tools` (with `messages`; sent when not None): OpenAI's tool objects, rendered by the
    model's chat template."""
    inputs = []

    def add(name: str, dtype: str, value: np.ndarray) -> None:
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        inputs.append(t)

    if input_ids is not None:
        add("input_ids", "INT32", np.asarray(input_ids, dtype=np.int32))
    if text is not None:
        add("text_input", "BYTES", np.asarray([text.encode()], dtype=np.object_))
    if messages is not None:
        add("messages", "BYTES", np.asarray([json.dumps(messages).encode()], dtype=np.object_))
    if tools is not None:
        add("tools", "BYTES", np.asarray([json.dumps(tools).encode()], dtype=np.object_))
    add("stream", "BOOL", np.asarray([stream]))
    add("exclude_input_in_output", "BOOL", np.asarray([exclude_input_in_output]))
    if cache_salt is not None:
        add("cache_salt", "BYTES", np.asarray([cache_salt.encode()], dtype=np.object_))
    flags = {
        "return_finish_reason": return_finish_reason, "return_num_input_tokens": return_num_input_tokens,
        "return_num_output_tokens": return_num_output_tokens, "return_logprobs": return_logprobs,
        "return_cumulative_logprob": return_cumulative_logprob,
    }
    for name, value in flags.items():
        if value is not None:
            add(name, "BOOL", np.asarray([bool(value)]))
    sampling = {k: v for k, v in sampling.items() if v is not None}
    if sampling:
        add("sampling_parameters", "BYTES", np.asarray([json.dumps(sampling).encode()], dtype=np.object_))
    return inputs


def parse_result(result: Any) -> Chunk:
    response = result.get_response()
    final = response.parameters["triton_final_response"].bool_param if "triton_final_response" in (
        response.parameters
    ) else False
    names = {o.name for o in response.outputs}

    def get(name: str) -> Any:
        return result.as_numpy(name) if name in names else None

    ids = get("output_ids")
    text = get("text_output")
    reason = get("finish_reason")
    n_in, n_out = get("num_input_tokens"), get("num_output_tokens")
    logprobs, cumulative = get("logprobs"), get("cumulative_logprob")
    cached = get("num_cached_tokens")
    reason = None if reason is None else reason.reshape(-1)[0].decode()
    return Chunk(
        output_ids=[] if ids is None else [int(x) for x in ids.reshape(-1)],
        text=None if text is None else b"".join(text.reshape(-1)).decode("utf-8"),
        final=final,
        finish_reason=None if reason in (None, "None") else reason,  # vllm_backend's "None" before the end
        num_input_tokens=None if n_in is None else int(n_in.reshape(-1)[0]),
        num_output_tokens=None if n_out is None else int(n_out.reshape(-1)[0]),
        logprobs=None if logprobs is None else _parse_logprobs(logprobs.reshape(-1)[0]),
        cumulative_logprob=None if cumulative is None else float(cumulative.reshape(-1)[0]),
        num_cached_tokens=None if cached is None else int(cached.reshape(-1)[0]),
    )


def _parse_logprobs(raw: bytes) -> list[dict[int, dict[str, Any]]] | None:
    """vllm_backend's logprobs JSON (token ids as string keys; "null" when not computed)."""
    entries = json.loads(raw)
    return None if entries is None else [{int(k): v for k, v in entry.items()} for entry in entries]


class OrcaClient:
    """Sends orca_gpt requests over gRPC streaming.

    Each request gets its own stream: Triton's stream errors carry no request id, so on a shared stream
    an error could not be told apart from another request's. Leaving a request's iterator early (or
    calling close on it) cancels the request on the server.
    """

    def __init__(self, url: str = "localhost:8001", model: str = "orca_gpt") -> None:
        self.url, self.model = url, model

    def __enter__(self) -> OrcaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def generate(self, timeout: float | None = 600, **request: Any) -> Iterator[Chunk]:
        """Streams one request's responses (stream=True: one per iteration that produced a token;
        stream=False: one). `request`: build_inputs' arguments; return_finish_reason,
        return_num_input_tokens and return_num_output_tokens are true unless given, so each Chunk has
        them. Raises OrcaError for an error response."""
        model = request.pop("model", self.model)
        for flag in ASKED_BY_DEFAULT:
            request.setdefault(flag, True)
        results: queue.Queue[Chunk | OrcaError] = queue.Queue()

        def on_result(result: Any, error: InferenceServerException | None) -> None:
            if error is not None:
                status = error.status()  # None on gRPC streams: tritonclient passes only the message
                results.put(OrcaError(error.message(), None if status is None else str(status)))
            else:
                results.put(parse_result(result))

        client = grpcclient.InferenceServerClient(self.url)
        done = False
        try:
            client.start_stream(callback=on_result)
            client.async_stream_infer(model, build_inputs(**request), request_id=f"orca-client-{next(_IDS)}")
            while True:
                item = results.get(timeout=timeout)
                if isinstance(item, OrcaError):
                    done = True
                    raise item
                done = item.final
                yield item
                if done:
                    return
        finally:
            client.stop_stream(cancel_requests=not done)
            client.close()


_IDS = itertools.count()
ASKED_BY_DEFAULT = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")
"""The additional outputs OrcaClient.generate asks for unless told otherwise."""
