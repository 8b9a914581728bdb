"""The container deployment, checked without a Docker engine (none runs here): the compose file parses,
and the paths, ports and image it names exist and agree with the README and the launcher's flags; the
Dockerfile builds on a Triton release past NVIDIA's August 2025 bulletin and runs as a non-root user."""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from orca_server.launcher import parse_args as launcher_parse_args

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ["python3", "-m", "orca_server.launcher"]
TRITONSERVER = Path("/opt/tritonserver/bin/tritonserver")  # NVIDIA's image's binary
UID = 1000  # NVIDIA's image's user triton-server
FIXED_RELEASE = (25, 7)  # CVE-2025-23310/23311/23319/23320/23334 are fixed from tritonserver 25.07


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def launcher_args(argv: list[str]) -> Any:
    assert argv[: len(LAUNCHER)] == LAUNCHER, f"Triton must be started by {' '.join(LAUNCHER)}, not {argv[:3]}"
    try:
        return launcher_parse_args(argv[len(LAUNCHER):])
    except SystemExit as exit_:
        raise AssertionError(f"the launcher refuses {argv[len(LAUNCHER):]}") from exit_


def dockerfile_cmd(text: str) -> list[str]:
    """The exec-form CMD of the Dockerfile (continuation lines joined)."""
    (cmd,) = re.findall(r"^CMD (\[.*?\])\s*$", text.replace("\\\n", " "), re.M | re.S)
    return json.loads(cmd)


def test_compose_runs_the_launcher_with_triton_on_the_loopback() -> None:
    svc = compose()["services"]["triton"]
    assert (ROOT / svc.get("build", ".") / "Dockerfile").is_file()
    args = launcher_args(svc["command"])
    assert args.tritonserver == TRITONSERVER and args.no_openai
    assert args.model_repository == Path("/models")
    assert ipaddress.ip_address(args.address).is_loopback, f"Triton's HTTP and gRPC listen on {args.address}"
    assert (args.http_port, args.grpc_port, args.metrics_port) == (8000, 8001, 8002)
    mounts = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
    assert (ROOT / mounts["/models"]).resolve() == (ROOT / "model_repository").resolve()
    assert (ROOT / "model_repository" / "orca_gpt" / "config.pbtxt").is_file()
    gpu = svc["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"] and gpu["driver"] == "nvidia"
    # the health check runs in the container, where Triton's loopback HTTP port is
    check = " ".join(svc["healthcheck"]["test"])
    assert f"http://127.0.0.1:{args.http_port}/v2/health/ready" in check
    assert mounts["/cache"] in compose()["volumes"]
    # the admin key file is on the volume the openai service reads
    assert args.admin_key_file is not None and str(args.admin_key_file.parent) in mounts


def test_compose_publishes_only_on_the_hosts_loopback_and_the_openai_api_needs_a_key() -> None:
    services = compose()["services"]
    triton, openai = services["triton"], services["openai"]
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond the host's loopback"
    # orca-openai shares the triton container's network namespace (as a pod's containers do), so its port is
    # published there; Triton's HTTP and gRPC are not published at all
    assert openai["network_mode"] == "service:triton" and "ports" not in openai
    args = launcher_args(triton["command"])
    published = {int(p.rsplit(":", 1)[1]) for p in triton["ports"]}
    assert published == {9000, args.metrics_port}, published
    assert args.metrics_address == "0.0.0.0", "a published metrics port must listen on the container's interfaces"
    assert openai["depends_on"]["triton"]["condition"] == "service_healthy"  # the admin key file is written
    # the API key comes from the environment: compose refuses to start without it
    key = openai["environment"]["ORCA_OPENAI_API_KEY"]
    assert re.fullmatch(r"\$\{ORCA_OPENAI_API_KEY:\?[^}]+\}", key), key
    from orca_openai.cli import parse_args  # the server's own parser accepts the command line (with a key)

    with mock.patch.dict("os.environ", {"ORCA_OPENAI_API_KEY": "from-the-environment"}):
        served = parse_args(openai["command"][1:])
    assert openai["command"][0] == "orca-openai" and served.port == 9000
    assert served.triton_url == f"127.0.0.1:{args.grpc_port}"
    assert Path(served.triton_admin_key_file) == args.admin_key_file
    assert served.graceful_shutdown_timeout >= 30  # Triton's --exit-timeout-secs
    assert openai["image"] == triton["image"]


@pytest.mark.parametrize("service", ["triton", "openai"])
def test_compose_services_run_unprivileged(service: str) -> None:
    spec = compose()
    svc = spec["services"][service]
    assert svc["user"] == f"{UID}:{UID}"
    assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in svc["security_opt"]
    assert svc["deploy"]["resources"]["limits"]["memory"]
    assert any(t.split(":")[0] == "/tmp" for t in svc["tmpfs"]), "a read-only root needs a writable /tmp (HOME)"
    # Triton's exit timeout is 30 s; docker's default of 10 s would kill streams it is finishing
    seconds = re.fullmatch(r"(\d+)s", svc["stop_grace_period"])
    assert seconds and int(seconds.group(1)) > 30
    # the admin key file lives on a tmpfs volume of the image's user, read-only to orca-openai
    (run,) = [v for v in svc["volumes"] if v.split(":")[1] == "/run/orca"]
    volume = spec["volumes"][run.split(":")[0]]
    assert volume["driver_opts"]["type"] == "tmpfs" and f"uid={UID}" in volume["driver_opts"]["o"]
    assert run.endswith(":ro") == (service == "openai")


def test_dockerfile_uses_a_triton_release_past_the_bulletin_and_installs_what_it_copies() -> None:
    text = (ROOT / "Dockerfile").read_text()
    (release,) = re.findall(r"^FROM nvcr\.io/nvidia/tritonserver:(\d\d)\.(\d\d)-py3$", text, re.M)
    assert tuple(map(int, release)) >= FIXED_RELEASE, f"tritonserver {'.'.join(release)} predates 25.07"
    for src in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / src).exists(), src
    reqs = (ROOT / "requirements-container.txt").read_text()
    for package in ("torch==", "transformers==", "gguf==", "safetensors==", "accelerate==", "fastapi==",
                    "uvicorn==", "tritonclient[grpc]=="):
        assert package in reqs
    assert f"tritonserver:{'.'.join(release)}-py3" in reqs, "requirements-container.txt names another image"


def test_dockerfile_runs_the_launcher_as_a_non_root_user() -> None:
    text = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER (\S+)$", text, re.M)
    assert users, "the image runs as root"
    user, _, group = users[-1].partition(":")
    assert user not in ("root", "0") and group not in ("root", "0"), users[-1]
    assert user == str(UID), f"USER {users[-1]}: the manifests' runAsUser is {UID}"
    # what the server writes with a read-only root filesystem belongs to that user
    (chown,) = re.findall(r"chown (\S+) ([^&\n]+)", text)
    assert chown[0] == f"{UID}:{UID}" and {"/cache", "/run/orca"} <= set(chown[1].split())
    args = launcher_args(dockerfile_cmd(text))
    assert args.tritonserver == TRITONSERVER and args.no_openai and args.model_repository == Path("/models")
    assert ipaddress.ip_address(args.address).is_loopback
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in shlex.split(line)}
    assert exposed == {9000, args.metrics_port}, f"EXPOSE {sorted(exposed)}: Triton's HTTP and gRPC are loopback"


def test_readme_names_the_same_ports_and_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^make serve$", readme, re.M) and re.search(r"^make test$", readme, re.M)
    for port in ("8000", "8001", "8002"):
        assert f":{port}" in readme or f" {port}" in readme
    assert "docker compose up" in readme
