"""The ASGI app: OpenAI's /v1/models, /v1/completions and /v1/chat/completions over orca models served by Triton."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from orca_openai import protocol, tools
from orca_openai.triton import APIError, Chunk, Triton, build_inputs

DEFAULT_MAX_BODY_BYTES = 1 << 20


@dataclass
class Settings:
    triton_url: str = "localhost:8001"
    metrics_url: str = "http://localhost:8002/metrics"
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    required_models: tuple[str, ...] = ()  # /health is 503 unless these are ready (always: Triton, one orca model)
    tool_call_parser: str = "auto"  # how tool_choice "auto" finds calls in the text (orca_openai.tools.PARSERS)
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, behind the same switch: its
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING); off, they answer 404
    allow_runtime_lora_updating: bool = False


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class Guard:
    """Pure ASGI middleware (it leaves streaming and disconnects alone): with an API key, /v1/ wants
    ``Authorization: Bearer KEY`` (401 otherwise); a request body over ``limit`` bytes is answered 413
    before the app reads it."""

    def __init__(self, app: Any, limit: int, api_key: str | None = None) -> None:
        self.app, self.limit, self.api_key = app, limit, api_key

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key and scope.get("path", "").startswith("/v1/"):
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                unauthorized = APIError(401, "Incorrect API key provided", "invalid_request_error",
                                        code="invalid_api_key")
                await error_response(unauthorized)(scope, receive, send)
                return
        too_large = APIError(413, f"the request body is larger than {self.limit} bytes", "invalid_request_error",
                             code="request_too_large")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await error_response(too_large)(scope, receive, send)
            return
        messages, size = [], 0
        while True:  # buffered (bounded) so a chunked body is counted too
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                await error_response(too_large)(scope, receive, send)
                return
            if not message.get("more_body"):
                break

        async def replay() -> Any:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def create_app(settings: Settings) -> FastAPI:
    state: dict[str, Triton] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state["triton"] = Triton(settings.triton_url)  # its gRPC channel belongs to this event loop
        yield
        await state["triton"].close()

    app = FastAPI(title="orca-openai", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    def triton() -> Triton:
        return state["triton"]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail), "invalid_request_error"))

    async def body_of(request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply to parse") from None
        except ValueError as exc:  # e.g. an integer past Python's digit bound: a client's error, not a 500
            raise APIError(400, f"the request body could not be parsed as JSON: {exc}") from None

    @app.get("/health")
    async def health() -> Response:
        ok, why = await triton().ready(settings.required_models)
        return PlainTextResponse(why, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        def fetch() -> tuple[int, bytes, str]:
            try:
                with urllib.request.urlopen(settings.metrics_url, timeout=10) as r:
                    return r.status, r.read(), r.headers.get("content-type", "text/plain")
            except urllib.error.HTTPError as err:
                return err.code, err.read(), "text/plain"
            except OSError as err:
                return 503, f"Triton's metrics at {settings.metrics_url} are unreachable: {err}".encode(), "text/plain"

        status, content, media = await asyncio.to_thread(fetch)
        return Response(content, status_code=status, media_type=media)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        models = await triton().models(refresh=True)
        cards = []
        for m in models.values():  # each model, then the LoRA adapters it serves (as vLLM lists them)
            cards.append(_model_card(m.name, m.created))
            cards += [_model_card(name, m.created, path, m.name) for name, path in m.adapters.items()
                      if name not in models]
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict[str, Any]:
        info, lora = await triton().resolve(name)
        if lora is not None:
            return _model_card(lora, info.created, info.adapters[lora], info.name)
        return _model_card(info.name, info.created)

    def _lora_updating(body: Any, keys: tuple[str, ...]) -> dict[str, Any]:
        if not settings.allow_runtime_lora_updating:
            raise APIError(404, "Not Found: loading and unloading LoRA adapters at run time is off (start orca-openai "
                           "with --allow-runtime-lora-updating)", "not_found_error")
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        unknown = set(body) - {*keys, "model", "load_inplace"}
        if unknown:
            raise APIError(400, f"unrecognized request argument supplied: {', '.join(sorted(unknown))}")
        for key in keys:
            if not isinstance(body.get(key), str) or not body[key].strip():
                raise APIError(400, f"{key} must be a non-empty string", param=key)
        if body.get("model") is not None and not isinstance(body["model"], str):
            raise APIError(400, "model must be a string: the model that serves the adapter", param="model")
        return body

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = _lora_updating(await body_of(request), ("lora_name", "lora_path"))
        await triton().load_lora(body.get("model"), body["lora_name"], body["lora_path"])
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = _lora_updating(await body_of(request), ("lora_name",))
        await triton().unload_lora(body.get("model"), body["lora_name"])
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = protocol.completion_request(await body_of(request))
        return await _serve(request, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = protocol.chat_request(await body_of(request))
        return await _serve(request, req, chat=True)

    async def _serve(request: Request, req: protocol.Request, chat: bool) -> Response:
        info, lora = await triton().resolve(req.model)
        if lora is not None:  # a LoRA adapter: its base model runs the request with it
            req.sampling["lora_name"] = lora
        if req.logprobs is not None:
            if not info.has_logprobs:
                raise APIError(400, f"logprobs are not supported by this model ({info.name} has no logprobs output)",
                               "invalid_request_error", "logprobs", "logprobs_not_supported")
            req.sampling["logprobs"] = req.logprobs
        if req.cache_salt is not None and not info.has_cache_salt:
            raise APIError(400, f"cache_salt is not supported by this model ({info.name} has no cache_salt input)",
                           "invalid_request_error", "cache_salt", "cache_salt_not_supported")
        if req.tools and not info.has_tools:
            raise APIError(400, f"tools are not supported by this model ({info.name} has no tools input)",
                           "invalid_request_error", "tools", "tools_not_supported")
        inputs = build_inputs(req.prompt, req.sampling, return_logprobs=req.logprobs is not None,
                              cache_salt=req.cache_salt, tools=req.tools)
        parser = req.tool_parser(settings.tool_call_parser) if chat else None
        kind = "chatcmpl" if chat else "cmpl"
        ident = f"{kind}-{uuid.uuid4().hex}"
        created = int(time.time())
        gen = triton().generate(info.name, inputs)
        if not req.stream:
            try:
                chunks = await _collect_unless_disconnected(request, gen)
            finally:
                await gen.aclose()
            return JSONResponse(_full_response(req, chat, ident, created, chunks, parser))
        try:
            first = await gen.__anext__()  # an error before the first token is an HTTP status, not an event
        except StopAsyncIteration:
            first = None
        except BaseException:
            await gen.aclose()
            raise
        return StreamingResponse(_events(req, chat, ident, created, first, gen, parser), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    app.add_middleware(Guard, limit=settings.max_body_bytes, api_key=settings.api_key)
    return app


def _model_card(name: str, created: int, root: str | None = None, parent: str | None = None) -> dict[str, Any]:
    """A model's card; a LoRA adapter's, as vLLM's: root its directory, parent the model serving it."""
    return {"id": name, "object": "model", "created": created, "owned_by": "orca", "root": root or name,
            "parent": parent}


async def _collect_unless_disconnected(request: Request, gen: AsyncIterator[Chunk]) -> list[Chunk]:
    """All responses of a non-streaming request; a client that hangs up first cancels it."""

    async def collect() -> list[Chunk]:
        return [chunk async for chunk in gen]

    task = asyncio.ensure_future(collect())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise APIError(499, "the client closed the request", "invalid_request_error")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def _choice_logprobs(req: protocol.Request, chat: bool, chunk: Chunk, offset: int) -> dict[str, Any] | None:
    if req.logprobs is None or chunk.logprobs is None:
        return None
    if chat:
        return protocol.chat_logprobs(chunk, req.logprobs)
    return protocol.completion_logprobs(chunk, req.logprobs, offset)


def _finish_reason(reason: str | None, calls: bool) -> str | None:
    """The engine's reason, or "tool_calls" when the text held calls (a cut-off answer stays "length")."""
    return "tool_calls" if calls and reason != "length" else reason


def _full_response(
    req: protocol.Request, chat: bool, ident: str, created: int, chunks: list[Chunk], parser: Any = None
) -> dict[str, Any]:
    text, parts, offset = req.echo, [], len(req.echo)
    for chunk in chunks:
        part = _choice_logprobs(req, chat, chunk, offset)
        if part is not None:
            parts.append(part)
        text += chunk.text or ""
        offset += len(chunk.text or "")
    last = chunks[-1] if chunks else Chunk([], None, True)
    logprobs = protocol.merge_logprobs(parts)
    choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason, "logprobs": logprobs}
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if parser is not None:
            content, calls = tools.parse_all(parser, text)
            if calls:
                message["content"] = content or None
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
                choice["finish_reason"] = _finish_reason(last.finish_reason, True)
        choice["message"] = message
    else:
        choice["text"] = text
    return {
        "id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
        "model": req.model, "choices": [choice], "system_fingerprint": None,
        "usage": protocol.chunk_usage(chunks),
    }


async def _events(
    req: protocol.Request, chat: bool, ident: str, created: int, first: Chunk | None, gen: Any, parser: Any = None
) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's chunk format; leaving early (the client hung up) cancels the request.
    With a tool call parser, chat deltas are its content and tool_calls entries (one entry an event)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": ident, "object": obj, "created": created, "model": req.model, "system_fingerprint": None}

    def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        payload = {**base, "choices": choices, **extra}
        if req.include_usage and "usage" not in extra:
            payload["usage"] = None
        return f"data: {json.dumps(payload)}\n\n".encode()

    def choice(text: str, reason: str | None, logprobs: Any, role: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {}
            if text and not role:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def parsed(chunk: Chunk, logprobs: Any) -> list[bytes]:
        """The events of one response through the tool call parser: its content, then each tool_calls
        entry; the finish_reason on the last event of the final response."""
        delta = parser.feed(chunk.text or "")
        if chunk.final:
            end = parser.finish()
            delta.content += end.content
            delta.calls += end.calls
        deltas: list[dict[str, Any]] = []
        if delta.content:
            deltas.append({"content": delta.content})
        deltas += [{"tool_calls": [entry]} for entry in delta.calls]
        if not deltas and (logprobs is not None or chunk.final):
            deltas.append({})
        out = []
        for i, d in enumerate(deltas):
            last_one = chunk.final and i == len(deltas) - 1
            reason = _finish_reason(chunk.finish_reason, bool(parser.calls)) if last_one else None
            out.append(event([{"index": 0, "delta": d, "logprobs": logprobs if i == 0 else None,
                               "finish_reason": reason}]))
        return out

    last: Chunk | None = None
    generated = 0  # the completion's tokens: the sum of each response's num_output_tokens
    offset = len(req.echo)
    try:
        if chat:
            yield event([choice("", None, None, role=True)])
        elif req.echo:
            yield event([choice(req.echo, None, None)])
        chunk = first
        while chunk is not None:
            last = chunk
            generated += chunk.num_output_tokens or 0
            logprobs = _choice_logprobs(req, chat, chunk, offset)
            offset += len(chunk.text or "")
            if parser is not None:
                for data in parsed(chunk, logprobs):
                    yield data
            elif chunk.text or logprobs is not None or chunk.final or chunk.output_ids:
                yield event([choice(chunk.text or "", chunk.finish_reason if chunk.final else None, logprobs)])
            try:
                chunk = await gen.__anext__()
            except StopAsyncIteration:
                chunk = None
        if parser is not None and last is not None and not last.final:  # ended without a final response
            for data in parsed(Chunk([], None, True), None):
                yield data
        if req.include_usage and last is not None:
            yield event([], usage=protocol.usage(last.num_input_tokens or 0, generated, last.num_cached_tokens))
    except APIError as err:  # after the 200: OpenAI's clients raise on an event with an "error" key
        yield f"data: {json.dumps(err.body())}\n\n".encode()
    finally:
        await gen.aclose()
    yield b"data: [DONE]\n\n"
