"""orca-openai attacked as a web page, another tenant or a misbehaving client would (README "Security").

In-process first (Guard, the CLI's start-up checks, the salts, the admin key), then against the session's
real Triton: non-JSON POSTs that never reach it, a cross-tenant probe of the prefix cache, a stream whose
client stops reading, and the model index under a flood of health probes and made-up model names.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from _server import orca_openai, stalled_stream
from test_server_e2e import metrics, wait_for

from orca_openai import cli, protocol
from orca_openai.app import API_KEY_SCOPE, Guard, Settings, Stats, _EventStream, _full_response, tenant_salt
from orca_openai.triton import APIError, Chunk, Triton

KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
POST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
# What a web page's form or fetch() sends across sites without a CORS preflight (no Content-Type: fetch's
# default for a Blob), each with a body that is valid JSON all the same
NON_JSON_TYPES = (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x")


# -- Guard, in-process --------------------------------------------------------------------------------
def _scope(path: str, method: str = "POST", headers: dict[str, str] | None = None) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path,
            "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}


async def _call(app: Any, scope: dict[str, Any], body: bytes = b"{}") -> tuple[int, bytes, list[dict[str, Any]]]:
    """(status, body, the messages sent) of one request through `app`; its receive hands over `body`, then
    waits (the client stays connected)."""
    sent: list[dict[str, Any]] = []
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), sent


class Inner:
    """The app behind Guard: records each request it is handed (and the body it read), answers 200."""

    def __init__(self) -> None:
        self.seen: list[tuple[dict[str, Any], bytes]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = (await receive()).get("body", b"")
        self.seen.append((scope, body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize("route", POST_ROUTES)
def test_a_post_that_is_not_json_is_a_415_before_the_app_reads_it(route: str) -> None:
    inner = Inner()
    guard = Guard(inner, limit=1000)
    body = json.dumps({"model": "orca_gpt", "prompt": "x"}).encode()
    for ctype in (*NON_JSON_TYPES, "application/jsonp", "text/json"):
        status, answer, _ = asyncio.run(_call(guard, _scope(route, headers={"Content-Type": ctype} if ctype else {}),
                                              body))
        error = json.loads(answer)["error"]
        assert (status, error["code"]) == (415, "unsupported_media_type"), (ctype, answer)
        assert "Content-Type must be application/json" in error["message"]
    two = {"headers": [(b"content-type", b"application/json"), (b"content-type", b"text/plain")]}
    assert asyncio.run(_call(guard, {**_scope(route), **two}, body))[0] == 415  # which one would the app read?
    assert inner.seen == []
    for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON ;charset=UTF-8"):
        assert asyncio.run(_call(guard, _scope(route, headers={"Content-Type": ctype}), body))[0] == 200
    assert [b for _, b in inner.seen] == [body] * 3
    # GETs carry no body: they need no Content-Type
    assert asyncio.run(_call(guard, _scope("/v1/models", "GET")))[0] == 200


def test_any_of_several_api_keys_opens_v1_and_the_caller_is_known() -> None:
    inner = Inner()
    guard = Guard(inner, limit=1000, api_keys=(KEY_A, KEY_B))
    json_ = {"Content-Type": "application/json"}
    for key in (KEY_A, KEY_B):
        for scheme in ("Bearer", "bearer"):
            scope = _scope("/v1/completions", headers={**json_, "Authorization": f"{scheme} {key}"})
            assert asyncio.run(_call(guard, scope))[0] == 200
            assert inner.seen[-1][0][API_KEY_SCOPE] == key
    for auth in ({}, {"Authorization": "Bearer sk-tenant-c"}, {"Authorization": f"Basic {KEY_A}"},
                 {"Authorization": f"Bearer {KEY_A}x"}):
        status, answer, _ = asyncio.run(_call(guard, _scope("/v1/completions", headers={**json_, **auth})))
        assert (status, json.loads(answer)["error"]["code"]) == (401, "invalid_api_key"), auth
    assert len(inner.seen) == 4
    assert asyncio.run(_call(guard, _scope("/health", "GET")))[0] == 200  # probes need no key


def test_past_max_concurrent_requests_v1_is_a_503_at_once() -> None:
    async def main() -> None:
        release, entered = asyncio.Event(), asyncio.Event()
        inside = 0

        async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
            nonlocal inside
            await receive()
            if scope["path"].startswith("/v1/"):
                inside += 1
                if inside == 2:
                    entered.set()
                await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        stats = Stats()
        guard = Guard(inner, limit=1000, max_concurrent=2, stats=stats)
        json_ = {"Content-Type": "application/json"}
        held = [asyncio.create_task(_call(guard, _scope("/v1/completions", headers=json_))) for _ in range(2)]
        await entered.wait()
        assert stats.in_flight == 2
        status, answer, _ = await _call(guard, _scope("/v1/chat/completions", headers=json_))
        error = json.loads(answer)["error"]
        assert (status, error["code"], stats.refused_busy) == (503, "server_busy", 1)
        assert "--max-concurrent-requests" in error["message"]
        assert (await _call(guard, _scope("/health", "GET")))[0] == 200  # not counted: probes still answer
        release.set()
        assert [(await t)[0] for t in held] == [200, 200]
        assert stats.in_flight == 0
        assert (await _call(guard, _scope("/v1/completions", headers=json_)))[0] == 200

    asyncio.run(main())


def test_a_client_that_stops_reading_is_cut_off_and_its_events_closed() -> None:
    """uvicorn's send waits while the socket's buffer is full: a send that never completes is a client that
    stopped reading. The response is cut off after the write timeout and its events generator closed (the
    Triton request it streams is cancelled in its finally)."""

    async def main(stall: bool) -> tuple[Stats, int, bool, list[dict[str, Any]]]:
        produced, closed = 0, asyncio.Event()

        async def events() -> Any:
            nonlocal produced
            try:
                for _ in range(1000):
                    produced += 1
                    yield b"data: {}\n\n"
            finally:
                closed.set()

        async def inner(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await _EventStream(events(), media_type="text/event-stream")(scope, receive, send)

        stats = Stats()
        guard = Guard(inner, limit=1000, write_timeout=0.05, stats=stats)
        never = asyncio.Event()
        sent: list[dict[str, Any]] = []
        pending = [{"type": "http.request", "body": b"", "more_body": False}]

        async def receive() -> dict[str, Any]:
            if pending:
                return pending.pop()
            await asyncio.Event().wait()  # connected, silent
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            if stall and message["type"] == "http.response.body" and len(sent) == 4:
                await never.wait()  # the socket's buffer never drains
            sent.append(message)

        await asyncio.wait_for(guard(_scope("/v1/completions", "GET"), receive, send), 60)
        return stats, produced, closed.is_set(), sent

    stats, produced, closed, sent = asyncio.run(main(stall=True))
    assert (stats.stalled, stats.in_flight, closed) == (1, 0, True)
    assert produced == 4 and len(sent) == 4  # the start and 3 events; the 4th never left
    stats, produced, closed, sent = asyncio.run(main(stall=False))  # a reading client gets every event
    assert (stats.stalled, produced, closed) == (0, 1000, True)
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


# -- salts, usage, token ids, the CLI --------------------------------------------------------------------
def test_salts_derived_from_keys_are_the_tenants_own() -> None:
    secret = b"s" * 32
    a, b = tenant_salt(secret, KEY_A), tenant_salt(secret, KEY_B)
    assert a != b and a == tenant_salt(secret, KEY_A) and re.fullmatch(r"[0-9a-f]{64}", a)
    assert tenant_salt(b"t" * 32, KEY_A) != a  # another secret, other salts
    # a client's salt partitions its tenant's cache further, and cannot reach another tenant's: B sending A's
    # derived salt (were it ever to learn it) or A's key as its salt gets neither A's salt nor anything of A's
    assert tenant_salt(secret, KEY_A, "x") not in (a, b, tenant_salt(secret, KEY_B, "x"))
    assert tenant_salt(secret, KEY_B, a) != a and tenant_salt(secret, KEY_B, KEY_A) != a
    assert len(tenant_salt(secret, KEY_A, "x" * protocol.MAX_CACHE_SALT_CHARS)) <= protocol.MAX_CACHE_SALT_CHARS
    with pytest.raises(ValueError, match="cache_salt_from_key needs API keys"):
        from orca_openai.app import create_app

        create_app(Settings(cache_salt_from_key=True))


@pytest.mark.parametrize("details", [False, True])
def test_cached_tokens_are_reported_only_with_prompt_tokens_details(details: bool) -> None:
    req = protocol.completion_request({"model": "m", "prompt": [1, 2, 3]})
    final = Chunk([7], None, True, num_input_tokens=3, num_output_tokens=1, num_cached_tokens=16)
    usage = _full_response(req, False, "cmpl-x", 0, [final], None, details)["usage"]
    assert ("prompt_tokens_details" in usage) is details
    assert usage["prompt_tokens"] == 3 and usage["completion_tokens"] == 1


@pytest.mark.parametrize("token", [2**31, 4294967301, 2**70, -1])
def test_a_token_id_outside_int32_is_a_400_naming_prompt(token: int) -> None:
    with pytest.raises(APIError, match=r"token ids must be integers in \[0, 2147483647\], got .* at prompt\[1\]") as e:
        protocol.completion_request({"model": "m", "prompt": [5, token]})
    assert (e.value.status, e.value.param) == (400, "prompt")
    assert protocol.completion_request({"model": "m", "prompt": [0, 2**31 - 1]}).prompt == [0, 2**31 - 1]


def test_the_cli_listens_on_loopback_and_refuses_an_open_port_beyond_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("ORCA_OPENAI_API_KEY", raising=False)
    args = cli.parse_args([])
    assert (args.host, args.api_key, args.graceful_shutdown_timeout) == ("127.0.0.1", [], 30.0)
    assert (args.max_concurrent_requests, args.stream_write_timeout) == (512, 30.0)
    for host in ("::1", "localhost", "127.0.0.2"):
        assert cli.parse_args(["--host", host]).host == host
    assert capsys.readouterr().err == ""
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.com"):
        with pytest.raises(SystemExit) as exit_:
            cli.parse_args(["--host", host])
        assert exit_.value.code == 2
        assert f"--host {host} listens beyond this host without an API key" in capsys.readouterr().err
    cli.parse_args(["--host", "0.0.0.0", "--allow-no-api-key"])
    assert "warning: listening on 0.0.0.0 without an API key" in capsys.readouterr().err
    assert cli.parse_args(["--host", "0.0.0.0", "--api-key", KEY_A, "--api-key", KEY_B]).api_key == [KEY_A, KEY_B]
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("ORCA_OPENAI_API_KEY", f"{KEY_A}, {KEY_B},")
    assert cli.parse_args(["--host", "0.0.0.0"]).api_key == [KEY_A, KEY_B]
    assert cli.parse_args(["--api-key", "sk-c"]).api_key == ["sk-c"]  # the command line's, not added to
    monkeypatch.delenv("ORCA_OPENAI_API_KEY")
    for argv, message in ((["--cache-salt-from-key"], "--cache-salt-from-key needs --api-key"),
                          (["--api-key", " "], "--api-key must not be empty"),
                          (["--stream-write-timeout", "0"], "must be > 0"),
                          (["--max-concurrent-requests", "0"], "must be > 0")):
        with pytest.raises(SystemExit) as exit_:
            cli.parse_args(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, argv


def test_the_admin_key_comes_from_the_environment_or_a_file_that_may_appear_later(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("ORCA_ADMIN_KEY", raising=False)
    path = tmp_path / "admin-key"
    settings = Settings(triton_admin_key_file=str(path))
    assert settings.admin_key() is None  # the launcher has not written it yet
    path.write_text("k-file\n")
    assert settings.admin_key() == "k-file"
    monkeypatch.setenv("ORCA_ADMIN_KEY", "k-env")
    assert settings.admin_key() == "k-env"
    assert Settings(triton_admin_key="k-given", triton_admin_key_file=str(path)).admin_key() == "k-given"
    assert "k-given" not in repr(Settings(triton_admin_key="k-given"))  # never in a log line of the settings


# -- against the real server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def secure(orca_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(base URL, log) of an orca-openai with two tenants' keys, salts derived from them, cached_tokens
    reported (to see what a tenant could learn) and a 1 s write timeout."""
    log = tmp_path_factory.mktemp("openai-security") / "orca-openai.log"
    with orca_openai(orca_server, log, KEY_A, "--api-key", KEY_B, "--cache-salt-from-key",
                     "--enable-prompt-tokens-details", "--stream-write-timeout", "1") as url:
        yield url, log


def _inferences(server: Any, model: str) -> float:
    """Triton's count of requests `model` answered (successes and failures), from its metrics."""
    tag = f'model="{model}"'
    return sum(float(line.rsplit(" ", 1)[1]) for line in requests.get(server.metrics_url, timeout=30).text.splitlines()
               if line.startswith(("nv_inference_request_success{", "nv_inference_request_failure{")) and tag in line)


def test_non_json_posts_never_reach_triton(secure: tuple[str, Path], orca_server: Any) -> None:
    url, _ = secure
    model = "orca_tiny"
    body = json.dumps({"model": model, "prompt": [5, 6, 7], "max_tokens": 1}).encode()
    auth = {"Authorization": f"Bearer {KEY_A}"}
    before = _inferences(orca_server, model)
    statuses = []
    for route in POST_ROUTES:  # 4 routes x 4 content types: 16 requests
        for ctype in NON_JSON_TYPES:
            headers = {**auth, **({"Content-Type": ctype} if ctype else {})}
            r = requests.post(f"{url}{route}", data=body, headers=headers, timeout=30)
            statuses.append((route, ctype, r.status_code, r.json()["error"]["code"]))
    assert all(s[2:] == (415, "unsupported_media_type") for s in statuses), statuses
    assert len(statuses) == 16
    assert _inferences(orca_server, model) == before
    # the control: the same body as JSON reaches Triton, and its metrics count it
    r = requests.post(f"{url}/v1/completions", data=body, headers={**auth, "Content-Type": "application/json"},
                      timeout=60)
    assert r.status_code == 200, r.text
    wait_for(lambda: _inferences(orca_server, model) == before + 1, "Triton counting the JSON request")


def test_another_tenant_learns_nothing_of_a_tenants_cached_prefix(secure: tuple[str, Path]) -> None:
    url, _ = secure

    def cached(key: str, salt: str | None = None) -> int:
        prompt = [(37 * i + 11) % 200 + 1 for i in range(40)]  # 2 full blocks and 8 tokens more; this test's own
        body = {"model": "orca_tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        r = requests.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(KEY_A) == 0
    assert cached(KEY_A) == 32  # the control: the owner's repeat finds its 2 full blocks
    assert cached(KEY_B) == 0  # the other tenant's identical prompt: nothing
    assert cached(KEY_B, "openai-completions") == 0  # nor with any salt it sends (test_openai's, say)
    assert cached(KEY_A, "own") == 0 and cached(KEY_A, "own") == 32  # a tenant's own salt: a partition of its own
    assert cached(KEY_B) == 32  # B's first request cached B's own blocks: its salt works for B too


def test_a_stream_whose_client_stops_reading_is_cancelled(secure: tuple[str, Path], orca_server: Any) -> None:
    """A raw socket sends a long streaming request and never reads: its small receive window and segment
    size keep the bytes in flight few, so the server's buffers fill within the stream and its sends wait;
    after --stream-write-timeout (1 s) the request is cancelled in Triton."""
    url, log = secure
    model = "orca_tiny"  # milliseconds a token; 2048 positions
    cancelled = 'orca_requests_finished_total{reason="cancelled"}'
    length = 'orca_requests_finished_total{reason="length"}'
    before = metrics(orca_server, model)
    sock = stalled_stream(url, KEY_A, {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": 2000, "stream": True,
                                       "ignore_eos": True})
    try:
        wait_for(lambda: metrics(orca_server, model).get(cancelled, 0) == before.get(cancelled, 0) + 1,
                 f"the stalled stream cancelled\n{log.read_text()[-2000:]}", timeout=120)
        wait_for(lambda: metrics(orca_server, model)["orca_running_requests"] == 0, "no request running")
        assert metrics(orca_server, model).get(length, 0) == before.get(length, 0)  # it never ran to max_tokens
        assert "the client read nothing for 1 s (--stream-write-timeout); its request is cancelled" in log.read_text()
    finally:
        sock.close()


def test_health_probes_and_unknown_models_make_no_index_calls_of_their_own(orca_server: Any) -> None:
    async def main() -> None:
        triton = Triton(orca_server.grpc_url, ttl=3600, admin_key=lambda: orca_server.admin_key)
        try:
            assert "orca_tiny" in await triton.models()
            assert triton.index_calls == 1
            floods = await asyncio.gather(*(triton.resolve(f"no_such_model_{i}") for i in range(50)),
                                          *(triton.ready() for _ in range(50)), return_exceptions=True)
            assert all(isinstance(r, APIError) and r.status == 404 for r in floods[:50]), floods[:3]
            assert all(r == (True, "ready") for r in floods[50:]), floods[50:53]
            assert triton.index_calls == 1
            # forced lookups (/v1/models, LoRA changes) queued together share one: the first, then one for all
            # that asked while it ran
            await asyncio.gather(*(triton.models(refresh=True) for _ in range(20)))
            assert triton.index_calls == 3
        finally:
            await triton.close()

        keyless = Triton(orca_server.grpc_url, admin_key=lambda: None)
        try:
            with pytest.raises(APIError, match="give orca-openai Triton's admin key") as err:
                await keyless.models()
            assert err.value.status == 503 and orca_server.admin_key not in err.value.message
            ok, why = await keyless.ready()
            assert not ok and "--triton-admin-key-file" in why
        finally:
            await keyless.close()

    asyncio.run(main())


def test_the_admin_key_file_may_appear_after_orca_openai_starts(
    orca_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastapi.testclient import TestClient

    from orca_openai.app import create_app

    monkeypatch.delenv("ORCA_ADMIN_KEY", raising=False)
    path = tmp_path / "admin-key"
    with TestClient(create_app(Settings(triton_url=orca_server.grpc_url, triton_admin_key_file=str(path)))) as app:
        health = app.get("/health")
        assert health.status_code == 503 and "admin key" in health.text
        path.write_text(orca_server.admin_key + "\n")  # the launcher writes it as Triton starts
        assert app.get("/health").status_code == 200  # a failed lookup is not cached: the next one reads the file
