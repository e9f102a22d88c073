"""The Kubernetes manifests in docs/deploy/kubernetes/, offline: valid for the API server, and the pod they describe.

Every document is validated against the OpenAPI schemas of pinned Kubernetes versions that kubernetes-validate
bundles, strictly (an unknown or misplaced field fails). The rest checks what a schema cannot: the native sidecar
layout, the probes, the volumes, the threads against the CPU limit, the grace period against the drain, the
headless Service and the PodDisruptionBudget, the image tags, and that every ``SPINDLE_*`` variable of the
manifests and of docker-compose.yml is one the code reads. The inference gateway's objects, custom resources that
kubernetes-validate has no schema for, are checked against the InferencePool's schema (below) and by their shape.
"""

import copy
import importlib.util
import re
import socket
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from spindle.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "docs" / "deploy" / "kubernetes"
DOCUMENTS = {path.name: list(yaml.safe_load_all(path.read_text())) for path in sorted(MANIFESTS.glob("*.yaml"))}
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]

KUBERNETES_VERSIONS = ("1.29", "1.37")
"""The oldest Kubernetes that runs native sidecars by default, and the newest that kubernetes-validate bundles."""
VARIANTS = {"cpu.yaml": ("cpu", "emptyDir"), "gpu.yaml": ("cuda", "persistentVolumeClaim")}
"""Each Deployment's file -> its backend's device and the kind of its cache volume (the files explain why)."""
SOCKET = "ipc:///run/spindle/engine.sock"
BACKEND_PROBE = ["spindle", "backend", "--check", SOCKET]
"""Exits 0 if the backend answers a ping within 5 s (without importing torch)."""
PORT = 50051
STARTUP_BUDGET = 600
"""Seconds a first start may take: a model load, a GGUF conversion, the kernels' build or compiles."""


CUSTOM_GROUPS = ("inference.networking.k8s.io/", "gateway.networking.k8s.io/")
"""The API groups of the inference gateway's custom resources (the Gateway API's and its inference extension's)."""
CORE = [document for documents in DOCUMENTS.values() for document in documents]
CORE = [document for document in CORE if not document["apiVersion"].startswith(CUSTOM_GROUPS)]
"""The documents of Kubernetes' own kinds, which kubernetes-validate has the schemas of."""

_PORT = {
    "type": "object",
    "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}},
    "required": ["number"],
    "additionalProperties": False,
}
INFERENCE_POOL_V1 = {
    "type": "object",
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "properties": {
                "selector": {
                    "type": "object",
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string", "maxLength": 63},
                        }
                    },
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                },
                "targetPorts": {"type": "array", "items": _PORT, "minItems": 1, "maxItems": 8},
                "endpointPickerRef": {
                    "type": "object",
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                    "required": ["name"],
                    "additionalProperties": False,
                },
            },
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "additionalProperties": False,
        },
    },
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
}
"""The ``InferencePool`` of the Gateway API Inference Extension v1 (its CRD ``inferencepools.inference.networking.
k8s.io``), as JSON Schema: the spec's fields, their types, bounds and required ones; unknown fields fail, as the API
server prunes or refuses them."""


def find(kind: str, file: str | None = None) -> list[dict]:
    files = [file] if file else DOCUMENTS
    return [document for name in files for document in DOCUMENTS[name] if document["kind"] == kind]


def pod(variant: str) -> dict:
    [deployment] = find("Deployment", variant)
    return deployment["spec"]["template"]["spec"]


def containers(spec: dict) -> dict[str, dict]:
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


def env(container: dict) -> dict[str, object]:
    """Each variable's value, or its ``valueFrom`` source."""
    return {v["name"]: v["value"] if "value" in v else v["valueFrom"] for v in container.get("env", [])}


def volume_at(spec: dict, container: dict, path: str) -> dict:
    """The pod volume that ``container`` mounts on ``path``, with the mount's readOnly flag."""
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    return volume | {"readOnly": mount.get("readOnly", False)}


def budget(probe: dict) -> int:
    return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


CONTAINERS = {
    f"{file}:{container['name']}": container
    for file, documents in DOCUMENTS.items()
    for document in documents
    if "template" in document.get("spec", {})
    for container in containers(document["spec"]["template"]["spec"]).values()
}
"""Every container of every pod template (Deployments, the Job), by ``file:name``."""


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("document", CORE, ids=[f"{d['kind']}:{d['metadata']['name']}" for d in CORE])
def test_every_document_is_valid(document, version):
    problem = None
    try:
        kubernetes_validate.validate(document, version, strict=True)
    except kubernetes_validate.ValidationError as error:  # its text holds the whole schema: say where and what
        problem = f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
    if problem:
        pytest.fail(problem, pytrace=False)


def test_validation_is_strict_and_offline(monkeypatch):
    """A misspelt probe type fails, with every network connection refused."""

    def refuse(*args: object) -> None:
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    [deployment] = find("Deployment", "cpu.yaml")
    deployment = copy.deepcopy(deployment)
    frontend = containers(deployment["spec"]["template"]["spec"])["frontend"]
    frontend["readinessProbe"]["grcp"] = frontend["readinessProbe"].pop("grpc")
    with pytest.raises(kubernetes_validate.ValidationError, match="'grcp' was unexpected"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_backend_and_frontend_are_native_sidecars_of_the_app(variant):
    """Started in this order (each after the one before passes its startup probe), stopped after the app."""
    spec = pod(variant)
    assert [(c["name"], c.get("restartPolicy")) for c in spec["initContainers"]] == [
        ("backend", "Always"),
        ("frontend", "Always"),
    ]
    [app] = spec["containers"]
    assert env(app)["SPINDLE_ADDRESS"] == f"localhost:{PORT}"
    assert spec["enableServiceLinks"] is False  # no SPINDLE_* variables from Services named spindle-*


@pytest.mark.parametrize("variant", VARIANTS)
def test_backend_and_frontend_share_the_socket_and_the_ports(variant):
    spec = pod(variant)
    backend, frontend = containers(spec)["backend"], containers(spec)["frontend"]
    assert env(backend)["SPINDLE_LISTEN"] == env(frontend)["SPINDLE_BACKEND_ADDRESS"] == SOCKET
    socket_dir = SOCKET.removeprefix("ipc://").rsplit("/", 1)[0]
    assert volume_at(spec, backend, socket_dir) == volume_at(spec, frontend, socket_dir)
    assert "emptyDir" in volume_at(spec, backend, socket_dir)
    assert int(env(frontend)["SPINDLE_PORT"]) == PORT and env(frontend)["SPINDLE_HOST"] == "0.0.0.0"
    metrics_port = int(env(frontend)["SPINDLE_METRICS_PORT"])
    assert env(frontend)["SPINDLE_METRICS_HOST"] == "0.0.0.0"  # scraped from outside the pod
    assert frontend["ports"] == [
        {"name": "grpc", "containerPort": PORT},
        {"name": "metrics", "containerPort": metrics_port},
    ]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_api_key_is_required_from_the_secret(variant):
    """A missing secret stops the pod instead of serving open; the app beside the server sends the same key."""
    reference = {"secretKeyRef": {"name": "spindle", "key": "api-key"}}
    for name in ("frontend", "app"):
        assert env(containers(pod(variant))[name])["SPINDLE_API_KEY"] == reference


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes(variant):
    """The backend: exec probes that ping its socket; the frontend: gRPC health on its port."""
    backend, frontend = containers(pod(variant))["backend"], containers(pod(variant))["frontend"]
    for probe in ("startupProbe", "livenessProbe"):
        assert backend[probe]["exec"]["command"] == BACKEND_PROBE
        assert backend[probe]["timeoutSeconds"] >= 10  # a Python process starts, then waits up to 5 s
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert frontend[probe]["grpc"] == {"port": PORT}
    # The frontend waits for the model too when it restarts after a backend crash.
    assert budget(backend["startupProbe"]) >= STARTUP_BUDGET and budget(frontend["startupProbe"]) >= STARTUP_BUDGET


@pytest.mark.parametrize("variant", VARIANTS)
def test_model_and_cache_volumes(variant):
    spec, [job] = pod(variant), find("Job")
    backend = containers(spec)["backend"]
    variables, (_, cache_kind) = env(backend), VARIANTS[variant]
    claims = {claim["metadata"]["name"] for claim in find("PersistentVolumeClaim")}
    model = volume_at(spec, backend, "/models")
    assert model["readOnly"] and model["persistentVolumeClaim"] == {"claimName": "spindle-models", "readOnly": True}
    # The Job downloads into the directory the backend serves, on the same claim.
    [download] = job["spec"]["template"]["spec"]["containers"]
    local_dir = download["command"][download["command"].index("--local-dir") + 1]
    assert variables["SPINDLE_MODEL"] == local_dir and local_dir.startswith("/models/")
    assert volume_at(job["spec"]["template"]["spec"], download, "/models")["persistentVolumeClaim"] == {
        "claimName": "spindle-models"
    }
    cache = volume_at(spec, backend, variables["SPINDLE_CACHE_DIR"])
    assert cache_kind in cache and not cache["readOnly"]
    if "persistentVolumeClaim" in cache:
        assert cache["persistentVolumeClaim"]["claimName"] in claims
    if variables["SPINDLE_DEVICE"] == "cuda":  # Triton's kernels persist with the rest
        assert variables["TRITON_CACHE_DIR"].startswith(variables["SPINDLE_CACHE_DIR"] + "/")


@pytest.mark.parametrize("variant", VARIANTS)
def test_resources_and_torch_threads(variant):
    """Every container asks for CPU and memory; torch runs one thread per core of the backend's CPU limit."""
    spec = pod(variant)
    for container in containers(spec).values():
        assert {"cpu", "memory"} <= set(container["resources"]["requests"]), container["name"]
        assert "memory" in container["resources"]["limits"], container["name"]
    backend = containers(spec)["backend"]
    device, _ = VARIANTS[variant]
    limits, requests = backend["resources"]["limits"], backend["resources"]["requests"]
    assert re.fullmatch(r"[1-9]\d*", str(limits["cpu"]))  # whole cores, so the thread count is the limit exactly
    assert requests["cpu"] == limits["cpu"] and requests["memory"] == limits["memory"]
    threads = env(backend)["OMP_NUM_THREADS"]
    by_reference = {"resourceFieldRef": {"containerName": "backend", "resource": "limits.cpu", "divisor": "1"}}
    assert threads in (str(limits["cpu"]), by_reference)
    assert env(backend)["SPINDLE_DEVICE"] == device
    assert limits.get("nvidia.com/gpu") == (1 if device == "cuda" else None)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_grace_period_outlasts_the_drains(variant):
    """The sidecars stop one after the other once the app has exited: the pod's grace covers both drains."""
    spec = pod(variant)
    drains = [float(env(c)["SPINDLE_GRACE_PERIOD"]) for c in spec["initContainers"]]
    assert drains == [30, 30]
    assert spec["terminationGracePeriodSeconds"] >= sum(drains) + 10


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_headless_service_and_a_disruption_budget_select_the_pods(variant):
    [deployment], [service], [budget_] = (
        find(kind, variant) for kind in ("Deployment", "Service", "PodDisruptionBudget")
    )
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    assert service["spec"]["clusterIP"] == "None"  # DNS lists the pods: clients balance over them
    assert service["spec"]["selector"] == labels
    assert service["spec"]["ports"] == [{"name": "grpc", "port": PORT, "targetPort": "grpc", "appProtocol": "grpc"}]
    assert budget_["spec"]["selector"]["matchLabels"] == labels
    assert budget_["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]


def compose_images() -> set[str]:
    """The images docker-compose.yml builds, with their default tags."""
    pattern = r"\$\{\w+:-([^}]*)\}"
    return {re.sub(pattern, r"\1", service["image"]) for service in COMPOSE["services"].values()}


@pytest.mark.parametrize("where", CONTAINERS)
def test_images_are_the_versioned_ones_compose_builds(where):
    image = CONTAINERS[where]["image"]
    assert re.fullmatch(rf"spindle-(backend|frontend):{re.escape(VERSION)}(-cu\d+)?", image)
    assert image in compose_images()


def code_variables() -> set[str]:
    """The SPINDLE_* variables the code reads outside the commands' flags (the cache directory, ...)."""
    packages = ["spindle", *(f"spindle.{name}" for name in ("shared", "frontend", "backend", "kernels"))]
    roots = [root for package in packages for root in importlib.util.find_spec(package).submodule_search_locations]
    sources = [path.read_text() for root in roots for path in Path(root).rglob("*.py")]
    return {name for text in sources for name in re.findall(r"environ\.get\(\"(SPINDLE_\w+)\"", text)}


def flag_variables(command: str) -> set[str]:
    """``SPINDLE_<FLAG>`` for each flag of ``spindle <command>``."""
    [subparsers] = [a for a in build_parser()._actions if a.dest == "command"]
    return {f"SPINDLE_{action.dest.upper()}" for action in subparsers.choices[command]._actions}


SPINDLE_COMMANDS = {
    where: (container["command"], env(container))
    for where, container in CONTAINERS.items()
    if container.get("command", [])[:1] == ["spindle"]
} | {
    f"docker-compose.yml:{name}": (service["command"], service["environment"])
    for name, service in COMPOSE["services"].items()
    if service.get("command", [])[:1] == ["spindle"]
}
"""The command and environment of every container and compose service that runs ``spindle``."""


@pytest.mark.parametrize("where", SPINDLE_COMMANDS)
def test_every_spindle_variable_is_read_by_its_command(where):
    command, variables = SPINDLE_COMMANDS[where]
    unknown = {v for v in variables if v.startswith("SPINDLE_")} - flag_variables(command[1]) - code_variables()
    assert unknown == set()


GATEWAY_FILE = "inference-gateway.yaml"


def test_the_inference_pool_follows_its_schema():
    [pool] = find("InferencePool", GATEWAY_FILE)
    jsonschema.validate(pool, INFERENCE_POOL_V1)
    misspelt = copy.deepcopy(pool)
    misspelt["spec"]["targetPort"] = misspelt["spec"].pop("targetPorts")
    with pytest.raises(jsonschema.ValidationError, match="'targetPorts' is a required property"):
        jsonschema.validate(misspelt, INFERENCE_POOL_V1)


def test_the_pool_selects_the_pods_on_their_http_port():
    """The pool's pods serve the OpenAI API (and /metrics, which the endpoint picker scrapes) on its target port,
    and keep gRPC on theirs."""
    [pool], [deployment] = find("InferencePool", GATEWAY_FILE), find("Deployment", GATEWAY_FILE)
    template = deployment["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"] == template["metadata"]["labels"]
    [spindle] = template["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in spindle["ports"]}
    [target] = pool["spec"]["targetPorts"]
    command = spindle["command"]
    assert command[:2] == ["spindle", "serve"] and command[command.index("--http-port") + 1] == str(target["number"])
    assert ports == {"http": target["number"], "grpc": PORT} and int(env(spindle)["SPINDLE_PORT"]) == PORT
    assert env(spindle)["SPINDLE_HOST"] == "0.0.0.0"
    assert spindle["readinessProbe"]["grpc"] == {"port": PORT}  # NOT_SERVING while draining: no new requests
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"


def test_the_route_sends_the_gateways_requests_to_the_pool():
    [pool], [gateway], [route] = (find(kind, GATEWAY_FILE) for kind in ("InferencePool", "Gateway", "HTTPRoute"))
    assert route["spec"]["parentRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway["metadata"]["name"]}
    ]
    [rule] = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert [(listener["protocol"], listener["port"]) for listener in gateway["spec"]["listeners"]] == [("HTTP", 80)]
