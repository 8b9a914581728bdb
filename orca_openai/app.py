"""The ASGI app: OpenAI's /v1/models, /v1/completions and /v1/chat/completions over orca models served by Triton."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import socket
import struct
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from orca_client import admin
from starlette.exceptions import HTTPException as StarletteHTTPException

from orca_openai import protocol, tools
from orca_openai.triton import APIError, Chunk, Triton, build_inputs

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_CONCURRENT_REQUESTS = 512
DEFAULT_STREAM_WRITE_TIMEOUT = 30.0
API_KEY_SCOPE = "orca_openai.api_key"
"""The ASGI scope's key under which Guard leaves the caller's API key (for the salt derived from it)."""
TRANSPORT_SCOPE = "orca_openai.transport"
"""The ASGI scope's key under which the app leaves the connection's asyncio transport (None if the server's
is not reachable): Guard resets a stalled client's connection through it."""

log = logging.getLogger("uvicorn.error")  # uvicorn's own logger: its format, its --log-level


@dataclass
class Settings:
    triton_url: str = "localhost:8001"
    metrics_url: str = "http://localhost:8002/metrics"
    api_keys: tuple[str, ...] = ()  # /v1/ wants one of them (a tenant each); none: open
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # /v1/ requests served at once; more are answered 503 at once (not queued)
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    # a response whose socket takes longer than this to drain is cut off, its Triton request cancelled (None: never)
    stream_write_timeout: float | None = DEFAULT_STREAM_WRITE_TIMEOUT
    # usage.prompt_tokens_details.cached_tokens (vLLM's --enable-prompt-tokens-details): off, since a caller's
    # cached_tokens says whether any earlier prompt began as theirs, another tenant's included
    enable_prompt_tokens_details: bool = False
    # each request's prefix-cache salt derived from its caller's API key (tenant_salt): tenants share no K/V
    cache_salt_from_key: bool = False
    cache_salt_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    # Triton's admin key, sent with the repository index call: this one, else $ORCA_ADMIN_KEY, else the file's
    # (read at each lookup: it may appear after orca-openai starts), else none
    triton_admin_key: str | None = field(default=None, repr=False)
    triton_admin_key_file: str | None = None
    required_models: tuple[str, ...] = ()  # /health is 503 unless these are ready (always: Triton, one orca model)
    tool_call_parser: str = "auto"  # how tool_choice "auto" finds calls in the text (orca_openai.tools.PARSERS)
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's, behind the same switch: its
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING); off, they answer 404
    allow_runtime_lora_updating: bool = False

    def admin_key(self) -> str | None:
        """Triton's admin key: triton_admin_key, else $ORCA_ADMIN_KEY, else the file's (None while the launcher
        has not written it yet, or it cannot be read: Triton's refusal then says what is missing)."""
        if self.triton_admin_key:
            return self.triton_admin_key
        try:
            return admin.admin_key(self.triton_admin_key_file)
        except OSError:
            return None


def tenant_salt(secret: bytes, api_key: str, salt: str | None = None) -> str:
    """The prefix-cache salt of the caller holding `api_key`: HMAC-SHA256 of the key under `secret`, in hex.
    A salt the caller sent partitions its own cache further: it is combined under the tenant's (an HMAC of
    it keyed by the tenant's), so no salt a client sends can name another tenant's cache."""
    tenant = hmac.new(secret, api_key.encode(), hashlib.sha256).digest()
    if salt is None:
        return tenant.hex()
    return hmac.new(tenant, salt.encode(), hashlib.sha256).hexdigest()


@dataclass
class Stats:
    """Guard's counts, on ``app.state.stats``."""

    in_flight: int = 0  # /v1/ requests being served
    refused_busy: int = 0  # answered 503 at max_concurrent_requests
    stalled: int = 0  # responses cut off at the write timeout: their clients stopped reading


class StalledClient(Exception):
    """A response's bytes did not drain within the write timeout: its client stopped reading."""


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


_deadline = getattr(asyncio, "timeout", None)
"""asyncio.timeout (Python 3.11 on): a timer, not a task per send as wait_for (the container's 3.10) makes."""


class Guard:
    """Pure ASGI middleware (it leaves streaming and disconnects alone), before the app reads a byte of the
    body: with API keys, /v1/ wants ``Authorization: Bearer KEY`` with one of them (401 otherwise; the
    caller's key is left in the scope under API_KEY_SCOPE); a POST whose Content-Type is not
    application/json is answered 415 (a web page can POST text/plain across sites without a preflight); past
    ``max_concurrent`` /v1/ requests in flight, 503; a request body over ``limit`` bytes, 413. A response
    whose send does not complete within ``write_timeout`` (uvicorn's send waits while the socket's buffer is
    full: the client stopped reading) is cut off, which cancels its Triton request."""

    def __init__(self, app: Any, limit: int, api_keys: tuple[str, ...] = (),
                 max_concurrent: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
                 write_timeout: float | None = DEFAULT_STREAM_WRITE_TIMEOUT, stats: Stats | None = None) -> None:
        self.app, self.limit, self.max_concurrent, self.write_timeout = app, limit, max_concurrent, write_timeout
        self.api_keys = [key.encode() for key in api_keys]
        self.stats = stats if stats is not None else Stats()

    def _caller(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """The API key the request holds, if it is one of ours (each compared in constant time)."""
        value = next((v for k, v in headers if k == b"authorization"), b"")
        scheme, _, token = value.partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer":
            return None
        found = None
        for key in self.api_keys:  # every key compared: the time taken does not tell which matched
            if hmac.compare_digest(token, key):
                found = key
        return None if found is None else found.decode()

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers") or []
        v1 = scope.get("path", "").startswith("/v1/")
        if self.api_keys and v1:
            caller = self._caller(headers)
            if caller is None:
                unauthorized = APIError(401, "Incorrect API key provided", "invalid_request_error",
                                        code="invalid_api_key")
                await error_response(unauthorized)(scope, receive, send)
                return
            scope[API_KEY_SCOPE] = caller
        if scope.get("method") == "POST":
            types = [v for k, v in headers if k == b"content-type"]
            media = types[0].decode("latin-1").partition(";")[0].strip().lower() if len(types) == 1 else ""
            if media != "application/json":
                got = (f"{len(types)} Content-Type headers" if types[1:] else
                       json.dumps(types[0][:100].decode("latin-1")) if types else "none")
                unsupported = APIError(415, f"the request body's Content-Type must be application/json, got {got}",
                                       "invalid_request_error", code="unsupported_media_type")
                await error_response(unsupported)(scope, receive, send)
                return
        if v1 and self.stats.in_flight >= self.max_concurrent:
            self.stats.refused_busy += 1
            busy = APIError(503, f"orca-openai is serving its limit of {self.max_concurrent} requests at once "
                            "(--max-concurrent-requests): retry later", "service_unavailable", code="server_busy")
            await error_response(busy)(scope, receive, send)
            return
        if v1:
            self.stats.in_flight += 1
        try:
            await self._serve(scope, receive, send, dict(headers))
        except StalledClient as exc:
            self.stats.stalled += 1
            log.warning("%s %s: %s; its request is cancelled", scope.get("method"), scope.get("path"), exc)
            _reset(scope.get(TRANSPORT_SCOPE))
        finally:
            if v1:
                self.stats.in_flight -= 1

    async def _serve(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Any,
                     headers: dict[bytes, bytes]) -> None:
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

        await self.app(scope, replay, self._timed(send))

    def _timed(self, send: Any) -> Any:
        if not self.write_timeout:
            return send
        timeout = self.write_timeout

        async def timed(message: dict[str, Any]) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            try:
                if _deadline is not None:
                    async with _deadline(timeout):
                        await send(message)
                else:
                    await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                raise StalledClient(f"the client read nothing for {timeout:g} s (--stream-write-timeout)") from None

        return timed


def _reset(transport: Any) -> None:
    """Drops a stalled client's connection at once (a TCP reset). uvicorn's close of a response that never
    completed waits for the bytes already buffered to drain, which a client that reads nothing never lets
    happen: the connection, its buffers and its place under uvicorn's connection bound (limit_concurrency)
    would be held for as long as the client keeps it open."""
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # linger 0: the close discards what is unsent and resets
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _leave_transport_in_scope(app: FastAPI) -> None:
    """The outermost layer of `app` leaves the connection's transport in each HTTP scope (TRANSPORT_SCOPE). ASGI
    has no way to abort a connection; uvicorn's send is a method of its request-response cycle, which holds
    the transport (another server, or a send wrapped before the app: None, and Guard cannot reset)."""
    build = app.build_middleware_stack

    def build_middleware_stack() -> Any:
        stack = build()

        async def outermost(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                scope[TRANSPORT_SCOPE] = getattr(getattr(send, "__self__", None), "transport", None)
            await stack(scope, receive, send)

        return outermost

    app.build_middleware_stack = build_middleware_stack  # type: ignore[method-assign]


def create_app(settings: Settings) -> FastAPI:
    if settings.cache_salt_from_key and not settings.api_keys:
        raise ValueError("cache_salt_from_key needs API keys: the salt is derived from the caller's key")
    state: dict[str, Triton] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # its gRPC channel belongs to this event loop
        state["triton"] = Triton(settings.triton_url, admin_key=settings.admin_key)
        yield
        await state["triton"].close()

    app = FastAPI(title="orca-openai", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.stats = stats = Stats()

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
        salt, caller = req.cache_salt, request.scope.get(API_KEY_SCOPE)
        if settings.cache_salt_from_key and caller is not None:
            if not info.has_cache_salt:  # the deployment's mistake: its tenants would share the prefix cache
                raise APIError(500, f"orca-openai derives each caller's cache_salt from its API key, and {info.name} "
                               "has no cache_salt input", "server_error", code="cache_salt_not_supported")
            salt = tenant_salt(settings.cache_salt_secret, caller, salt)
        elif salt is not None and not info.has_cache_salt:
            raise APIError(400, f"cache_salt is not supported by this model ({info.name} has no cache_salt input)",
                           "invalid_request_error", "cache_salt", "cache_salt_not_supported")
        if req.tools and not info.has_tools:
            raise APIError(400, f"tools are not supported by this model ({info.name} has no tools input)",
                           "invalid_request_error", "tools", "tools_not_supported")
        inputs = build_inputs(req.prompt, req.sampling, return_logprobs=req.logprobs is not None,
                              cache_salt=salt, tools=req.tools)
        parser = req.tool_parser(settings.tool_call_parser) if chat else None
        details = settings.enable_prompt_tokens_details
        kind = "chatcmpl" if chat else "cmpl"
        ident = f"{kind}-{uuid.uuid4().hex}"
        created = int(time.time())
        gen = triton().generate(info.name, inputs)
        if not req.stream:
            try:
                chunks = await _collect_unless_disconnected(request, gen)
            finally:
                await gen.aclose()
            return JSONResponse(_full_response(req, chat, ident, created, chunks, parser, details))
        try:
            first = await gen.__anext__()  # an error before the first token is an HTTP status, not an event
        except StopAsyncIteration:
            first = None
        except BaseException:
            await gen.aclose()
            raise
        return _EventStream(_events(req, chat, ident, created, first, gen, parser, details),
                            media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    app.add_middleware(Guard, limit=settings.max_body_bytes, api_keys=settings.api_keys,
                       max_concurrent=settings.max_concurrent_requests, write_timeout=settings.stream_write_timeout,
                       stats=stats)
    _leave_transport_in_scope(app)
    return app


class _EventStream(StreamingResponse):
    """A StreamingResponse that closes its events however it ends (done, the client gone, or stalled past the
    write timeout), so the Triton request is cancelled then, not whenever the generator is collected."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


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
    req: protocol.Request, chat: bool, ident: str, created: int, chunks: list[Chunk], parser: Any = None,
    details: bool = False,
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
        "usage": protocol.chunk_usage(chunks, details),
    }


async def _events(
    req: protocol.Request, chat: bool, ident: str, created: int, first: Chunk | None, gen: Any, parser: Any = None,
    details: bool = False,
) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's chunk format; leaving early (the client hung up) cancels the request.
    With a tool call parser, chat deltas are its content and tool_calls entries (one entry an event); with
    ``details``, the usage's prompt_tokens_details."""
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
            cached = last.num_cached_tokens if details else None
            yield event([], usage=protocol.usage(last.num_input_tokens or 0, generated, cached))
    except APIError as err:  # after the 200: OpenAI's clients raise on an event with an "error" key
        yield f"data: {json.dumps(err.body())}\n\n".encode()
    finally:
        await gen.aclose()
    yield b"data: [DONE]\n\n"
