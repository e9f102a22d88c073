"""docker-compose.yml and the Dockerfile without Docker.

The file is validated against the Compose specification (compose-spec, the parser Podman's podlet uses) and the
Dockerfile linted with hadolint. The invariants that a schema does not see are checked on the parsed file:
restart policies, health checks, the model and cache volumes, the build arguments of the two backend images and
their version tags. Last, the services' commands run as plain processes with their environments and their volumes
mapped to directories here, pass their health checks and serve a request.
"""

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import tomllib
from pathlib import Path

import openai
import pytest
import yaml
from compose_spec import PyCompose
from waiting import wait_until

from spindle.client import SpindleClient

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = REPO / ".venv" / "bin"
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
DOCKERFILE = (REPO / "Dockerfile").read_text()

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
BACKENDS = {"backend": "cuda", "backend-cpu": "cpu"}
"""The backend service of each profile, and the device it runs on."""
GATEWAY_WORKERS = ["worker-1", "worker-2"]
"""The ``gateway`` profile's ``spindle serve`` workers, each with its own backend, behind the SMG ``gateway``."""
SERVERS = [*BACKENDS, "frontend", *GATEWAY_WORKERS]
"""The long-running Spindle services (``models`` is a one-off helper; ``gateway`` runs ``smg``)."""
DRAIN = 30
"""SPINDLE_GRACE_PERIOD: what a stop must leave the servers to finish the streams in flight."""


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR:-default}`` and ``${VAR}`` substitution."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m.group(1)) or m.group(2) or "", value)


def interpolated(node: object, env: dict[str, str]) -> object:
    """A parsed compose file with every string interpolated."""
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {key: interpolated(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolated(value, env) for value in node]
    return node


def seconds(duration: str) -> float:
    """A compose duration such as ``1m30s`` or ``40s``."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3}
    return sum(float(n) * units[unit] for n, unit in re.findall(r"([\d.]+)(h|ms|m|s)", duration))


def mounts(service: dict, env: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Each volume's mount point in the container -> (its source, ``ro`` or ``rw``)."""
    result = {}
    for volume in service.get("volumes", []):
        source, target, *mode = interpolate(volume, env).split(":")
        result[target] = (source, mode[0] if mode else "rw")
    return result


def dockerfile_stage(target: str) -> str:
    """The text of one ``FROM ... AS target`` stage of the Dockerfile."""
    return re.search(rf"^FROM \S+ AS {target}\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.MULTILINE | re.DOTALL).group(1)


def test_the_file_follows_the_compose_specification():
    """Unknown keys (a misspelt ``healthcheck``), bad enum values and undeclared volumes all fail here."""
    PyCompose.from_json(json.dumps(interpolated(COMPOSE, {}))).validate()


def test_the_build_context_holds_what_the_dockerfile_copies():
    """.dockerignore leaves everything out, then lets back in what the COPY lines need (a build here cannot tell)."""
    lines = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in lines
    allowed = {line.removeprefix("!") for line in lines if line.startswith("!")}
    copied = {
        source for sources in re.findall(r"^COPY (.+) \S+$", DOCKERFILE, re.MULTILINE) for source in sources.split()
    }
    assert copied and copied <= allowed


def test_the_dockerfile_passes_hadolint():
    result = subprocess.run(
        [VENV_BIN / "hadolint", "--no-color", "Dockerfile"], capture_output=True, text=True, cwd=REPO
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", SERVERS)
def test_servers_restart_have_a_health_check_and_time_to_drain(name):
    service = SERVICES[name]
    assert service["restart"] in ("unless-stopped", "on-failure")
    assert service["healthcheck"]["test"][:3] == ["CMD", "spindle", "backend" if name in BACKENDS else "health"]
    assert int(service["environment"]["SPINDLE_GRACE_PERIOD"]) == DRAIN
    assert seconds(service["stop_grace_period"]) > DRAIN


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_health_check_pings_its_own_socket(name):
    service = SERVICES[name]
    listen = service["environment"]["SPINDLE_LISTEN"]
    assert service["healthcheck"]["test"] == ["CMD", "spindle", "backend", "--check", listen]
    assert seconds(service["healthcheck"]["timeout"]) >= 10  # a Python process starts, then waits up to 5 s
    assert seconds(service["healthcheck"]["start_period"]) >= 600  # a first start builds kernels, converts GGUF
    assert SERVICES["frontend"]["depends_on"][name] == {"condition": "service_healthy", "required": False}
    assert SERVICES["frontend"]["environment"]["SPINDLE_BACKEND_ADDRESS"] == listen


@pytest.mark.parametrize("name", [*BACKENDS, *GATEWAY_WORKERS])
def test_backend_reads_models_from_the_model_volume_and_keeps_its_caches(name):
    service, declared = SERVICES[name], set(COMPOSE["volumes"])
    mounted = mounts(service, {})
    assert mounted["/models"] == ("models", "ro")  # the named volume by default...
    assert mounts(service, {"SPINDLE_MODEL_DIR": "/srv/models"})["/models"] == ("/srv/models", "ro")  # ...or a dir
    assert "SPINDLE_MODEL" in service["environment"] and service["environment"]["SPINDLE_MODEL"] is None
    cache_dir = service["environment"]["SPINDLE_CACHE_DIR"]
    assert mounted[cache_dir] == ("cache", "rw")
    assert service["environment"]["TRITON_CACHE_DIR"].startswith(cache_dir + "/")
    assert {source for source, _ in mounted.values()} <= declared
    # The image has the same directories, so that a backend run without compose caches in the same place.
    stage = dockerfile_stage("backend")
    for variable in ("SPINDLE_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert f"{variable}={service['environment'][variable]}" in stage


def test_the_metrics_port_is_published_on_the_loopback_unless_asked():
    """Metrics need no key: published on all of the host's interfaces only when SPINDLE_METRICS_BIND says so."""
    grpc_port, metrics_port = SERVICES["frontend"]["ports"]
    assert interpolate(grpc_port, {}) == "50051:50051"
    assert interpolate(metrics_port, {}) == "127.0.0.1:9090:9090"
    assert interpolate(metrics_port, {"SPINDLE_METRICS_BIND": "0.0.0.0"}) == "0.0.0.0:9090:9090"


def test_the_keys_pass_through_from_the_host():
    """Unset on the host, unset in the container: compose never turns a missing key into an empty one."""
    environment = SERVICES["frontend"]["environment"]
    assert environment["SPINDLE_API_KEY"] is None and environment["SPINDLE_ADMIN_API_KEY"] is None


def test_the_model_helper_writes_the_volume_the_backends_read():
    helper = SERVICES["models"]
    assert helper["profiles"] == ["tools"]  # never started by `up`
    assert mounts(helper, {})["/models"] == ("models", "rw")
    assert helper["image"] == SERVICES["backend-cpu"]["image"]


@pytest.mark.parametrize(
    ("name", "index", "gpus"),
    [
        (
            "backend",
            r"https://download\.pytorch\.org/whl/cu\d+",
            [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}],
        ),
        ("backend-cpu", re.escape(CPU_INDEX), []),
    ],
)
def test_each_profile_builds_its_torch_and_triton(name, index, gpus):
    service = SERVICES[name]
    args = service["build"]["args"]
    assert re.fullmatch(index, args["TORCH_INDEX_URL"])
    if gpus:  # Triton as the `dev` extra pins it: the version `make test` compiles every kernel with
        assert f"triton=={args['TRITON_VERSION']}" in PYPROJECT["project"]["optional-dependencies"]["dev"]
    else:
        assert "TRITON_VERSION" not in args
    assert service["environment"]["SPINDLE_DEVICE"] == BACKENDS[name]
    assert service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", []) == gpus


def test_the_dockerfile_defaults_to_cpu_torch_and_no_triton():
    stage = dockerfile_stage("backend")
    assert f"ARG TORCH_INDEX_URL={CPU_INDEX}\n" in stage
    assert "ARG TRITON_VERSION=\n" in stage
    assert '--index-url "$TORCH_INDEX_URL"' in stage


@pytest.mark.parametrize("name", [*SERVERS, "models", "gateway"])
def test_images_are_tagged_with_the_version(name):
    """``spindle-<target>:<version>``, the CUDA image suffixed with its torch index; never ``latest``."""
    service = SERVICES[name]
    index = service["build"].get("args", {}).get("TORCH_INDEX_URL", CPU_INDEX)
    suffix = "" if index == CPU_INDEX else "-" + index.rsplit("/", 1)[1]
    target = service["build"]["target"]
    assert service["image"] == f"spindle-{target}:${{SPINDLE_VERSION:-{VERSION}}}{suffix}"
    assert interpolate(service["image"], {"SPINDLE_VERSION": "9.9.9"}) == f"spindle-{target}:9.9.9{suffix}"


def test_one_tag_is_one_build():
    """Services that share an image tag build it the same way, so no build overwrites another's image."""
    builds = {}
    for service in SERVICES.values():
        build = json.dumps(service["build"], sort_keys=True)
        assert builds.setdefault(service["image"], build) == build, service["image"]


NOT_IN_THE_FRONTEND = {
    "spindle-client",
    "torch",
    "transformers",
    "gguf",
    "accelerate",
    "safetensors",
    "tqdm",
    "ninja",
    "xgrammar",
    "pebble",
    "filelock",
}
"""The server's dependencies that the frontend image leaves out: the client comes from ./client, the rest is the
model's (tqdm only for ``LLM``'s progress bars, which run in-process; pebble for the grammar compile workers,
filelock for the kernel and model caches). A new dependency goes in one list or the other."""


def option(command: list[str], flag: str) -> list[str]:
    """The values after ``flag`` in a command line (``--flag=value`` or ``--flag value ...``, up to the next flag)."""
    for i, arg in enumerate(command):
        if arg.startswith(flag + "="):
            return [arg.split("=", 1)[1]]
        if arg == flag:
            return list(itertools.takewhile(lambda value: not value.startswith("--"), command[i + 1 :]))
    return []


def test_the_gateway_profile_routes_cache_aware_to_both_workers():
    gateway = SERVICES["gateway"]
    command = gateway["command"]
    assert command[:2] == ["smg", "launch"] and option(command, "--policy") == ["cache_aware"]
    urls = [f"grpc://{name}:{SERVICES[name]['environment']['SPINDLE_PORT']}" for name in GATEWAY_WORKERS]
    assert option(command, "--worker-urls") == urls
    assert {name: SERVICES[name]["profiles"] for name in [*GATEWAY_WORKERS, "gateway"]} == dict.fromkeys(
        [*GATEWAY_WORKERS, "gateway"], ["gateway"]
    )
    assert gateway["depends_on"] == {name: {"condition": "service_healthy"} for name in GATEWAY_WORKERS}
    # The gateway fetches the tokenizer from the workers: no model volume. The workers publish no port.
    assert "volumes" not in gateway and not any("ports" in SERVICES[name] for name in GATEWAY_WORKERS)
    for name in GATEWAY_WORKERS:
        assert SERVICES[name]["environment"]["SPINDLE_HOST"] == "0.0.0.0"
    assert gateway["restart"] == "unless-stopped" and seconds(gateway["stop_grace_period"]) > DRAIN
    assert option(command, "--host") == option(command, "--prometheus-host") == ["0.0.0.0"]


@pytest.mark.parametrize(
    ("host_env", "port", "metrics"),
    [
        ({}, "8000", "29000"),
        ({"SPINDLE_GATEWAY_PORT": "8123", "SPINDLE_GATEWAY_METRICS_PORT": "29123"}, "8123", "29123"),
    ],
)
def test_the_gateway_listens_publishes_and_checks_one_port(host_env, port, metrics):
    """The OpenAI port and the metrics port, set from the host, are the ones smg binds, compose publishes and the
    health check asks; both on the host's loopback unless asked, as smg authenticates no one without keys."""
    gateway = interpolated(SERVICES["gateway"], host_env)
    assert option(gateway["command"], "--port") == [port]
    assert option(gateway["command"], "--prometheus-port") == [metrics]
    assert gateway["ports"] == [f"127.0.0.1:{port}:{port}", f"127.0.0.1:{metrics}:{metrics}"]
    assert interpolate(SERVICES["gateway"]["ports"][0], {"SPINDLE_GATEWAY_BIND": "0.0.0.0"}).startswith("0.0.0.0:")
    assert gateway["healthcheck"]["test"][-1].endswith(f"'http://localhost:{port}/readiness')")


def test_the_gateway_image_installs_the_smg_the_tests_run():
    (pin,) = re.findall(r"\bsmg==[\d.]+", dockerfile_stage("gateway"))
    assert pin in PYPROJECT["project"]["optional-dependencies"]["dev"]


def test_the_frontend_image_installs_the_frontend_dependencies():
    """The frontend installs the server package without its dependencies, then the frontend's, with their bounds."""
    specs = set(re.findall(r'"([A-Za-z0-9_.-]+[<>=!~][^"]+)"', dockerfile_stage("frontend")))
    declared = set(PYPROJECT["project"]["dependencies"])
    assert specs <= declared
    name = re.compile(r"[A-Za-z0-9_.-]+")
    assert {name.match(spec).group() for spec in declared - specs} == NOT_IN_THE_FRONTEND


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_dirs(service: dict, host_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """Where each of the service's volumes lies here: a bind mount's own directory, a named volume's in tmp_path.

    The cache volume is the developer's own cache, so that the CPU kernels built by the other tests are found, as a
    persistent volume finds those of an earlier start.
    """
    cache = os.environ.get("SPINDLE_CACHE_DIR") or str(Path.home() / ".cache" / "spindle")
    dirs = {}
    for target, (source, _) in mounts(service, host_env).items():
        if source.startswith("/"):
            dirs[target] = source
        else:
            dirs[target] = cache if source == "cache" else str(tmp_path / source)
            Path(dirs[target]).mkdir(parents=True, exist_ok=True)
    return dirs


def in_host(value: str, dirs: dict[str, str]) -> str:
    """A container path (or ``ipc://`` address) rewritten to where its volume lies here."""
    scheme = "ipc://" if value.startswith("ipc://") else ""
    path = value.removeprefix(scheme)
    for target, source in dirs.items():
        if path == target or path.startswith(target + "/"):
            return scheme + source + path.removeprefix(target)
    return value


def service_env(service: dict, host_env: dict[str, str], dirs: dict[str, str]) -> dict[str, str]:
    env = {}
    for name, value in service.get("environment", {}).items():
        if value is None:  # compose passes a value-less variable through from the host
            if name in host_env:
                env[name] = in_host(host_env[name], dirs)
        else:
            env[name] = in_host(interpolate(str(value), host_env), dirs)
    return env


class Process:
    """One service's command as a process here, with its environment and volumes where ``host_dirs`` puts them."""

    def __init__(
        self,
        name: str,
        host_env: dict[str, str],
        tmp_path: Path,
        env: dict[str, str] | None = None,
        peers: dict[str, str] | None = None,
    ) -> None:
        """``env`` overrides the service's environment; ``peers`` maps another service's ``name:port`` on the compose
        network, in the command, to where that service's process listens here."""
        self.name = name
        self.service = SERVICES[name]
        self.host_env = host_env
        self.peers = peers or {}
        self.dirs = host_dirs(self.service, host_env, tmp_path)
        # The image's PATH puts the installed `spindle` first; here that is the virtualenv's.
        self.path = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "HOME": os.environ.get("HOME", "/tmp")}
        environment = self.path | service_env(self.service, host_env, self.dirs) | (env or {})
        self.popen = subprocess.Popen(self.argv(self.service["command"]), env=environment, cwd=REPO)

    def argv(self, command: list[str]) -> list[str]:
        args = [in_host(interpolate(arg, self.host_env), self.dirs) for arg in command]
        for peer, address in self.peers.items():
            args = [arg.replace(f"//{peer}", f"//{address}") for arg in args]
        return args

    def healthy(self) -> bool:
        command = self.argv(self.service["healthcheck"]["test"][1:])
        return subprocess.run(command, env=self.path, capture_output=True, cwd=REPO).returncode == 0

    def stop(self) -> int:
        self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(30)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()


def wait_healthy(process: Process, *others: Process) -> None:
    def healthy() -> bool:
        exited = [p.name for p in (process, *others) if p.popen.poll() is not None]
        assert not exited, f"{exited} exited while {process.name} started"
        return process.healthy()

    # Every look runs the service's health check command, a process of its own.
    wait_until(healthy, f"{process.name} is healthy", timeout=120, interval=0.5)


def model_env(tiny_llm_dir: Path) -> dict[str, str]:
    """The host environment of a run that serves the tiny model from a model directory given by SPINDLE_MODEL_DIR."""
    return {
        "SPINDLE_MODEL_DIR": str(tiny_llm_dir.parent),
        "SPINDLE_MODEL": f"/models/{tiny_llm_dir.name}",
        "SPINDLE_PORT": str(free_port()),
        "SPINDLE_KV_CACHE_MEMORY": "4MiB",
    }


def test_the_cpu_profile_serves_a_request_through_plain_processes(tiny_llm_dir, tmp_path):
    host_env = model_env(tiny_llm_dir)
    backend = Process("backend-cpu", host_env, tmp_path)
    frontend = Process("frontend", host_env, tmp_path)
    try:
        wait_healthy(frontend, backend)
        assert backend.healthy()  # its check pings the socket the volume mapping put here
        with SpindleClient(f"localhost:{host_env['SPINDLE_PORT']}", timeout=30) as client:
            tokens = [
                t
                for r in client.generate("compose", temperature=0, max_tokens=5)
                for c in r.choices
                for t in c.token_ids
            ]
            assert len(tokens) == 5
        maps = Path(f"/proc/{frontend.popen.pid}/maps").read_text()
        assert "libtorch" not in maps  # the frontend image needs no torch
        assert frontend.stop() == 0 and backend.stop() == 0
    finally:
        frontend.kill()
        backend.kill()


def test_the_gateway_profile_serves_a_completion_through_plain_processes(tiny_llm_dir, tmp_path):
    """The two workers on ports of their own here (each container has the compose file's), the gateway in front."""
    host_env = model_env(tiny_llm_dir) | {
        "SPINDLE_GATEWAY_PORT": str(free_port()),
        "SPINDLE_GATEWAY_METRICS_PORT": str(free_port()),
    }
    ports = {name: free_port() for name in GATEWAY_WORKERS}
    processes = [
        Process(name, host_env, tmp_path, {"SPINDLE_PORT": str(port), "SPINDLE_METRICS_PORT": str(free_port())})
        for name, port in ports.items()
    ]
    inside = {name: f"{name}:{SERVICES[name]['environment']['SPINDLE_PORT']}" for name in GATEWAY_WORKERS}
    peers = {inside[name]: f"127.0.0.1:{port}" for name, port in ports.items()}
    try:
        processes.append(Process("gateway", host_env, tmp_path, peers=peers))
        wait_healthy(processes[-1], *processes[:-1])  # ready: both workers registered and healthy
        client = openai.OpenAI(base_url=f"http://localhost:{host_env['SPINDLE_GATEWAY_PORT']}/v1", api_key="none")
        (model,) = client.models.list().data
        completion = client.completions.create(model=model.id, prompt="compose", max_tokens=5, temperature=0)
        assert completion.usage.completion_tokens == 5
        assert [process.stop() for process in processes] == [0, 0, 0]
    finally:
        for process in processes:
            process.kill()
