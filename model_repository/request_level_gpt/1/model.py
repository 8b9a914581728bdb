"""Triton adapter for the request-level baseline (the paper's FasterTransformer + dynamic batcher setup).

Not decoupled: Triton's dynamic batcher forms the batch and hands it to execute() as a list of requests
(each with its own tensors, so prompts of different lengths need no padding). execute() runs the whole
batch with orca.frontend.request_level.RequestLevelBatcher on the same engine model code as orca_gpt and returns
one response per request only when the longest member is done; requests arriving meanwhile queue in
Triton until the next batch. Request meaning (inputs, sampling parameters, outputs) is orca_triton.generate's,
exactly as for orca_gpt, with Triton's batch dimension in front of every tensor.

Triton hands a request to execute() only when its batch starts, so the time it waited in the batcher's
queue is invisible here. A client that wants it counted (orca-bench trace does, for the timeline's
"waiting") sends the request parameter ``client_send_time``: the Unix time, in seconds, at which it sent
the request. The request's arrival is then that moment (never later than execute(); by the client's
clock, so a client on another host shifts it by the clocks' difference): its latency and its wait in the
iteration timeline count from there.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from orca import EngineConfig, LLMEngine
from orca.frontend.request_level import REQUEST_LEVEL_OPTIONS, RequestLevelBatcher
from orca_triton.generate import INPUT_NAMES, GenerateRequest, parse_generate_request, response_tensors
from orca_triton.lifecycle import log_to_stderr, start_reaper

logger = logging.getLogger("request_level_gpt")

# The engine's own limits that Triton's configuration decides here: max_bs is max_batch_size (a whole
# Triton batch must run in one group of iterations) and the waiting queue is Triton's.
_DERIVED = ("max_bs", "max_queue")
_AS_FASTERTRANSFORMER = ("the baseline reserves K/V up front, runs whole prompts and caches no prefixes, as "
                         "FasterTransformer does")


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        log_to_stderr(logger.name)  # the engine's load and compile progress, in the server's log
        model_config = json.loads(args["model_config"])
        if pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("request_level_gpt must not be decoupled: it answers once per batch")
        max_batch_size = int(model_config.get("max_batch_size", 0))
        if max_batch_size < 1:
            raise pb_utils.TritonModelException("request_level_gpt needs max_batch_size >= 1 and dynamic_batching")
        self.engine = LLMEngine(_engine_config(model_config, max_batch_size))
        self.name = args["model_name"]
        self.batcher = RequestLevelBatcher(self.engine, id_prefix=f"{self.name}-")
        self.has_tokenizer = self.engine.tokenizer is not None
        self._reaper = start_reaper()  # kills this stub should tritonserver die (killed, crashed), as orca_gpt's
        logger.info(
            "%s ready: %s, max_batch_size=%d, n_slots=%d",
            self.name, self.engine.checkpoint, max_batch_size, self.engine.n_slots,
        )

    def execute(self, requests: list[Any]) -> list[Any]:
        """One Triton batch: every valid request runs in it; one response per request, in order."""
        responses: list[Any] = [None] * len(requests)
        members: list[tuple[int, GenerateRequest]] = []
        arrivals: list[float | None] = []
        for i, request in enumerate(requests):
            try:
                parameters = json.loads(request.parameters() or "{}")
                arrival = _arrival_time(parameters.pop(SEND_TIME_PARAMETER, None))
                parsed = self._parse(request, parameters)
                self.batcher.validate(parsed.prompt_token_ids, parsed.params, parsed.cache_salt)
                members.append((i, parsed))
                arrivals.append(arrival)
            except ValueError as exc:
                responses[i] = _error(str(exc), pb_utils.TritonError.INVALID_ARG)
        if not members:
            return responses
        try:
            outputs = self.batcher.run([(p.prompt_token_ids, p.params) for _, p in members], arrivals)
        except Exception as exc:  # noqa: BLE001 - answer every request whatever went wrong
            logger.exception("a batch of %d requests failed", len(members))
            for i, _ in members:
                responses[i] = _error(f"internal error: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)
            return responses
        for (i, parsed), out in zip(members, outputs):
            if out.finish_reason == "error":
                responses[i] = _error(f"generation failed: {out.error}", pb_utils.TritonError.INTERNAL)
                continue
            tensors = response_tensors(out, parsed, self.has_tokenizer)
            # Every output gets Triton's batch dimension back: this request is one batch member.
            responses[i] = pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(k, v[np.newaxis]) for k, v in tensors.items()]
            )
        return responses

    def finalize(self) -> None:
        # execute() finishes its batch before Triton unloads the model: nothing is in flight, only the reaper.
        if self._reaper is not None:
            self._reaper.kill()
            self._reaper.wait(timeout=10)

    def _parse(self, request: Any, parameters: dict[str, Any]) -> GenerateRequest:
        inputs = {}
        for name in INPUT_NAMES:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                continue
            array = tensor.as_numpy()
            if array.ndim == 0 or array.shape[0] != 1:
                rows = "no" if array.ndim == 0 else array.shape[0]
                raise ValueError(f"{name} has {rows} batch rows: send one prompt per request (shape [1, ...])")
            inputs[name] = array[0]
        parsed = parse_generate_request(
            inputs, parameters, self.engine.text, self.has_tokenizer, sampling_defaults=self.engine.sampling_defaults
        )
        if parsed.stream:
            raise ValueError(
                f"{self.name} answers each request once, when its batch ends: it cannot stream "
                "(send stream=false, or use orca_gpt)"
            )
        return parsed


SEND_TIME_PARAMETER = "client_send_time"


def _arrival_time(sent: Any) -> float | None:
    """The request's arrival on the monotonic clock from the client's send time (Unix seconds), never
    later than now; None when the client sent none."""
    if sent is None:
        return None
    if isinstance(sent, bool) or not isinstance(sent, (int, float, str)):
        raise ValueError(f"{SEND_TIME_PARAMETER} must be Unix time in seconds (a number), got {sent!r}")
    try:
        sent = float(sent)
    except ValueError:
        raise ValueError(f"{SEND_TIME_PARAMETER} must be Unix time in seconds (a number), got {sent!r}") from None
    if sent != sent or sent <= 0:
        raise ValueError(f"{SEND_TIME_PARAMETER} must be Unix time in seconds (> 0), got {sent!r}")
    return time.monotonic() - max(0.0, time.time() - sent)


def _error(message: str, code: Any) -> Any:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _engine_config(model_config: dict[str, Any], max_batch_size: int) -> EngineConfig:
    """EngineConfig from the config.pbtxt parameters (strings; empty = default), as orca_gpt reads them;
    Triton's batcher decides the batch size and holds the queue."""
    raw = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
    reason = "request_level_gpt takes it from max_batch_size and dynamic_batching"
    try:
        return EngineConfig.from_parameters(
            raw,
            fixed={"max_bs": max_batch_size, "max_queue": max_batch_size, **REQUEST_LEVEL_OPTIONS},
            not_settable={
                **dict.fromkeys(_DERIVED, reason),
                **dict.fromkeys(REQUEST_LEVEL_OPTIONS, _AS_FASTERTRANSFORMER),
                "n_workers": "request-level batches run one at a time",
            },
        )
    except ValueError as exc:
        raise pb_utils.TritonModelException(str(exc)) from None
