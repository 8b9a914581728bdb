"""The Kubernetes manifests of deploy/, checked without a cluster and without the network.

Every kustomization under deploy/ is rendered here in Python (the part of kustomize it uses: resources, files
or kustomization directories, strategic-merge patches, configMapGenerator without name hashes, images; anything
else fails the test) and, where kubectl is installed, compared with `kubectl kustomize`. Every rendered
resource, and every other manifest under deploy/, is validated against the real schemas vendored in
tests/schemas/ (README.md there: Kubernetes 1.36's OpenAPI definitions, HorizontalPodAutoscaler v2 included,
the LeaderWorkerSet v0.10.0 and prometheus-operator v0.93.0 ServiceMonitor CRDs), with unknown fields refused
as `kubectl apply`'s strict field validation refuses them. Then what the schemas cannot see: Triton is started
by the launcher (its flags read by the launcher's own parser) with HTTP and gRPC on the pod's loopback, the one
port of the public Service is orca-openai's, the probes hit Triton's health endpoints from inside its
container, orca-openai talks to Triton's gRPC port with the admin key file the pod makes first and an API key
from a required Secret, every pod and container runs unprivileged (non-root uid, no privilege escalation,
read-only root filesystem, no capabilities, RuntimeDefault seccomp, no service-account token) with memory
limits and size-limited emptyDirs, a NetworkPolicy admits only the OpenAI port, metrics from the monitoring
namespace and (multi-node) the group's own pods, the pods drain before they stop, tensor_parallel_size x
pipeline_parallel_size is the number of GPUs the pods hold (none for device cpu), the followers reach the
driver's control port with the leader's secret, the ServiceMonitor scrapes Triton's metrics port through a
Service of its own, the HPA scales the Deployment on metrics that prometheus-adapter's shipped rules make of
the engine's own gauges, and the config.pbtxt in each ConfigMap is the shipped orca_gpt model with engine
parameters that orca.EngineConfig accepts.

The overlays are the kustomizations no other one lists (cpu/, gpu/, single-host/, multi-node/); base/ and
monitoring/ are parts of them, rendered and validated but not deployed on their own.
"""

from __future__ import annotations

import copy
import functools
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any
from unittest import mock

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
SHIPPED_CONFIG = ROOT / "model_repository" / "orca_gpt" / "config.pbtxt"
METRICS_PY = ROOT / "orca_triton" / "metrics.py"  # orca_gpt's metrics
ADAPTER_CONFIG = DEPLOY / "kubernetes" / "prometheus-adapter" / "adapter-config.yaml"
KUSTOMIZATIONS = sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))
MODEL = "orca_gpt"
LAUNCHER = ["python3", "-m", "orca_server.launcher"]  # what starts Triton, in the manifests as in `make serve`
TRITONSERVER = "/opt/tritonserver/bin/tritonserver"  # NVIDIA's image's binary, with its own backends
TRITON_EXIT_TIMEOUT = 30  # tritonserver --exit-timeout-secs's default
UID = 1000  # NVIDIA's image's user triton-server (Dockerfile: USER 1000:1000)
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"  # the LWS controller puts it on every pod of a LeaderWorkerSet
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}  # the namespace Prometheus scrapes from
DNS_LABEL = r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?"  # RFC 1035: Service names
DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"  # RFC 1123: the other names
DISTRIBUTED_PARAMETERS = (
    "tensor_parallel_size", "pipeline_parallel_size", "n_workers", "worker_timeout", "control_address", "local_workers",
    "distributed_backend",
)


# -- kustomize, the part deploy/ uses ------------------------------------------------------------------------------
_KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches", "configMapGenerator", "generatorOptions", "images"}
# Strategic merge: lists of these fields merge element by element on this key (their patchMergeKey in the
# Kubernetes API); other lists are replaced.
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
               "volumeMounts": "mountPath"}


def _inside(base: Path, relative: str) -> Path:
    """kustomize's default load restrictor: a kustomization reads files under its own directory only."""
    path = (base / relative).resolve()
    assert path.is_relative_to(base.resolve()), f"{relative} is outside {base} (kustomize refuses it)"
    assert path.is_file(), f"{base / relative} does not exist"
    return path


def _containers(node: Any) -> Iterator[dict[str, Any]]:
    """Every container of a resource, wherever its pod templates are (kustomize's images transformer looks
    for containers/initContainers lists anywhere, custom resources included)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _containers(item)


def merge_patch(base: Any, patch: Any, field: str = "") -> Any:
    """A strategic merge patch (kustomize's order: a merged list holds the patch's elements first, merged with the
    base's of the same key, then the base's others)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        assert not [k for k in patch if k.startswith("$")], f"render() does not implement {list(patch)}"
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merge_patch(out[key], value, key) if key in out else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in _MERGE_KEYS:
        key = _MERGE_KEYS[field]
        originals = {item[key]: item for item in base}
        merged = [merge_patch(originals[p[key]], p) if p[key] in originals else copy.deepcopy(p) for p in patch]
        return merged + [item for item in base if item[key] not in {p[key] for p in patch}]
    return copy.deepcopy(patch)


def render(kdir: Path) -> list[dict[str, Any]]:
    """What `kubectl kustomize kdir` prints, for the features deploy/ uses (refusing the others)."""
    k = yaml.safe_load((kdir / "kustomization.yaml").read_text())
    assert (k.get("apiVersion"), k.get("kind")) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
    assert not set(k) - _KUSTOMIZATION_KEYS, f"render() does not implement {sorted(set(k) - _KUSTOMIZATION_KEYS)}"
    docs: list[dict[str, Any]] = []
    for resource in k.get("resources", []):
        if (kdir / resource).is_dir():  # another kustomization (a base): may be outside this one's directory
            docs += copy.deepcopy(render(kdir / resource))
        else:
            docs += [d for d in yaml.safe_load_all(_inside(kdir, resource).read_text()) if d is not None]
    if k.get("configMapGenerator"):
        # kustomize would otherwise append a content hash to the names (not replicated here)
        assert k.get("generatorOptions") == {"disableNameSuffixHash": True}
    for gen in k.get("configMapGenerator", []):
        assert set(gen) <= {"name", "files"}, f"render() does not implement {sorted(set(gen) - {'name', 'files'})}"
        data = {}
        for entry in gen["files"]:
            key, _, source = entry.rpartition("=")
            data[key or Path(source).name] = _inside(kdir, source).read_text()
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    for entry in k.get("patches", []):
        assert set(entry) == {"path"}, f"render() implements patches by path only, not {sorted(entry)}"
        patch = yaml.safe_load(_inside(kdir, entry["path"]).read_text())
        assert isinstance(patch, dict), f"{entry['path']}: render() implements strategic merge patches only"
        target = (patch["apiVersion"], patch["kind"], patch["metadata"]["name"])
        hits = [i for i, d in enumerate(docs) if (d["apiVersion"], d["kind"], d["metadata"]["name"]) == target]
        assert len(hits) == 1, f"{entry['path']}: patches {len(hits)} resources"
        docs[hits[0]] = merge_patch(docs[hits[0]], patch)
    for image in k.get("images", []):
        assert set(image) <= {"name", "newName", "newTag"}
        for doc in docs:
            for container in _containers(doc):
                name, tag = re.fullmatch(r"([^:@]+(?::\d+/[^:@]+)?)(?::([^:@/]+))?", container["image"]).groups()
                if name == image["name"]:
                    tag = image.get("newTag", tag)
                    container["image"] = image.get("newName", name) + (f":{tag}" if tag else "")
    return docs


@functools.cache
def rendered(kdir: Path) -> tuple[dict[str, Any], ...]:
    return tuple(render(kdir))


def _listed_dirs(kdir: Path) -> list[Path]:
    """The kustomization directories kdir lists as resources (read without rendering: see _dirs_with)."""
    try:
        resources = yaml.safe_load((kdir / "kustomization.yaml").read_text()).get("resources", [])
    except Exception:  # a broken kustomization fails its tests, not pytest's collection
        return []
    return [(kdir / r).resolve() for r in resources if (kdir / r).is_dir()]


# The kustomizations one applies: those no other kustomization lists (base/ and monitoring/ are parts of them).
OVERLAYS = [k for k in KUSTOMIZATIONS if k.resolve() not in {d for o in KUSTOMIZATIONS for d in _listed_dirs(o)}]


def _resource_files() -> set[Path]:
    """The files some kustomization lists as resources or patches."""
    files = set()
    for kdir in KUSTOMIZATIONS:
        k = yaml.safe_load((kdir / "kustomization.yaml").read_text())
        files |= {(kdir / r).resolve() for r in k.get("resources", [])}
        files |= {(kdir / p["path"]).resolve() for p in k.get("patches", [])}
    return files


def standalone_manifests() -> list[Path]:
    """YAML files under deploy/ that are neither kustomizations nor a kustomization's resources or patches."""
    listed = _resource_files()
    return sorted(
        p for p in DEPLOY.rglob("*.y*ml") if p.name != "kustomization.yaml" and p.resolve() not in listed
    )


def every_resource() -> list[tuple[str, dict[str, Any]]]:
    out = [(f"{kdir.relative_to(ROOT)} ({d['kind']})", d) for kdir in KUSTOMIZATIONS for d in rendered(kdir)]
    for path in standalone_manifests():
        out += [(str(path.relative_to(ROOT)), d) for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return out


# -- schemas -------------------------------------------------------------------------------------------------------
def _strict(schema: Any) -> Any:
    """Unknown fields refused: every object schema that lists its properties gets additionalProperties false
    (as `kubectl apply`'s default --validate=strict does on the server), unless it keeps unknown fields."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "definitions", "patternProperties"):
            out[key] = {name: _strict(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not", "anyOf", "allOf", "oneOf"):
            out[key] = _strict(value)
        else:
            out[key] = value
    if "properties" in out and "additionalProperties" not in out:
        if not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


@functools.cache
def validators() -> dict[tuple[str, str], jsonschema.Draft7Validator]:
    """(apiVersion, kind) -> a validator, for every kind the vendored schemas define."""
    out: dict[tuple[str, str], jsonschema.Draft7Validator] = {}
    definitions = json.loads((SCHEMAS / "kubernetes-1.36-subset.json").read_text())["definitions"]
    # The OpenAPI v2 spec types these two "string" with a format; the API server also takes numbers for them
    # (ports, "nvidia.com/gpu: 4"), and so do kubectl's and kubeconform's validations.
    apimachinery = "io.k8s.apimachinery.pkg"
    definitions[f"{apimachinery}.util.intstr.IntOrString"] = {"anyOf": [{"type": "string"}, {"type": "integer"}]}
    definitions[f"{apimachinery}.api.resource.Quantity"] = {"anyOf": [{"type": "string"}, {"type": "number"}]}
    definitions = {name: _strict(definition) for name, definition in definitions.items()}
    for name, definition in definitions.items():
        for gvk in definition.get("x-kubernetes-group-version-kind", []):
            api_version = f"{gvk['group']}/{gvk['version']}" if gvk["group"] else gvk["version"]
            schema = {"$ref": f"#/definitions/{name}", "definitions": definitions}
            out[(api_version, gvk["kind"])] = jsonschema.Draft7Validator(schema)
    for crd_file in ("leaderworkerset-v0.10.0.json", "servicemonitor-v0.93.0.json"):
        crd = json.loads((SCHEMAS / crd_file).read_text())
        schema = _strict(crd["openAPIV3Schema"])
        out[(f"{crd['group']}/{crd['version']}", crd["kind"])] = jsonschema.Draft7Validator(schema)
    return out


def schema_errors(doc: dict[str, Any]) -> list[str]:
    validator = validators().get((doc.get("apiVersion"), doc.get("kind")))
    if validator is None:
        return [f"no vendored schema for apiVersion {doc.get('apiVersion')!r} kind {doc.get('kind')!r}"]
    return [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in validator.iter_errors(doc)]


# -- reading the manifests -----------------------------------------------------------------------------------------
def by_kind(docs: tuple[dict[str, Any], ...], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def pod_templates(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """role -> pod template: "leader" (the pod that runs Triton) and, for a LeaderWorkerSet, "worker"."""
    if doc["kind"] == "Deployment":
        return {"leader": doc["spec"]["template"]}
    if doc["kind"] == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        return {"leader": lwt.get("leaderTemplate", lwt["workerTemplate"]), "worker": lwt["workerTemplate"]}
    raise AssertionError(f"no pod template in a {doc['kind']}")


def workload(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] in ("Deployment", "LeaderWorkerSet")]
    return doc


def only_container(template: dict[str, Any]) -> dict[str, Any]:
    (container,) = template["spec"]["containers"]
    return container


def argv(container: dict[str, Any]) -> list[str]:
    return container.get("command", []) + container.get("args", [])


def started(template: dict[str, Any], program: str | list[str]) -> list[dict[str, Any]]:
    """The containers of a pod template that run program (a command, or the first words of one)."""
    words = [program] if isinstance(program, str) else program
    return [c for c in template["spec"]["containers"] if argv(c)[: len(words)] == words]


def triton(template: dict[str, Any]) -> dict[str, Any]:
    """The container that runs Triton through the launcher (the leader's; one per pod)."""
    containers = started(template, LAUNCHER)
    assert len(containers) == 1, f"{len(containers)} containers run {' '.join(LAUNCHER)}, not one"
    return containers[0]


def launcher_args(container: dict[str, Any] | list[str]) -> Any:
    """The launcher's arguments as its own parser reads them (refusing unknown flags), from a container or an
    argv."""
    from orca_server.launcher import parse_args

    args = argv(container) if isinstance(container, dict) else container
    assert args[: len(LAUNCHER)] == LAUNCHER, f"Triton must be started by {' '.join(LAUNCHER)}, not {args[:3]}"
    try:
        return parse_args(args[len(LAUNCHER):])
    except SystemExit as exit_:
        raise AssertionError(f"the launcher refuses {args[len(LAUNCHER):]}") from exit_


def exit_timeout(args: Any) -> int:
    """Triton's --exit-timeout-secs among the flags the launcher passes on (after `--`)."""
    given = [a.split("=", 1)[1] for a in args.tritonserver_args if a.startswith("--exit-timeout-secs=")]
    return int(given[-1]) if given else TRITON_EXIT_TIMEOUT


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def probe_url(probe: dict[str, Any]) -> urllib.parse.SplitResult:
    """The URL an exec probe fetches with curl (the only exec probe the manifests use)."""
    command = probe["exec"]["command"]
    # --fail: an HTTP error status (503: not ready) fails the probe, not only a refused connection
    fails = any(re.fullmatch(r"-[a-zA-Z]*f[a-zA-Z]*|--fail", a) for a in command)
    assert command[0] == "curl" and fails, command
    (url,) = [a for a in command if a.startswith("http://")]
    return urllib.parse.urlsplit(url)


def gpus(container: dict[str, Any]) -> int:
    """nvidia.com/gpu of a container (0 without); a GPU request must equal its limit, as Kubernetes requires."""
    resources = container.get("resources", {})
    limit, request = (resources.get(k, {}).get("nvidia.com/gpu") for k in ("limits", "requests"))
    assert request is None or request == limit, f"{container['name']}: GPU request {request}, limit {limit}"
    return int(str(limit or 0))


def env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def named_port(container: dict[str, Any], port: int | str) -> int:
    """A container port by name (or a number, which must be one of the container's ports)."""
    numbers = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    if isinstance(port, int):
        assert port in numbers.values(), f"port {port} is not a containerPort of {container['name']}"
        return port
    assert port in numbers, f"{container['name']} has no port named {port!r}"
    return numbers[port]


_PARAMETER = re.compile(r'^parameters \{ key: "(\w+)" value: \{ string_value: "([^"]*)" \} \}', re.M)


def parameters(config: str) -> dict[str, str]:
    found = dict(_PARAMETER.findall(config))
    assert len(found) == len(re.findall(r"^\s*parameters\b", config, re.M)), "a parameters line the regex misses"
    return found


def interface(config: str) -> str:
    """The model part of a config.pbtxt (name, backend, batching, inputs, outputs), without comments."""
    text = re.sub(r"#[^\n]*", "", config[: config.index("instance_group")])
    return " ".join(text.split())


def model_config(kdir: Path) -> str:
    """The config.pbtxt Triton reads for orca_gpt: the ConfigMap key mounted over it in the leader."""
    docs = rendered(kdir)
    leader = triton(pod_templates(workload(docs))["leader"])
    volumes = {v["name"]: v for v in pod_templates(workload(docs))["leader"]["spec"]["volumes"]}
    target = f"{launcher_args(leader).model_repository}/{MODEL}/config.pbtxt"
    (mount,) = [m for m in leader["volumeMounts"] if m["mountPath"] == target]
    config_map = volumes[mount["name"]]["configMap"]["name"]
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == config_map]
    return cm["data"][mount["subPath"]]


def world(params: dict[str, str]) -> tuple[int, int, int]:
    """(tensor_parallel_size, pipeline_parallel_size, local_workers), empty values at their defaults."""
    tp = int(params.get("tensor_parallel_size") or 1)
    pp = int(params.get("pipeline_parallel_size") or 1)
    return tp, pp, int(params.get("local_workers") or tp * pp)


def _files_of(kdir: Path) -> list[Path]:
    """The YAML files of kdir and of the kustomizations it lists, recursively."""
    return list(kdir.glob("*.yaml")) + [f for d in _listed_dirs(kdir) for f in _files_of(d)]


def _dirs_with(kind: str) -> list[Path]:
    """The overlays with a resource of that kind. Read as text, without rendering: this runs when pytest
    collects the tests, where a broken kustomization must fail its tests, not the collection."""
    pattern = re.compile(rf"^kind: {kind}\s*$", re.M)
    return [k for k in OVERLAYS if any(pattern.search(p.read_text()) for p in _files_of(k))]


def lws_dirs() -> list[Path]:
    return _dirs_with("LeaderWorkerSet")


def deployment_dirs() -> list[Path]:
    return _dirs_with("Deployment")


# -- the tests -----------------------------------------------------------------------------------------------------
def test_there_are_cpu_gpu_single_host_and_multi_node_overlays() -> None:
    assert len(deployment_dirs()) >= 1 and len(lws_dirs()) >= 1, [str(k) for k in KUSTOMIZATIONS]
    devices = {parameters(model_config(k))["device"].partition(":")[0] for k in OVERLAYS}
    assert {"cpu", "cuda"} <= devices, f"overlays for devices {sorted(devices)}: want a CPU and a GPU one"


def test_every_manifest_is_valid_against_its_schema() -> None:
    problems = []
    for where, doc in every_resource():
        problems += [f"{where}: {error}" for error in schema_errors(doc)]
        name = doc.get("metadata", {}).get("name", "")
        # What the API server checks beyond the schema: names are DNS subdomains, Services' DNS labels.
        if not re.fullmatch(DNS_LABEL if doc.get("kind") == "Service" else DNS_SUBDOMAIN, name):
            problems.append(f"{where}: metadata.name {name!r} is not a valid {doc.get('kind')} name")
        for container in _containers(doc):
            for port in container.get("ports", []):
                if "name" in port and not re.fullmatch(r"(?=.*[a-z])[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?", port["name"]):
                    problems.append(f"{where}: port name {port['name']!r} is not an IANA_SVC_NAME")
    assert not problems, "\n".join(problems)


def test_the_schemas_refuse_what_the_api_server_refuses() -> None:
    """The validation has teeth: a misspelt field, a wrong type, a missing required field and an unknown
    restartPolicy of a real manifest are each reported."""
    docs = rendered(lws_dirs()[0])
    lws = copy.deepcopy(workload(docs))
    assert not schema_errors(lws)
    lws["spec"]["leaderWorkerTemplate"]["size"] = "2"
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    leader = triton(lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"])
    leader["ports"][0]["contianerPort"] = leader["ports"][0].pop("containerPort")
    errors = "\n".join(schema_errors(lws))
    for expected in ("'2' is not of type 'integer'", "'Always' is not one of", "'containerPort' is a required",
                     "'contianerPort' was unexpected"):
        assert expected in errors, errors
    service = copy.deepcopy(by_kind(docs, "Service")[0])
    service["spec"]["ports"][0]["port"] = "http"
    assert "'http' is not of type 'integer'" in "\n".join(schema_errors(service))
    # the HorizontalPodAutoscaler (Kubernetes' autoscaling/v2) and the ServiceMonitor (prometheus-operator's CRD)
    docs = rendered(deployment_dirs()[0])
    (hpa,) = copy.deepcopy(by_kind(docs, "HorizontalPodAutoscaler"))
    (monitor,) = copy.deepcopy(by_kind(docs, "ServiceMonitor"))
    assert not schema_errors(hpa) and not schema_errors(monitor)
    deployment = copy.deepcopy(workload(docs))
    container = triton(deployment["spec"]["template"])
    container["ports"][0]["contianerPort"] = container["ports"][0].pop("containerPort")
    errors = "\n".join(schema_errors(deployment))
    assert "'contianerPort' was unexpected" in errors and "'containerPort' is a required" in errors, errors
    hpa["spec"]["maxReplicas"] = "4"
    hpa["spec"]["metrics"][0]["pods"]["metrik"] = hpa["spec"]["metrics"][0]["pods"].pop("metric")
    errors = "\n".join(schema_errors(hpa))
    for expected in ("'4' is not of type 'integer'", "'metrik' was unexpected", "'metric' is a required"):
        assert expected in errors, errors
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    monitor["spec"]["endpoints"][0]["prot"] = monitor["spec"]["endpoints"][0].pop("port")
    errors = "\n".join(schema_errors(monitor))
    for expected in ("'15 seconds' does not match", "'prot' was unexpected"):
        assert expected in errors, errors


@functools.cache
def kubectl_kustomize() -> dict[Path, tuple[int, str, str]]:
    """`kubectl kustomize` of every kustomization, run side by side: kdir -> (exit status, stdout, stderr)."""
    runs = {k: subprocess.Popen(["kubectl", "kustomize", str(k)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for k in KUSTOMIZATIONS}
    out = {}
    for kdir, run in runs.items():
        stdout, stderr = run.communicate(timeout=60)
        out[kdir] = (run.returncode, stdout, stderr)
    return out


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("kdir", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_render_matches_kubectl_kustomize(kdir: Path) -> None:
    returncode, stdout, stderr = kubectl_kustomize()[kdir]
    assert returncode == 0, stderr
    theirs = [d for d in yaml.safe_load_all(stdout) if d is not None]

    def key(d: dict[str, Any]) -> tuple[str, str]:
        return d["kind"], d["metadata"]["name"]

    assert sorted(theirs, key=key) == sorted(rendered(kdir), key=key)


def test_every_manifest_of_a_kustomization_exists_and_standalone_ones_are_validated() -> None:
    for kdir in KUSTOMIZATIONS:
        assert rendered(kdir), f"{kdir} renders nothing"
    # deploy/kubernetes/checkpoints-pvc.yaml is applied on its own, and validated with the rest
    assert DEPLOY / "kubernetes" / "checkpoints-pvc.yaml" in standalone_manifests()


def public_service(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """The Service clients reach (not the headless one of the metrics, which only Prometheus uses)."""
    (service,) = [d for d in by_kind(docs, "Service") if d["spec"].get("clusterIP") != "None"]
    return service


@pytest.mark.parametrize("kdir", OVERLAYS, ids=lambda p: p.name)
def test_the_launcher_starts_triton_and_the_service_exposes_only_the_openai_port(kdir: Path) -> None:
    docs = rendered(kdir)
    templates = pod_templates(workload(docs))
    leader = triton(templates["leader"])
    args = launcher_args(leader)
    assert args.model_repository == Path("/models")  # where the Dockerfile copies model_repository/
    assert re.search(r"^COPY model_repository /models$", (ROOT / "Dockerfile").read_text(), re.M)
    # NVIDIA's tritonserver with its own backends; orca-openai is a container of its own
    assert args.tritonserver == Path(TRITONSERVER) and args.no_openai
    # orca_gpt alone (explicit model control, which the launcher always sets: orca_gpt unloads itself when its
    # engine fails, so that it reports not ready)
    assert args.models == [MODEL]
    assert args.admin_key_file is not None
    # Triton's HTTP and gRPC stay on the pod's loopback; only metrics listen on the pod's address
    assert is_loopback(args.address), f"Triton's HTTP and gRPC listen on {args.address}"
    assert args.metrics_address == "0.0.0.0"
    # the flags the launcher owns are not overridden after `--`
    owned = ("--http-address", "--grpc-address", "--http-port", "--grpc-port", "--http-restricted-api",
             "--grpc-restricted-protocol", "--model-control-mode", "--load-model", "--model-repository")
    assert not [a for a in args.tritonserver_args if a.split("=", 1)[0] in owned], args.tritonserver_args
    assert named_port(leader, "metrics") == args.metrics_port
    declared = {p["containerPort"] for p in leader.get("ports", [])}
    assert not declared & {args.http_port, args.grpc_port}, "HTTP and gRPC are on the loopback: no containerPort"
    service = public_service(docs)
    selector = service["spec"]["selector"]
    labels = templates["leader"]["metadata"]["labels"]
    assert selector.items() <= labels.items(), f"the Service selects {selector}, the Triton pods are {labels}"
    if "worker" in templates and templates["worker"] is not templates["leader"]:
        worker_labels = templates["worker"]["metadata"]["labels"]
        assert not selector.items() <= worker_labels.items(), "the Service also selects the followers"
    (openai,) = started(templates["leader"], "orca-openai")
    (port,) = service["spec"]["ports"]
    assert port["name"] == "openai" and named_port(openai, port["targetPort"]) == openai_args(openai).port
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP", "expose it through an ingress or gateway (TLS)"
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "LeaderWorkerSet"}
    assert service["metadata"]["name"] not in names, "LWS creates a headless Service of the LeaderWorkerSet's name"


@pytest.mark.parametrize("kdir", OVERLAYS, ids=lambda p: p.name)
def test_probes_ask_triton_whether_orca_gpt_is_ready(kdir: Path) -> None:
    """Exec probes inside the Triton container: its HTTP port is on the pod's loopback."""
    leader = triton(pod_templates(workload(rendered(kdir)))["leader"])
    http = launcher_args(leader).http_port
    paths = {}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        url = probe_url(leader[probe])
        assert is_loopback(url.hostname) and url.port == http, f"{probe} is not on Triton's HTTP port: {url}"
        assert leader[probe].get("timeoutSeconds", 1) >= 2, f"{probe}: curl's --max-time needs a timeout above 1 s"
        paths[probe] = url.path
    assert paths == {
        "startupProbe": "/v2/health/ready",  # Triton is up: it opens HTTP once the models are loaded
        "readinessProbe": f"/v2/models/{MODEL}/ready",
        "livenessProbe": f"/v2/models/{MODEL}/ready",  # not ready after start-up: the engine failed
    }
    # the start-up probe must allow for loading a checkpoint (and, multi-node, for the followers to join)
    startup = leader["startupProbe"]
    assert startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3) >= 600


# -- secure by default -----------------------------------------------------------------------------------------------
_QUANTITY = re.compile(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?")
_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity_bytes(value: str | int) -> float:
    match = _QUANTITY.fullmatch(str(value))
    assert match, f"{value!r}: not a memory quantity the test reads"
    return float(match.group(1)) * _UNITS[match.group(2)]


def every_container(template: dict[str, Any]) -> list[dict[str, Any]]:
    spec = template["spec"]
    return spec.get("initContainers", []) + spec["containers"]


@pytest.mark.parametrize("kdir", OVERLAYS, ids=lambda p: p.name)
def test_every_pod_and_container_runs_unprivileged(kdir: Path) -> None:
    """Non-root with a fixed uid/gid, no privilege escalation, a read-only root filesystem, no capabilities, the
    runtime's default seccomp profile, no service-account token: in every pod and container of the overlay."""
    for role, template in pod_templates(workload(rendered(kdir))).items():
        spec = template["spec"]
        assert spec.get("automountServiceAccountToken") is False, f"{role}: the service-account token is mounted"
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), role
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True and pod.get("runAsUser") == UID and pod.get("runAsGroup") == UID, (
            f"{role}: pod securityContext {pod}"
        )
        assert pod.get("fsGroup") == UID, f"{role}: without fsGroup {UID} the emptyDirs are not the user's"
        assert pod.get("seccompProfile") == {"type": "RuntimeDefault"}, f"{role}: {pod.get('seccompProfile')}"
        for container in every_container(template):
            where, sc = f"{role} {container['name']}", container.get("securityContext", {})
            assert sc.get("runAsNonRoot") is True and sc.get("runAsUser") == UID and sc.get("runAsGroup") == UID, (
                f"{where}: {sc}"
            )
            assert sc.get("allowPrivilegeEscalation") is False, f"{where}: privilege escalation allowed"
            assert sc.get("readOnlyRootFilesystem") is True, f"{where}: the root filesystem is writable"
            assert sc.get("capabilities") == {"drop": ["ALL"]}, f"{where}: capabilities {sc.get('capabilities')}"
            assert sc.get("seccompProfile") == {"type": "RuntimeDefault"}, f"{where}: {sc.get('seccompProfile')}"
            assert not sc.get("privileged"), f"{where}: privileged"
            # a read-only root: what writes has an emptyDir (/tmp: HOME in the image)
            mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
            if container in spec["containers"]:
                assert "/tmp" in mounts, f"{where}: no writable /tmp"


@pytest.mark.parametrize("kdir", OVERLAYS, ids=lambda p: p.name)
def test_every_container_has_memory_requests_and_limits_and_every_empty_dir_a_size_limit(kdir: Path) -> None:
    for role, template in pod_templates(workload(rendered(kdir))).items():
        for container in every_container(template):
            resources, where = container.get("resources", {}), f"{role} {container['name']}"
            request, limit = (resources.get(k, {}).get("memory") for k in ("requests", "limits"))
            assert request and limit, f"{where}: memory request {request}, limit {limit}"
            assert quantity_bytes(request) <= quantity_bytes(limit), f"{where}: request {request} > limit {limit}"
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        for name, volume in volumes.items():
            if "emptyDir" in volume:
                assert volume["emptyDir"].get("sizeLimit"), f"{role}: emptyDir {name} has no sizeLimit"
        # a memory-backed emptyDir counts against the limit of the container that fills it
        for container in template["spec"]["containers"]:
            in_memory = sum(quantity_bytes(volumes[m["name"]]["emptyDir"]["sizeLimit"])
                            for m in container.get("volumeMounts", [])
                            if volumes[m["name"]].get("emptyDir", {}).get("medium") == "Memory")
            limit = quantity_bytes(container["resources"]["limits"]["memory"])
            assert in_memory < limit, f"{role} {container['name']}: {in_memory} B of memory emptyDirs, limit {limit} B"


def network_policies(docs: tuple[dict[str, Any], ...], template: dict[str, Any]) -> list[dict[str, Any]]:
    """The NetworkPolicies that select the pods of a template (in their namespace: the overlay's)."""
    labels = template["metadata"]["labels"]
    out = []
    for policy in by_kind(docs, "NetworkPolicy"):
        selector = policy["spec"]["podSelector"]
        assert set(selector) <= {"matchLabels"}, f"{policy['metadata']['name']}: the test reads matchLabels only"
        if selector.get("matchLabels", {}).items() <= labels.items():
            out.append(policy)
    return out


def policy_port(templates: dict[str, dict[str, Any]], port: int | str) -> int:
    """A NetworkPolicy port (a number, or a container port's name in one of the pods) as a number."""
    if isinstance(port, int):
        return port
    numbers = {p["containerPort"] for t in templates.values() for c in t["spec"]["containers"]
               for p in c.get("ports", []) if p.get("name") == port}
    assert len(numbers) == 1, f"port name {port!r} names {sorted(numbers)}"
    return numbers.pop()


@pytest.mark.parametrize("kdir", OVERLAYS, ids=lambda p: p.name)
def test_a_network_policy_admits_only_the_openai_port_metrics_from_monitoring_and_the_groups_own_pods(
    kdir: Path,
) -> None:
    """Every pod is selected by a NetworkPolicy with ingress rules: the OpenAI port from anywhere, Triton's metrics
    port only from the monitoring namespace, and (a LeaderWorkerSet) every TCP port only from the pods of the same
    LeaderWorkerSet; nothing else (Triton's HTTP and gRPC above all)."""
    docs = rendered(kdir)
    lws = workload(docs)
    templates = pod_templates(lws)
    leader = templates["leader"]
    openai = openai_args(started(leader, "orca-openai")[0]).port
    metrics = launcher_args(triton(leader)).metrics_port
    for role, template in templates.items():
        policies = network_policies(docs, template)
        assert policies, f"{role}: no NetworkPolicy selects the pods"
        rules = []
        for policy in policies:
            assert "Ingress" in policy["spec"].get("policyTypes", ["Ingress"]), policy["metadata"]["name"]
            rules += policy["spec"].get("ingress", [])
        assert rules, f"{role}: the NetworkPolicy admits nothing"
        admitted: dict[str, set[int | str]] = {}
        for rule in rules:
            ports = rule.get("ports")
            assert ports, f"{role}: a rule without ports admits every port: {rule}"
            for port in ports:
                assert port.get("protocol", "TCP") == "TCP" and "endPort" not in port, port
            numbers = {policy_port(templates, p["port"]) if "port" in p else "every TCP port" for p in ports}
            peers = rule.get("from")
            if not peers:
                admitted.setdefault("anywhere", set()).update(numbers)
                continue
            for peer in peers:
                assert "ipBlock" not in peer, f"{role}: an ipBlock peer {peer}"
                if peer.get("namespaceSelector") == {"matchLabels": MONITORING} and "podSelector" not in peer:
                    admitted.setdefault("monitoring", set()).update(numbers)
                elif set(peer) == {"podSelector"}:
                    assert lws["kind"] == "LeaderWorkerSet", f"{role}: a pod peer {peer} in a one-pod overlay"
                    # the LWS controller's label of this LeaderWorkerSet's pods
                    assert peer["podSelector"] == {"matchLabels": {LWS_NAME_LABEL: lws["metadata"]["name"]}}, peer
                    admitted.setdefault("the LeaderWorkerSet's pods", set()).update(numbers)
                else:
                    raise AssertionError(f"{role}: a peer the test does not know: {peer}")
        assert admitted.get("anywhere") == {openai}, f"{role}: from anywhere: {admitted.get('anywhere')}"
        assert admitted.get("monitoring") == {metrics}, f"{role}: from monitoring: {admitted.get('monitoring')}"
        if lws["kind"] == "LeaderWorkerSet":
            # the control port, the torch.distributed store and NCCL's sockets: ports the engine picks
            assert admitted.get("the LeaderWorkerSet's pods") == {"every TCP port"}, admitted
            control = named_port(triton(leader), "orca-control")
            assert control not in admitted["anywhere"] | admitted["monitoring"]
        assert set(admitted) <= {"anywhere", "monitoring", "the LeaderWorkerSet's pods"}, admitted


@pytest.mark.parametrize("kdir", OVERLAYS, ids=lambda p: p.name)
def test_pods_drain_before_they_stop(kdir: Path) -> None:
    """A preStop pause (the endpoints drop the pod first), then a grace period longer than the pause plus Triton's
    exit timeout plus orca-openai's graceful shutdown (so neither is killed while streams finish)."""
    templates = pod_templates(workload(rendered(kdir)))
    leader = templates["leader"]
    triton_args = launcher_args(triton(leader))
    (openai,) = started(leader, "orca-openai")
    graceful = openai_args(openai).graceful_shutdown_timeout
    assert graceful >= exit_timeout(triton_args), "orca-openai would cut streams Triton would have finished"
    pauses = []
    for container in (triton(leader), openai):
        command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        assert command[:1] == ["sleep"] and int(command[1]) >= 5, f"{container['name']}: preStop {command}"
        pauses.append(int(command[1]))
    needed = max(pauses) + exit_timeout(triton_args) + graceful
    for role, template in templates.items():
        grace = template["spec"].get("terminationGracePeriodSeconds", 30)
        assert grace > needed, f"{role}: terminationGracePeriodSeconds {grace} <= {needed}"


@pytest.mark.parametrize("kdir", OVERLAYS, ids=lambda p: p.name)
def test_the_admin_key_file_is_made_before_the_containers_start(kdir: Path, tmp_path: Path) -> None:
    """The init container writes the admin key (with the launcher's own function: a fresh key, mode 0600) on a
    memory emptyDir that Triton's launcher (--admin-key-file) and orca-openai (--triton-admin-key-file) read; run
    here against a temporary file, twice (a pod restart keeps the key)."""
    leader = pod_templates(workload(rendered(kdir)))["leader"]
    path = launcher_args(triton(leader)).admin_key_file
    volumes = {v["name"]: v for v in leader["spec"]["volumes"]}
    (init,) = leader["spec"]["initContainers"]
    for container in (init, triton(leader), started(leader, "orca-openai")[0]):
        (mount,) = [m for m in container["volumeMounts"] if path.is_relative_to(m["mountPath"])]
        assert volumes[mount["name"]]["emptyDir"].get("medium") == "Memory", "the admin key is kept in memory only"
        assert mount.get("readOnly", False) == (container is not init), f"{container['name']} {mount}"
    command = argv(init)
    assert command[:2] == ["python3", "-c"] and str(path) in command[2], command
    target = tmp_path / "run" / "admin-key"
    code = command[2].replace(str(path), str(target))
    environ = {k: v for k, v in os.environ.items() if k != "ORCA_ADMIN_KEY"}
    keys = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        keys.append(target.read_text().strip())
        assert target.stat().st_mode & 0o777 == 0o600
        assert keys[-1] not in done.stdout + done.stderr, "the admin key is printed"
    assert len(keys[0]) >= 32 and keys[0] == keys[1]


@pytest.mark.parametrize("kdir", OVERLAYS, ids=lambda p: p.name)
def test_every_engine_container_has_a_memory_backed_dev_shm_and_the_devices_gpus(kdir: Path) -> None:
    """Triton and orca.worker get /dev/shm in memory; GPUs exactly where config.pbtxt's device is cuda: a CPU
    overlay holds none (in no container) and computes in float32."""
    params = parameters(model_config(kdir))
    device = params["device"]
    assert device == "cpu" or device.startswith("cuda"), f"device {device!r}: say cpu or cuda in an overlay"
    for role, template in pod_templates(workload(rendered(kdir))).items():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        engine = [c for c in template["spec"]["containers"] if argv(c)[:1] != ["orca-openai"]]
        assert engine, f"{role}: no engine container"
        for container in engine:
            (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
            assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory", f"{role}: /dev/shm is not in memory"
            if device.startswith("cuda"):
                assert gpus(container) >= 1, f"{role} {container['name']}: device cuda but no nvidia.com/gpu"
        if device == "cpu":
            assert not any(gpus(c) for c in template["spec"]["containers"]), f"{role}: device cpu holds a GPU"
            assert params["dtype"] == "float32", "on the CPU the engine computes in float32"


@pytest.mark.parametrize("kdir", OVERLAYS, ids=lambda p: p.name)
def test_config_pbtxt_is_the_shipped_model_with_one_kind_model_instance(kdir: Path) -> None:
    config, shipped = model_config(kdir), SHIPPED_CONFIG.read_text()
    assert interface(config) == interface(shipped), "inputs/outputs differ from model_repository/orca_gpt"
    groups = re.findall(r"instance_group\s*\[([^\]]*)\]", config)
    assert len(groups) == 1 and " ".join(groups[0].split()) == "{ count: 1 kind: KIND_MODEL }", groups
    # every shipped option, at a value of its own or the shipped one; besides them only the distributed ones
    # (which the shipped config may not list yet: test_engine_config_accepts_the_parameters checks them)
    ours, theirs = set(parameters(config)), set(parameters(shipped))
    missing, extra = theirs - ours, ours - theirs - set(DISTRIBUTED_PARAMETERS)
    assert not missing and not extra, f"parameters missing: {sorted(missing)}, unknown: {sorted(extra)}"
    model = parameters(config)["model"]
    if model:  # "" = the default model, installed in the image
        leader = pod_templates(workload(rendered(kdir)))["leader"]
        mounts = [m["mountPath"].rstrip("/") + "/" for m in triton(leader)["volumeMounts"]]
        assert any(model.startswith(m) for m in mounts), f"the model {model} is on no volume the pod mounts"


@pytest.mark.parametrize("kdir", OVERLAYS, ids=lambda p: p.name)
def test_engine_config_accepts_the_parameters(kdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from orca.config import EngineConfig  # (imports torch: the slow part of this file)

    if "tensor_parallel_size" not in {f.name for f in fields(EngineConfig)}:  # distributed execution not there yet
        pytest.skip("orca.EngineConfig has no tensor_parallel_size yet")
    params = parameters(model_config(kdir))
    assert params.pop("REPORT_CUSTOM_METRICS") == "true"  # a model parameter (the vllm:* metrics), not the engine's
    monkeypatch.delenv("ORCA_MODEL", raising=False)
    monkeypatch.setenv("POD_IP", "10.1.2.3")  # the downward API's, in the leader (multi-node's control_address)
    config = EngineConfig.from_parameters(params)
    if params.get("control_address", "").startswith("$POD_IP:"):
        assert config.control_address == "10.1.2.3:" + params["control_address"].rpartition(":")[2]
    tp, pp, local = world(params)
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (tp, pp)
    assert (config.local_workers or tp * pp) == local


@pytest.mark.parametrize("kdir", deployment_dirs(), ids=lambda p: p.name)
def test_single_host_runs_every_rank_on_the_pods_gpus(kdir: Path) -> None:
    docs = rendered(kdir)
    deployment = workload(docs)
    params = parameters(model_config(kdir))
    tp, pp, local = world(params)
    leader = triton(pod_templates(deployment)["leader"])
    devices = gpus(leader) if params["device"].startswith("cuda") else 1  # CPU: one engine process
    assert tp * pp == local == devices, f"tp {tp} x pp {pp}, local_workers {local}, {gpus(leader)} GPUs"
    host = (params.get("control_address") or "127.0.0.1:0").rpartition(":")[0]
    assert host in ("127.0.0.1", "localhost"), "every rank is local: the control address stays on the loopback"
    strategy = deployment["spec"]["strategy"]["type"]
    assert strategy == "Recreate", "a rolling update would wait for the GPUs the old pod holds"


@pytest.mark.parametrize("kdir", lws_dirs(), ids=lambda p: p.name)
def test_lws_ranks_add_up_and_followers_reach_the_driver(kdir: Path) -> None:
    docs = rendered(kdir)
    lws = workload(docs)
    lwt = lws["spec"]["leaderWorkerTemplate"]
    templates = pod_templates(lws)
    leader, worker = triton(templates["leader"]), only_container(templates["worker"])
    params = parameters(model_config(kdir))
    tp, pp, local = world(params)
    followers, worker_env = lwt["size"] - 1, env(worker)
    ranks_per_follower = int(worker_env["ORCA_LOCAL_RANKS"]["value"])
    assert local == gpus(leader), f"local_workers {local} but the leader has {gpus(leader)} GPUs"
    assert ranks_per_follower == gpus(worker), f"ORCA_LOCAL_RANKS {ranks_per_follower}, {gpus(worker)} GPUs"
    assert tp * pp == local + followers * ranks_per_follower, (
        f"tp {tp} x pp {pp} != local_workers {local} + {followers} followers x {ranks_per_follower} ranks"
    )
    # the control port: where the driver listens, what the followers dial, what the leader declares
    host, _, port = params["control_address"].rpartition(":")
    # the driver listens on the pod's own address (not every interface, not the loopback): the downward API's
    assert host == "$POD_IP", "the driver must listen on the pod's address ($POD_IP), not 0.0.0.0 or the loopback"
    assert env(leader)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert worker_env["ORCA_CONTROL_PORT"]["value"] == port != "0"
    assert named_port(leader, "orca-control") == int(port)
    # the followers run orca.worker with the driver from LWS's environment (LWS_LEADER_ADDRESS)
    command = " ".join(worker.get("command", []) + worker.get("args", []))
    assert re.search(r"\bpython3? -m orca\.worker\b", command) and "--driver" not in command, command
    assert worker["image"] == leader["image"]
    # one secret for the driver and its workers
    secrets = [env(c)["ORCA_WORKER_AUTHKEY"]["valueFrom"]["secretKeyRef"] for c in (leader, worker)]
    assert secrets[0] == secrets[1], secrets
    # the checkpoint: the driver sends its path, so every pod mounts the same volume at the same place
    model = params["model"]
    mounts = []
    for template, container in ((templates["leader"], leader), (templates["worker"], worker)):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        (mount,) = [m for m in container["volumeMounts"] if model.startswith(m["mountPath"].rstrip("/") + "/")]
        source = {k: v for k, v in volumes[mount["name"]].items() if k != "name"}
        mounts.append((mount["mountPath"], json.dumps(source, sort_keys=True)))
    assert mounts[0] == mounts[1], mounts
    # a pod that fails takes its group down (an engine cannot go on without a rank); followers start with the
    # leader, whose readiness needs them
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"].get("startupPolicy", "LeaderCreated") == "LeaderCreated"


def test_the_checkpoint_volume_claim_is_the_one_the_pods_mount() -> None:
    claims = {
        d["metadata"]["name"] for path in standalone_manifests() for d in yaml.safe_load_all(path.read_text())
        if d and d["kind"] == "PersistentVolumeClaim"
    }
    for kdir in OVERLAYS:
        for role, template in pod_templates(workload(rendered(kdir))).items():
            for volume in template["spec"]["volumes"]:
                if "persistentVolumeClaim" in volume:
                    assert volume["persistentVolumeClaim"]["claimName"] in claims, f"{kdir.name} {role}"


def test_readme_says_how_to_create_the_secret_and_what_has_been_run() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for kdir in lws_dirs():
        lws = workload(rendered(kdir))
        ref = env(triton(pod_templates(lws)["leader"]))["ORCA_WORKER_AUTHKEY"]["valueFrom"]["secretKeyRef"]
        assert f"kubectl create secret generic {ref['name']} --from-literal={ref['key']}=" in readme
        # the Secret that command creates (no secret value lives in the repository)
        secret = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": {"name": ref["name"]},
                  "data": {ref["key"]: "c2VjcmV0"}}
        assert not schema_errors(secret) and re.fullmatch(r"[-._a-zA-Z0-9]+", ref["key"])
    for kdir in OVERLAYS:
        assert f"kubectl apply -k {kdir.relative_to(ROOT)}" in readme
        # the OpenAI API's key: a required Secret, so the README must say how to make it
        openai = started(pod_templates(workload(rendered(kdir)))["leader"], "orca-openai")[0]
        ref = env(openai)["ORCA_OPENAI_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert f"kubectl create secret generic {ref['name']} --from-literal={ref['key']}=" in readme
    # the Security section: what the operator must still do, and the Triton release the image is built on
    security = readme[readme.index("## Security"):readme.index("## What has been run")]
    (release,) = re.findall(r"^FROM nvcr\.io/nvidia/(tritonserver:\S+)$", (ROOT / "Dockerfile").read_text(), re.M)
    for needed in ("TLS", "NetworkPolicy", "admin-key", release):
        assert needed in security, f"deploy/README.md's Security section does not mention {needed}"
    assert "## What has been run" in readme
    assert "Nothing here has been applied to a Kubernetes cluster" in readme
    # the autoscaling rule is explained, with the file it ships in and every metric the HPAs use
    assert str(ADAPTER_CONFIG.relative_to(DEPLOY)) in readme
    for kdir in OVERLAYS:
        for hpa in by_kind(rendered(kdir), "HorizontalPodAutoscaler"):
            for metric in hpa["spec"]["metrics"]:
                assert f"`{metric[metric['type'][0].lower() + metric['type'][1:]]['metric']['name']}`" in readme


# -- the OpenAI server, metrics and autoscaling --------------------------------------------------------------------
def openai_args(container: dict[str, Any]) -> Any:
    """orca-openai's arguments as its own parser reads them (refusing unknown flags)."""
    cli = pytest.importorskip("orca_openai.cli", reason="orca_openai is not in this checkout")
    args = argv(container)
    assert args[0] == "orca-openai", args
    # in the container's environment: its values, and a stand-in for each value from a Secret (the API key)
    environ = {e["name"]: e.get("value", "from-a-secret") for e in container.get("env", [])}
    try:
        with mock.patch.dict(os.environ, environ):
            return cli.parse_args(args[1:])
    except SystemExit as exit_:
        raise AssertionError(f"orca-openai refuses {args[1:]} with the environment {sorted(environ)}") from exit_


def gauges() -> set[str]:
    """The metric families orca_gpt registers as gauges (orca_triton/metrics.py)."""
    found = set(re.findall(r'fam\(\s*"(orca_\w+)",\s*"[^"]*",\s*G\s*\)', METRICS_PY.read_text()))
    assert "orca_waiting_requests" in found, "the regex no longer finds orca_gpt's gauges"
    return found


def adapter_rules() -> list[dict[str, Any]]:
    (config_map,) = [d for d in yaml.safe_load_all(ADAPTER_CONFIG.read_text()) if d]
    return yaml.safe_load(config_map["data"]["config.yaml"])["rules"]


@pytest.mark.parametrize("kdir", OVERLAYS, ids=lambda p: p.name)
def test_the_openai_server_talks_to_tritons_grpc_port_in_its_pod(kdir: Path) -> None:
    leader = pod_templates(workload(rendered(kdir)))["leader"]
    servers = started(leader, "orca-openai")
    assert len(servers) == 1, "no (or several) orca-openai containers beside Triton"
    (openai,) = servers
    triton_args, args = launcher_args(triton(leader)), openai_args(openai)
    host, _, port = args.triton_url.rpartition(":")
    assert is_loopback(host) and int(port) == triton_args.grpc_port, args.triton_url
    assert args.metrics_url == f"http://{host}:{triton_args.metrics_port}/metrics", args.metrics_url
    assert named_port(openai, "openai") == args.port
    assert openai["image"] == triton(leader)["image"], "orca-openai comes with the engine's image"
    probe = openai["readinessProbe"]["httpGet"]  # /health: 503 until Triton and orca_gpt are ready
    assert probe["path"] == "/health" and named_port(openai, probe["port"]) == args.port
    # on the pod's address (the Service's port), so with an API key, from a Secret that must exist
    assert args.host == "0.0.0.0"
    key = env(openai)["ORCA_OPENAI_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert not key.get("optional", False), "without the Secret orca-openai would serve without an API key"
    # the admin key Triton was started with (orca-openai lists the models through the repository index)
    assert Path(args.triton_admin_key_file) == triton_args.admin_key_file


@pytest.mark.parametrize("kdir", deployment_dirs(), ids=lambda p: p.name)
def test_the_service_monitor_scrapes_tritons_metrics_port(kdir: Path) -> None:
    docs = rendered(kdir)
    (monitor,) = by_kind(docs, "ServiceMonitor")
    selector = monitor["spec"]["selector"]
    assert set(selector) == {"matchLabels"}, selector
    selected = [d for d in by_kind(docs, "Service")
                if selector["matchLabels"].items() <= d["metadata"].get("labels", {}).items()]
    assert len(selected) == 1, f"the ServiceMonitor selects {len(selected)} Services, not the metrics one alone"
    (service,) = selected
    assert service is not public_service(docs), "the OpenAI API's Service carries no metrics port"
    assert "namespaceSelector" not in monitor["spec"], "the Service is in the ServiceMonitor's namespace"
    template = pod_templates(workload(docs))["leader"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    leader = triton(template)
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert list(ports) == [endpoint["port"]], f"the metrics Service has ports {list(ports)}"
    target = named_port(leader, ports[endpoint["port"]]["targetPort"])
    assert target == launcher_args(leader).metrics_port, "the ServiceMonitor scrapes no metrics port"
    assert endpoint.get("path", "/metrics") == "/metrics" and endpoint.get("scheme", "http") == "http"


@pytest.mark.parametrize("kdir", deployment_dirs(), ids=lambda p: p.name)
def test_the_hpa_scales_the_deployment_on_the_engines_gauges_through_the_adapter_rules(kdir: Path) -> None:
    docs = rendered(kdir)
    (hpa,) = by_kind(docs, "HorizontalPodAutoscaler")
    deployment = workload(docs)
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", deployment["metadata"]["name"])
    assert 1 <= hpa["spec"].get("minReplicas", 1) <= hpa["spec"]["maxReplicas"]
    rules = {rule["name"]["as"]: rule for rule in adapter_rules()}
    engine_gauges = gauges()
    assert hpa["spec"]["metrics"], "an HPA without metrics scales on CPU"
    for metric in hpa["spec"]["metrics"]:
        assert metric["type"] == "Pods", "per-pod custom metrics: the adapter rules map the namespace and pod labels"
        name = metric["pods"]["metric"]["name"]
        assert name in rules, f"{name}: no prometheus-adapter rule in {ADAPTER_CONFIG.name} publishes it"
        # Triton labels the engine's series by model (and version)
        assert metric["pods"]["metric"].get("selector", {}).get("matchLabels", {}) == {"model": MODEL}
        assert metric["pods"]["target"]["type"] == "AverageValue"
    for name, rule in rules.items():
        series = re.fullmatch(r"(orca_\w+)\{([^}]*)\}", rule["seriesQuery"])
        assert series and series.group(1) in engine_gauges, f"{name}: {rule['seriesQuery']} is no engine gauge"
        assert re.fullmatch(rf"\^{series.group(1)}\$", rule["name"]["matches"]), rule["name"]
        used = set(re.findall(r"\b(orca_\w+)\{", rule["metricsQuery"]))
        assert used and used <= engine_gauges, f"{name}: {sorted(used - engine_gauges)} are no gauges of orca_gpt"
        assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
        overrides = rule["resources"]["overrides"]
        assert overrides == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}, overrides
