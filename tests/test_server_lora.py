"""LoRA adapters end to end: the session's tritonserver (tests/conftest.py) serves orca_tiny_lora (tests/_server.py:
enable_lora, two slots; lora_a from lora_modules, lora_b from vllm_backend's multi_lora.json by a relative path);
requests through tritonclient (lora_name in sampling_parameters) and through orca-openai (the real openai client:
an adapter is a model) get the tokens of the in-process engine serving the same adapters, which the engine's own
tests hold to PEFT's merged model; adapters load and unload at run time (vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter, in-band through the model), from inside the model's lora_root only (any other path gets
one answer, whatever the reason), and bad ones are refused naming the adapter and the reason."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from _server import LORA_MODEL, orca_openai
from checkpoints import make_llama, make_lora_adapter
from orca_client import OrcaClient, OrcaError
from test_server_e2e import generate_concurrently, metrics

from orca import LLM, SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
API_KEY = "lora-test-key"
PROMPTS = [[20 + i, 40 + i, 60 + i, 7, 9] for i in range(3)]
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


def adapter_paths(server: Any) -> dict[str, Path]:
    root = Path(server.tiny_checkpoint).parent
    return {"lora_a": root / "adapters" / "lora_a", "lora_b": root / "model_repository" / LORA_MODEL / "1" / "lora_b"}


def lora_root(server: Any) -> Path:
    """The model's lora_root (tests/_server.py): the directory lora_a is in; run-time loads read only there."""
    return adapter_paths(server)["lora_a"].parent


@pytest.fixture(scope="module")
def lora_llm(orca_server: Any) -> LLM:
    """The in-process engine over the same checkpoint and adapters."""
    paths = adapter_paths(orca_server)
    return LLM(str(orca_server.tiny_checkpoint), enable_lora=True, max_loras=2,
               lora_modules=",".join(f"{name}={path}" for name, path in paths.items()))


def expected(llm: LLM, prompt: list[int], lora: str | None) -> list[int]:
    return llm.generate([prompt], SamplingParams(**GREEDY, lora_name=lora))[0].token_ids


@pytest.fixture(scope="module")
def api(orca_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """orca-openai with run-time adapter loading on."""
    log = tmp_path_factory.mktemp("openai-lora") / "orca-openai.log"
    with orca_openai(orca_server, log, API_KEY, "--allow-runtime-lora-updating") as url:
        yield url


@pytest.fixture(scope="module")
def client(api: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def post(api: str, path: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(f"{api}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300)


# -- Triton: lora_name in sampling_parameters ---------------------------------------------------------------
def test_concurrent_requests_of_two_adapters_and_the_base_get_the_engines_tokens(orca_server: Any,
                                                                                lora_llm: LLM) -> None:
    before = metrics(orca_server, LORA_MODEL)
    loras = [None, "lora_a", "lora_b"] * 2
    reqs = [{"input_ids": PROMPTS[i % 3], **GREEDY, **({"lora_name": lora} if lora else {})}
            for i, lora in enumerate(loras)]
    results = generate_concurrently(orca_server, LORA_MODEL, reqs)
    got = [[t for c in chunks for t in c.output_ids] for chunks in results]
    want = [expected(lora_llm, PROMPTS[i % 3], lora) for i, lora in enumerate(loras)]
    assert got == want
    assert len({tuple(expected(lora_llm, PROMPTS[0], lora)) for lora in (None, "lora_a", "lora_b")}) == 3
    after = metrics(orca_server, LORA_MODEL)
    for lora in ("lora_a", "lora_b"):
        key = f'orca_lora_requests_total{{adapter="{lora}"}}'
        assert after[key] - before.get(key, 0) == 2
    assert 1 <= after["orca_lora_adapters_resident"] <= 2 and after["orca_lora_loads_total"] >= 2
    assert after["orca_lora_load_seconds_count"] >= 2


def test_an_unknown_lora_name_fails_that_request_only(orca_server: Any, lora_llm: LLM) -> None:
    ok_before = generate_concurrently(orca_server, LORA_MODEL, [{"input_ids": PROMPTS[0], **GREEDY,
                                                                 "lora_name": "lora_a"}])
    with pytest.raises(OrcaError, match=r"lora_name 'nope' is not an adapter this model serves \(served: lora_a, "
                                        r"lora_b\)"):
        list(OrcaClient(orca_server.grpc_url, LORA_MODEL).generate(input_ids=PROMPTS[0], lora_name="nope", **GREEDY))
    with pytest.raises(OrcaError, match="serves no LoRA adapters"):  # a model without enable_lora
        list(OrcaClient(orca_server.grpc_url, "orca_tiny").generate(input_ids=PROMPTS[0], lora_name="lora_a",
                                                                     **GREEDY))
    ok_after = generate_concurrently(orca_server, LORA_MODEL, [{"input_ids": PROMPTS[0], **GREEDY,
                                                                "lora_name": "lora_a"}])
    assert [c.output_ids for c in ok_after[0]] == [c.output_ids for c in ok_before[0]]


# -- orca-openai: adapters as models; loading and unloading at run time ------------------------------------
def test_models_list_the_adapters_and_an_adapter_is_a_model(orca_server: Any, client: openai.OpenAI,
                                                           lora_llm: LLM) -> None:
    cards = {m.id: m for m in client.models.list()}
    paths = adapter_paths(orca_server)
    for lora in ("lora_a", "lora_b"):
        card = cards[lora].model_dump()
        assert card["parent"] == LORA_MODEL and Path(card["root"]) == paths[lora].resolve()
    assert cards[LORA_MODEL].model_dump()["parent"] is None
    assert client.models.retrieve("lora_b").model_dump()["parent"] == LORA_MODEL
    for lora in ("lora_a", "lora_b", LORA_MODEL):
        out = client.completions.create(model=lora, prompt=PROMPTS[1], max_tokens=12, temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True})
        assert out.model == lora and out.usage.completion_tokens == 12
        adapter = {} if lora == LORA_MODEL else {"lora_name": lora}
        direct = list(OrcaClient(orca_server.grpc_url, LORA_MODEL).generate(
            input_ids=PROMPTS[1], logprobs=0, return_logprobs=True, **GREEDY, **adapter))
        direct_ids = [t for c in direct for t in c.output_ids]
        assert direct_ids == expected(lora_llm, PROMPTS[1], None if lora == LORA_MODEL else lora)
        direct_logprobs = [entry[t]["logprob"] for c in direct if c.logprobs
                           for entry, t in zip(c.logprobs, c.output_ids)]
        assert len(direct_logprobs) == 12
        assert out.choices[0].logprobs.token_logprobs == pytest.approx(direct_logprobs, abs=1e-4)


def test_adapters_load_and_unload_at_run_time_and_bad_ones_are_refused(orca_server: Any, api: str,
                                                                       client: openai.OpenAI,
                                                                       tmp_path: Path) -> None:
    tiny, root = Path(orca_server.tiny_checkpoint), lora_root(orca_server)
    lora_c = make_lora_adapter(tiny, root / "lora_c", seed=3)
    reference = LLM(str(tiny), enable_lora=True, lora_modules=f"lora_c={lora_c}")
    r = post(api, "/v1/load_lora_adapter", {"lora_name": "lora_c", "lora_path": str(lora_c)})
    assert r.status_code == 200 and "lora_c" in r.text, r.text
    assert "lora_c" in {m.id for m in client.models.list()}
    # three adapters in two slots, concurrently: lora_c's tokens are the reference's
    results = generate_concurrently(orca_server, LORA_MODEL, [
        {"input_ids": PROMPTS[2], **GREEDY, "lora_name": lora} for lora in ("lora_c", "lora_a", "lora_b", "lora_c")
    ])
    want_c = expected(reference, PROMPTS[2], "lora_c")
    assert [t for c in results[0] for t in c.output_ids] == want_c == [t for c in results[3] for t in c.output_ids]
    out = client.completions.create(model="lora_c", prompt=PROMPTS[2], max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 12
    # loading it again, or under a model's name: 400
    again = post(api, "/v1/load_lora_adapter", {"lora_name": "lora_c", "lora_path": str(lora_c)})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    # bad adapters under lora_root: 400 naming the adapter and the reason; the model goes on serving
    llama_adapter = make_lora_adapter(make_llama(tmp_path / "llama"), root / "llama_lora", seed=4)
    big = make_lora_adapter(tiny, root / "big", seed=5, rank=32)
    corrupt = root / "corrupt"
    corrupt.mkdir(exist_ok=True)
    (corrupt / "adapter_config.json").write_text((lora_c / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    for name, path, reason in [("other_base", llama_adapter, "which orca cannot adapt"),
                               ("too_big", big, "above max_lora_rank"), ("corrupt", corrupt, "cannot be read")]:
        r = post(api, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 400, (name, r.text)
        message = r.json()["error"]["message"]
        assert f"'{name}'" in message and reason in message, message
    # outside lora_root (a good adapter beside it), out of it by `..`, missing, not an adapter: one answer
    outside = make_lora_adapter(tiny, root.parent / "outside_root", seed=3)
    (root / "empty").mkdir(exist_ok=True)
    answers = set()
    for name, path in [("outside", str(outside)), ("escape", f"{root}/../outside_root"),
                       ("missing", str(root / "nowhere")), ("not_one", str(root / "empty"))]:
        r = post(api, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        assert r.status_code == 400, (name, r.text)
        message = r.json()["error"]["message"]
        assert f"LoRA adapter '{name}': lora_path '{path}' is not an adapter directory under lora_root" in message
        answers.add(message.replace(path, "PATH").replace(name, "NAME"))
    assert len(answers) == 1, answers
    refused = {"other_base", "too_big", "corrupt", "outside", "escape", "missing", "not_one"}
    assert not refused & {m.id for m in client.models.list()}
    # unloading: gone from the list; its requests are refused; unloading it again is a 404
    r = post(api, "/v1/unload_lora_adapter", {"lora_name": "lora_c"})
    assert r.status_code == 200, r.text
    assert "lora_c" not in {m.id for m in client.models.list()}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="lora_c", prompt=PROMPTS[2], max_tokens=2)
    with pytest.raises(OrcaError, match="lora_name 'lora_c' is not an adapter"):
        list(OrcaClient(orca_server.grpc_url, LORA_MODEL).generate(input_ids=PROMPTS[0], lora_name="lora_c",
                                                                     **GREEDY))
    gone = post(api, "/v1/unload_lora_adapter", {"lora_name": "lora_c"})
    assert gone.status_code == 404 and "lora_c" in gone.json()["error"]["message"]
    bad = post(api, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert bad.status_code == 400 and "lora_path" in bad.json()["error"]["message"]
    # the others still serve
    ok = client.completions.create(model="lora_a", prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_a_multi_lora_json_without_enable_lora_is_refused_naming_the_fix(tmp_path: Path) -> None:
    from orca import EngineConfig
    from orca_triton.lora import read_multi_lora

    (tmp_path / "multi_lora.json").write_text(json.dumps({"a": "adapters/a"}))
    with pytest.raises(ValueError, match='enable_lora is off: set the parameter enable_lora to "true"'):
        read_multi_lora(tmp_path, EngineConfig())
    assert read_multi_lora(tmp_path, EngineConfig(enable_lora=True)) == {"a": str((tmp_path / "adapters/a").resolve())}
    with pytest.raises(ValueError, match="both name adapter"):
        read_multi_lora(tmp_path, EngineConfig(enable_lora=True, lora_modules="a=/x"))
    (tmp_path / "multi_lora.json").write_text("[1]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        read_multi_lora(tmp_path, EngineConfig(enable_lora=True))


def test_lora_updating_is_off_unless_asked(orca_server: Any) -> None:
    from fastapi.testclient import TestClient

    from orca_openai.app import Settings, create_app

    settings = Settings(triton_url=orca_server.grpc_url, triton_admin_key=orca_server.admin_key)
    with TestClient(create_app(settings)) as app:
        r = app.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
        assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]


def test_run_time_updating_needs_enable_lora_and_its_own_parameter() -> None:
    from orca import EngineConfig
    from orca_triton.lora import ControlRequest, check_control

    load = ControlRequest("load", "x", "/x")
    check_control(ControlRequest("list"), EngineConfig(), "m")  # listing is always answered
    with pytest.raises(ValueError, match='m serves no LoRA adapters: set its parameter enable_lora to "true"'):
        check_control(load, EngineConfig(), "m")
    with pytest.raises(ValueError, match='set its parameter allow_runtime_lora_updating to "true" to allow it'):
        check_control(ControlRequest("unload", "x"), EngineConfig(enable_lora=True), "m")
    with pytest.raises(ValueError, match="without lora_root: set its parameter lora_root"):
        check_control(load, EngineConfig(enable_lora=True, allow_runtime_lora_updating=True), "m")
    check_control(load, EngineConfig(enable_lora=True, allow_runtime_lora_updating=True, lora_root="/srv/a"), "m")
    with pytest.raises(ValueError, match="allow_runtime_lora_updating needs enable_lora true"):
        EngineConfig(allow_runtime_lora_updating=True)
