"""Triton's side of orca-openai: one gRPC channel (tritonclient.grpc.aio), one bidirectional stream per request.

Triton's gRPC stream hands errors over as a message without a status code, so :func:`classify` maps the
messages orca_gpt and Triton write to HTTP statuses (the README lists them).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpc
from orca_client import admin
from orca_client import client as orca_client
from orca_client.client import Chunk, parse_result
from tritonclient.utils import InferenceServerException

ORCA_INPUTS = frozenset({"input_ids", "text_input", "messages", "stream", "sampling_parameters"})
"""A model is served here when it is decoupled and takes (at least) these inputs of orca_gpt's."""

LORA_CONTROL = "lora_control"
"""orca_gpt's input of LoRA control requests (orca_triton/lora.py): list, load and unload adapters in-band."""

_IDS = itertools.count()


class APIError(Exception):
    """An error answered as OpenAI's error object with an HTTP status."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def classify(message: str) -> APIError:
    """The HTTP status of an error message from orca_gpt (INVALID_ARG, UNAVAILABLE, INTERNAL) or Triton."""
    low = message.lower()
    if "waiting queue is full" in low:
        return APIError(429, message, "rate_limit_error", code="queue_full")
    if any(s in low for s in ("engine failed", "engine has failed", "shutting down", "unknown model", "not ready",
                              "unavailable", "request cancelled")):
        return APIError(503, message, "service_unavailable", code="model_unavailable")
    if low.startswith(("internal error", "generation failed")):
        return APIError(500, message, "server_error", code="engine_failure")
    return APIError(400, message, "invalid_request_error")


@dataclass
class ModelInfo:
    name: str
    ready: bool
    outputs: frozenset[str]
    inputs: frozenset[str] = ORCA_INPUTS
    created: int = field(default_factory=lambda: int(time.time()))
    lora: bool = False  # serves LoRA adapters (enable_lora, and the lora_control input)
    adapters: dict[str, str] = field(default_factory=dict)  # the adapters it serves: name -> path on Triton's host

    @property
    def has_logprobs(self) -> bool:
        return "logprobs" in self.outputs

    @property
    def has_cache_salt(self) -> bool:
        return "cache_salt" in self.inputs

    @property
    def has_tools(self) -> bool:
        return "tools" in self.inputs


def build_inputs(
    prompt: str | list[int] | list[dict[str, Any]], sampling: dict[str, Any], return_logprobs: bool = False,
    cache_salt: str | None = None, tools: list[dict[str, Any]] | None = None,
) -> list[grpcclient.InferInput]:
    """orca_gpt's request tensors (orca_client's): text, token ids or chat messages; always streaming,
    completion only, with finish_reason and the token counts (each response's: chunk_usage sums them); the
    cache_salt input when a salt is given, the tools input when tools are."""
    if isinstance(prompt, str):
        source: dict[str, Any] = {"text": prompt}
    elif prompt and isinstance(prompt[0], dict):
        source = {"messages": prompt}
    else:
        source = {"input_ids": prompt}
    return orca_client.build_inputs(
        **source, stream=True, exclude_input_in_output=True, return_logprobs=True if return_logprobs else None,
        return_finish_reason=True, return_num_input_tokens=True, return_num_output_tokens=True,
        cache_salt=cache_salt, tools=tools or None, **sampling,
    )


def _channel_args() -> list[tuple[str, Any]]:
    """tritonclient's defaults (message sizes, keepalive), and reconnection within a second: gRPC's own
    backoff grows to two minutes, so an orca-openai started before Triton (make serve) would answer 503
    for up to that long after Triton came up."""
    keepalive = grpcclient.KeepAliveOptions()
    size = grpcclient.MAX_GRPC_MESSAGE_SIZE
    return [
        ("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


class Triton:
    """Talks to one Triton server; the models it serves are looked up at most every ``ttl`` seconds.

    Triton's repository index is an admin call (its model-repository API is restricted behind the admin key,
    orca_client.admin): ``admin_key`` returns the key to send, asked at each lookup (a key file may appear after
    orca-openai starts), or None to send none."""

    def __init__(self, url: str, ttl: float = 2.0, admin_key: Callable[[], str | None] | None = None) -> None:
        self.url, self.ttl, self.admin_key = url, ttl, admin_key
        self.client = aiogrpc.InferenceServerClient(url, channel_args=_channel_args())
        self._models: dict[str, ModelInfo] = {}
        self._models_at = -1e9
        self._lock = asyncio.Lock()
        self.index_calls = 0  # repository lookups made (each an index call and a config call per model)

    async def close(self) -> None:
        await self.client.close()

    async def models(self, refresh: bool = False) -> dict[str, ModelInfo]:
        """Every orca model in the repository (ready or not): decoupled, with orca_gpt's inputs. Looked up
        again when the last lookup is older than ``ttl``, or with ``refresh`` when none began after this call
        did: callers queued behind one lookup share it rather than each making their own under the lock."""
        asked = time.monotonic()
        async with self._lock:
            if time.monotonic() - self._models_at > self.ttl or (refresh and self._models_at < asked):
                self.index_calls += 1
                started = time.monotonic()
                self._models = await self._load_models()
                self._models_at = started
            return self._models

    async def _load_models(self) -> dict[str, ModelInfo]:
        key = self.admin_key() if self.admin_key is not None else None
        try:
            index = await self.client.get_model_repository_index(
                headers=admin.grpc_headers(key), as_json=True, client_timeout=10)
        except (InferenceServerException, grpc.RpcError, OSError) as exc:  # Triton down or still starting
            message = exc.message() if isinstance(exc, InferenceServerException) else str(exc)
            if "restricted" in (message or "").lower():  # Triton's words for a missing or wrong admin-key
                raise APIError(503, f"Triton at {self.url} refused to list its models (its model-repository API "
                               "is restricted): give orca-openai Triton's admin key (--triton-admin-key-file or "
                               "$ORCA_ADMIN_KEY)", "service_unavailable", code="model_unavailable") from None
            raise APIError(503, f"Triton at {self.url} is unreachable: {message}", "service_unavailable",
                           code="model_unavailable") from None
        found: dict[str, ModelInfo] = {}
        for entry in index.get("models", []):
            name = entry["name"]
            ready = entry.get("state") == "READY"
            if not ready:
                continue  # an unloaded model's config cannot be read; it is not served
            try:
                config = (await self.client.get_model_config(name, as_json=True, client_timeout=10))["config"]
            except InferenceServerException:
                continue
            policy = config.get("model_transaction_policy") or {}
            inputs = {i["name"] for i in config.get("input", [])}
            if policy.get("decoupled") and ORCA_INPUTS <= inputs:
                outputs = frozenset(o["name"] for o in config.get("output", []))
                enable_lora = config.get("parameters", {}).get("enable_lora", {}).get("string_value", "")
                lora = LORA_CONTROL in inputs and enable_lora.strip().lower() == "true"
                info = found[name] = ModelInfo(name, ready, outputs, frozenset(inputs), lora=lora)
                if lora:
                    try:
                        answer = await self._control(name, {"action": "list"})
                    except APIError:
                        continue  # unloaded or failed meanwhile: not served
                    info.adapters = {a["name"]: a["path"] for a in answer.get("adapters", [])}
        return found

    async def resolve(self, name: str) -> tuple[ModelInfo, str | None]:
        """The model a request's `model` names and its LoRA adapter: a model by its name (adapter None), or an
        adapter (as vLLM lists them) by its name, with the model serving it; 404 for neither. An unknown name
        forces no lookup (a flood of made-up names would queue every request behind index calls): a model
        loaded into Triton directly is found within ``ttl``."""
        models = await self.models()
        if name in models:
            return models[name], None
        for info in models.values():
            if name in info.adapters:
                return info, name
        raise APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model",
                       "model_not_found")

    async def load_lora(self, model: str | None, name: str, path: str) -> ModelInfo:
        """Loads an adapter into `model` (None: the one orca model serving LoRA adapters) through its
        lora_control input; 400 naming the adapter and the reason when it is refused."""
        models = await self.models(refresh=True)
        if name in models:
            raise APIError(400, f"The lora adapter '{name}' cannot be loaded: a model has that name", param="lora_name")
        if any(name in info.adapters for info in models.values()):
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        info = self._lora_model(models, model)
        await self._control(info.name, {"action": "load", "lora_name": name, "lora_path": path})
        await self.models(refresh=True)
        return info

    async def unload_lora(self, model: str | None, name: str) -> ModelInfo:
        """Unloads an adapter from the model serving it (or `model`); 404 when none serves it."""
        models = await self.models(refresh=True)
        serving = [info for info in models.values() if name in info.adapters and model in (None, info.name)]
        if not serving:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "not_found_error", "lora_name",
                           "lora_adapter_not_found")
        await self._control(serving[0].name, {"action": "unload", "lora_name": name})
        await self.models(refresh=True)
        return serving[0]

    @staticmethod
    def _lora_model(models: dict[str, ModelInfo], model: str | None) -> ModelInfo:
        if model is not None:
            if model not in models:
                raise APIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model",
                               "model_not_found")
            if not models[model].lora:
                raise APIError(400, f"The model `{model}` serves no LoRA adapters (its parameter enable_lora is not "
                               "true)", param="model")
            return models[model]
        lora = [info for info in models.values() if info.lora]
        if not lora:
            raise APIError(400, "No model serves LoRA adapters: set the parameter enable_lora to \"true\" in a "
                           "model's config.pbtxt")
        if len(lora) > 1:
            raise APIError(400, "Several models serve LoRA adapters "
                           f"({', '.join(sorted(i.name for i in lora))}): say which with \"model\"", param="model")
        return lora[0]

    async def _control(self, model: str, request: dict[str, Any]) -> dict[str, Any]:
        """One lora_control request (orca_triton/lora.py) and its JSON answer; its error as an APIError (404:
        an adapter that is not served; 400: a refused adapter or request; 503: the model is unavailable)."""
        control = grpcclient.InferInput(LORA_CONTROL, [1], "BYTES")
        control.set_data_from_numpy(np.array([json.dumps(request).encode()], dtype=np.object_))
        request_id = f"lora-{next(_IDS)}"

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": model, "inputs": [control], "request_id": request_id}

        stream = self.client.stream_infer(requests())
        try:
            result, error = await asyncio.wait_for(stream.__anext__(), timeout=300)
        except (StopAsyncIteration, asyncio.TimeoutError):
            raise APIError(503, f"{model} did not answer its LoRA control request", "service_unavailable") from None
        except grpc.RpcError as exc:
            details = exc.details() if hasattr(exc, "details") else str(exc)
            raise APIError(503, f"Triton at {self.url}: {details}", "service_unavailable") from None
        finally:
            stream.cancel()
        if error is not None:
            message = error.message()
            if "is not served" in message:
                raise APIError(404, message, "not_found_error", "lora_name", "lora_adapter_not_found")
            raise classify(message)
        value = result.as_numpy("text_output").reshape(-1)[0]
        return json.loads(value.decode() if isinstance(value, bytes) else str(value))

    async def ready(self, required: tuple[str, ...] = ()) -> tuple[bool, str]:
        """Ready when Triton is, with at least one orca model loaded and every ``required`` one ready (the
        models as last looked up, within ``ttl``: a probe every second makes no index call of its own)."""
        try:
            if not await self.client.is_server_ready(client_timeout=5):
                return False, "Triton is not ready"
            models = await self.models()
            if not models:
                return False, "no orca model is loaded"
            for name in required or tuple(models):
                if name not in models or not await self.client.is_model_ready(name, client_timeout=5):
                    return False, f"model {name} is not ready"
            return True, "ready"
        except (InferenceServerException, grpc.RpcError, OSError) as exc:
            return False, f"Triton at {self.url} is unreachable: {exc}"
        except APIError as exc:  # the lookup's own (Triton unreachable, or the admin key missing)
            return False, exc.message

    async def generate(self, model: str, inputs: list[grpcclient.InferInput]) -> AsyncIterator[Chunk]:
        """orca_gpt's responses to one request, on a stream of its own. Leaving early (an exception, a
        cancelled task, aclose) cancels the gRPC call, which makes orca_gpt abort the request."""
        request_id = f"openai-{next(_IDS)}"

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": model, "inputs": inputs, "request_id": request_id}

        try:
            stream = self.client.stream_infer(requests())
        except InferenceServerException as exc:
            raise APIError(503, f"Triton at {self.url}: {exc.message()}", "service_unavailable") from None
        done = False
        try:
            while True:
                try:
                    result, error = await stream.__anext__()
                except StopAsyncIteration:
                    done = True
                    return
                except grpc.RpcError as exc:
                    done = True
                    details = exc.details() if hasattr(exc, "details") else str(exc)
                    raise APIError(503, f"Triton at {self.url}: {details}", "service_unavailable") from None
                if error is not None:
                    done = True
                    raise classify(error.message())
                chunk = parse_result(result)
                yield chunk
                if chunk.final:
                    done = True
                    return
        finally:
            if not done:
                stream.cancel()
