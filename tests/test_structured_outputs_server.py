"""Structured outputs through the real tritonserver: vllm_backend's spelling (`structured_outputs` as JSON
text inside sampling_parameters) over gRPC with tritonclient, the HTTP generate endpoint's own field, clear
INVALID_ARG errors for what does not compile (the server unharmed), and the metrics."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import jsonschema
import numpy as np
import pytest
import requests
from test_server_e2e import metrics
from test_server_vllm_compat import generate, grpc_stream
from tritonclient.utils import InferenceServerException

MODEL = "orca_gpt"  # SmolLM2 with its tokenizer
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
          "required": ["city", "population"]}


def _tensors(prompt: str, sampling: dict[str, Any]) -> dict[str, np.ndarray]:
    return {"text_input": np.array([prompt.encode()], dtype=object),
            "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=object),
            "exclude_input_in_output": np.array([True])}


def test_vllm_backend_structured_outputs_over_grpc(orca_server: Any) -> None:
    """vllm_backend's clients send structured_outputs as JSON text (vLLM's StructuredOutputsParams)."""
    before = metrics(orca_server, MODEL)
    sampling = {"max_tokens": 48, "temperature": 0, "structured_outputs": json.dumps({"json": SCHEMA})}
    out = grpc_stream(orca_server, MODEL, _tensors("The largest city of France, as JSON:", sampling))
    text = out[-1].as_numpy("text_output")[0].decode()
    jsonschema.validate(json.loads(text), SCHEMA)
    after = metrics(orca_server, MODEL)
    assert after["orca_structured_output_requests_total"] > before.get("orca_structured_output_requests_total", 0)
    assert after["orca_grammar_compile_seconds_count"] >= 1


def test_generate_endpoint_choice_and_regex_with_unconstrained_neighbours(orca_server: Any) -> None:
    """Three requests at once over HTTP generate: a choice (the endpoint's own structured_outputs field,
    JSON text), a regex (guided_decoding, the older name, in sampling_parameters) and an unconstrained one."""
    results: dict[str, Any] = {}

    def run(name: str, body: dict[str, Any]) -> None:
        results[name] = generate(orca_server, MODEL, body)

    bodies = {
        "choice": {"text_input": "Is the sky blue? Answer:", "max_tokens": 8, "temperature": 0,
                   "exclude_input_in_output": True, "structured_outputs": json.dumps({"choice": ["yes", "no"]})},
        "regex": {"text_input": "A phone number:", "exclude_input_in_output": True, "sampling_parameters":
                  json.dumps({"max_tokens": 16, "temperature": 0.8, "seed": 1,
                              "guided_decoding": {"regex": r"\d{3}-\d{4}"}})},
        "plain": {"text_input": "Hello", "max_tokens": 6, "temperature": 0, "exclude_input_in_output": True},
    }
    threads = [threading.Thread(target=run, args=item) for item in bodies.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results["choice"][0] == 200 and results["choice"][1]["text_output"] in ("yes", "no")
    assert results["regex"][0] == 200
    assert re.fullmatch(r"\d{3}-\d{4}", results["regex"][1]["text_output"])
    assert results["plain"][0] == 200


@pytest.mark.parametrize(("so", "message"), [
    ({"json": {"type": "objet"}}, "structured_outputs.json is not a valid JSON Schema"),
    ({"regex": "(a"}, "structured_outputs.regex does not compile"),
    ({"grammar": "root ::= "}, "structured_outputs.grammar is not a valid EBNF grammar"),
    ({"json": {"not": {}}}, "'not'"),
    ({"choice": "yes"}, "structured_outputs.choice must be a non-empty list"),
])
def test_what_does_not_compile_is_invalid_arg_and_the_server_goes_on(orca_server: Any, so: dict[str, Any],
                                                                      message: str) -> None:
    """Over gRPC (a stream's error carries the message, not the status) and HTTP (INVALID_ARG is 400)."""
    with pytest.raises(InferenceServerException, match=message):
        grpc_stream(orca_server, MODEL, _tensors("x", {"max_tokens": 4, "structured_outputs": so}))
    status, body = generate(orca_server, MODEL, {"text_input": "x", "sampling_parameters": json.dumps(
        {"max_tokens": 4, "structured_outputs": so})})
    assert status == 400 and re.search(message, body["error"]), body
    r = requests.post(f"{orca_server.http_url}/v2/models/{MODEL}/generate",
                      json={"text_input": "Hi", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200
