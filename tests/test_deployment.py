"""The container deployment, checked without a Docker engine (none runs here): the compose file parses,
and the paths, ports and image it names exist and agree with the README and the launcher's defaults."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_file_is_consistent() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    svc = compose["services"]["triton"]
    assert (ROOT / svc.get("build", ".") / "Dockerfile").is_file()
    assert sorted(svc["ports"]) == ["8000:8000", "8001:8001", "8002:8002"]
    cmd = " ".join(svc["command"])
    for flag in ("--model-repository=/models", "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002"):
        assert flag in cmd
    mounts = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
    assert (ROOT / mounts["/models"]).resolve() == (ROOT / "model_repository").resolve()
    assert (ROOT / "model_repository" / "orca_gpt" / "config.pbtxt").is_file()
    gpu = svc["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"] and gpu["driver"] == "nvidia"
    assert "/v2/health/ready" in " ".join(svc["healthcheck"]["test"])
    assert mounts["/cache"] in compose["volumes"]
    openai = compose["services"]["openai"]  # orca-openai, same image, on Triton's gRPC port
    assert openai["image"] == svc["image"] and openai["ports"] == ["9000:9000"]
    assert "--triton-url=triton:8001" in openai["command"] and "--port=9000" in openai["command"]
    from orca_openai.cli import parse_args  # the server's own parser accepts the command line

    parse_args(openai["command"][1:])


def test_dockerfile_uses_triton_2_51_and_installs_what_it_copies() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM nvcr\.io/nvidia/tritonserver:24\.10-py3$", text, re.M)  # Triton 2.51
    for src in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / src).exists(), src
    reqs = (ROOT / "requirements-container.txt").read_text()
    for package in ("torch==", "transformers==", "gguf==", "safetensors==", "accelerate=="):
        assert package in reqs


def test_readme_names_the_same_ports_and_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^make serve$", readme, re.M) and re.search(r"^make test$", readme, re.M)
    for port in ("8000", "8001", "8002"):
        assert f":{port}" in readme or f" {port}" in readme
    assert "docker compose up" in readme
