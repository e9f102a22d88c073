"""docker-compose.yml without Docker: each service's command runs as a plain process with its environment."""

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import yaml

from spindle.client import SpindleClient

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = REPO / ".venv" / "bin"


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR:-default}`` and ``${VAR}`` substitution."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: env.get(m.group(1)) or m.group(2) or "", value)


def service_env(service: dict, host_env: dict[str, str]) -> dict[str, str]:
    env = {}
    for name, value in service.get("environment", {}).items():
        if value is None:  # compose passes a value-less variable through from the host
            if name in host_env:
                env[name] = host_env[name]
        else:
            env[name] = interpolate(str(value), host_env)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(service: dict, host_env: dict[str, str]) -> subprocess.Popen:
    # The image's PATH puts the installed `spindle` first; here that is the virtualenv's.
    env = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "HOME": os.environ.get("HOME", "/tmp")}
    env |= service_env(service, host_env)
    return subprocess.Popen([interpolate(arg, host_env) for arg in service["command"]], env=env, cwd=REPO)


def healthy(service: dict, host_env: dict[str, str]) -> bool:
    command = [interpolate(arg, host_env) for arg in service["healthcheck"]["test"][1:]]
    env = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(command, env=env, capture_output=True, cwd=REPO).returncode == 0


def test_the_cpu_profile_serves_a_request_through_plain_processes(tiny_llm_dir, tmp_path):
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert services["backend"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert services["backend-cpu"]["environment"]["SPINDLE_DEVICE"] == "cpu"
    host_env = {
        "SPINDLE_ENGINE_SOCKET": f"ipc://{tmp_path}/run/engine.sock",
        "SPINDLE_PORT": str(free_port()),
        "SPINDLE_MODEL": str(tiny_llm_dir),
        "SPINDLE_KV_CACHE_MEMORY": "4MiB",
    }
    backend = start(services["backend-cpu"], host_env)
    frontend = start(services["frontend"], host_env)
    try:
        deadline = time.monotonic() + 120
        while not healthy(services["frontend"], host_env):
            assert time.monotonic() < deadline and frontend.poll() is None and backend.poll() is None
            time.sleep(0.5)
        with SpindleClient(f"localhost:{host_env['SPINDLE_PORT']}", timeout=30) as client:
            tokens = [
                t
                for r in client.generate("compose", temperature=0, max_tokens=5)
                for c in r.choices
                for t in c.token_ids
            ]
            assert len(tokens) == 5
        maps = Path(f"/proc/{frontend.pid}/maps").read_text()
        assert "libtorch" not in maps  # the frontend image needs no torch
        for process in (frontend, backend):
            process.send_signal(signal.SIGTERM)
        assert frontend.wait(30) == 0 and backend.wait(30) == 0
    finally:
        for process in (frontend, backend):
            if process.poll() is None:
                process.kill()
