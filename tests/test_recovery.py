"""A backend that comes back: an owned backend restarted after SIGKILL or a hang, a remote one reconnected to, the
backend probe (``spindle backend --check``), a step loop stuck while the heartbeats go on, and JSON logs that name
each request."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import msgspec
import pytest
from stuck_model import ARCHITECTURE as STUCK_ARCHITECTURE
from stuck_model import STUCK_TOKEN
from test_grpc import LONG, REPO, ServerThread, callers_id, collect, refusal, tiny_config
from test_lora_api import save_adapter
from test_process_split import (
    peer,
    private_tmp,  # noqa: F401 - a fixture: short ipc paths, cleaned up
    run_engine,
)
from waiting import SLACK, wait_until

from spindle import LoRARequest, SamplingParams
from spindle.client import SpindleClient
from spindle.frontend.engine.connection import BackendConnection, EngineDeadError, ping_backend
from spindle.shared.errors import InvalidRequestError
from spindle.shared.protocol import (
    FRONTEND_TIMEOUT,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    PROTOCOL_VERSION,
    BackendMessage,
    Call,
    EngineRequest,
    Hello,
    ListLoras,
    RequestErrorKind,
)
from spindle.v1 import spindle_pb2

SPINDLE = str(REPO / ".venv" / "bin" / "spindle")
TINY_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "4MiB"]
DETECTION = HEARTBEAT_TIMEOUT + SLACK  # the silence that declares a backend dead (an owned one's exit is seen sooner)
RECOVERY = 45.0  # a restart waits 1 s (2 s for the second), then the tiny model loads in a few seconds


def wait_for_health(client: SpindleClient, status: str, timeout: float) -> None:
    wait_until(lambda: client.health() == status, f"health is {status}", timeout)


def generated_text(client: SpindleClient, **kwargs) -> str:
    choices, _ = collect(client.generate("hello", temperature=0, max_tokens=4, **kwargs))
    return choices[0]["text"]


def assert_fast_unavailable(client: SpindleClient, message: str) -> None:
    """A request while the backend is down fails at once with UNAVAILABLE, saying what is being done about it."""
    start = time.monotonic()
    error = refusal(lambda: client.generate("while down"))
    assert time.monotonic() - start < SLACK  # not held until a backend is back, nor until the 30 s deadline
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "backend is down" in error.details()
    assert message in error.details(), error.details()


@pytest.fixture
def owned_server(tiny_llm_dir, private_tmp, monkeypatch):  # noqa: F811 - private_tmp is the imported fixture
    """A server whose engine started its own backend child, as ``spindle serve`` without ``--backend-address``."""
    monkeypatch.setattr(
        "spindle.frontend.engine.async_llm_engine.EngineConfig",
        SimpleNamespace(of=lambda **kwargs: tiny_config(tiny_llm_dir, **kwargs)),
    )
    server = ServerThread(None)
    yield server
    server.close()


def adapter_tokens(server: ServerThread, lora_request: LoRARequest) -> int:
    """The tokens of a 4-token request through the engine's Python API with ``lora_request`` (loaded on first use)."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run() -> int:
        async for output in server.engine.generate("hello", params, lora_request=lora_request):
            last = output
        return len(last.outputs[0].token_ids)

    return server.run(run())


def test_a_killed_backend_that_the_server_started_is_restarted(owned_server, tiny_llm_dir, tmp_path):
    engine = owned_server.engine
    save_adapter(tiny_llm_dir, tmp_path / "sql", seed=1)
    adapter = LoRARequest("sql", 1, str(tmp_path / "sql"))
    with owned_server.client(timeout=30) as client:
        assert generated_text(client)
        assert adapter_tokens(owned_server, adapter) == 4  # loads the adapter into this backend
        running = client.generate("in flight", **LONG)
        next(running)
        old = engine.client.connection.process.pid
        os.kill(old, signal.SIGKILL)
        wait_for_health(client, "NOT_SERVING", DETECTION)
        assert_fast_unavailable(client, "a new backend is starting, attempt")
        wait_for_health(client, "SERVING", RECOVERY)
        choices, _ = collect(running)  # paused while no backend served, then resumed on the new one (test_resume)
        assert choices[0]["finish"] == [(spindle_pb2.FINISH_REASON_LENGTH, None)]
        assert generated_text(client)
        assert adapter_tokens(owned_server, adapter) == 4  # the new backend had none: the request loaded it again
    assert engine.num_backend_restarts == 1 and engine.client.connection.process.pid != old
    assert engine.num_resumed_requests == 1


def test_a_hung_backend_is_detected_killed_and_replaced(owned_server):
    engine = owned_server.engine
    hung = engine.client.connection.process.pid
    try:
        with owned_server.client(timeout=30) as client:
            os.kill(hung, signal.SIGSTOP)  # alive, but silent: only the heartbeats can tell
            stopped = time.monotonic()
            wait_for_health(client, "NOT_SERVING", DETECTION)
            # Not sooner than the heartbeat timeout after the last heartbeat, which came at most an interval ago.
            assert time.monotonic() - stopped > HEARTBEAT_TIMEOUT - HEARTBEAT_INTERVAL - 0.1
            wait_for_health(client, "SERVING", RECOVERY)
            assert generated_text(client)
        assert engine.num_backend_restarts == 1
        with pytest.raises(ProcessLookupError):  # SIGKILLed (a stopped process acts on no other signal) and reaped
            os.kill(hung, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGCONT)
            os.kill(hung, signal.SIGKILL)


def start_remote_backend(model_dir: Path, address: str, *flags: str) -> subprocess.Popen:
    """``spindle backend`` on ``address`` with ``flags``, as its own container would run it.

    It imports modules from here (:mod:`stuck_model`), as a container's image would have them installed.
    """
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    argv = [SPINDLE, "backend", "--listen", address, "--model", str(model_dir), *TINY_FLAGS, *flags]
    return subprocess.Popen(argv, env=env)


def answering(address: str) -> bool:
    """Whether a backend answers at ``address`` within half a second."""
    try:
        ping_backend(address, 0.5)
    except EngineDeadError:
        return False
    return True


def check(address: str, timeout: float) -> subprocess.CompletedProcess:
    """``spindle backend --check ADDRESS``, the backend container's health probe."""
    command = [SPINDLE, "backend", "--check", address, "--check-timeout", str(timeout)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_a_remote_backend_that_comes_back_is_reconnected_to(tiny_llm_dir, private_tmp):  # noqa: F811
    address = f"ipc://{private_tmp}/run/engine.sock"
    backends = [start_remote_backend(tiny_llm_dir, address)]
    server = None
    try:
        wait_until(lambda: answering(address), f"a backend answers at {address}", interval=0)
        server = ServerThread(address)
        with server.client(timeout=30) as client:
            assert generated_text(client)
            probe = check(address, 5)  # the probe leaves the serving frontend's session alone
            assert probe.returncode == 0 and probe.stdout.startswith("spindle: backend UP"), probe
            assert generated_text(client) and not server.engine.is_dead
            backends[0].kill()
            backends[0].wait()
            wait_for_health(client, "NOT_SERVING", DETECTION)
            assert_fast_unavailable(client, "reconnecting, attempt")
            probe = check(address, 1)
            assert probe.returncode == 1 and probe.stderr.startswith("spindle: backend DOWN"), probe
            backends.append(start_remote_backend(tiny_llm_dir, address))
            wait_for_health(client, "SERVING", RECOVERY)
            assert generated_text(client)
        assert server.engine.num_backend_restarts == 1
    finally:
        if server is not None:
            server.close()
        for backend in backends:
            backend.kill()
            backend.wait()


def test_a_standalone_backend_confines_lora_paths_whatever_the_frontend_asks(tiny_llm_dir, tmp_path, private_tmp):  # noqa: F811
    lora_dir = tmp_path / "adapters"
    save_adapter(tiny_llm_dir, lora_dir / "sql", seed=1)
    save_adapter(tiny_llm_dir, tmp_path / "elsewhere", seed=2)
    address = f"ipc://{private_tmp}/run/engine.sock"
    backend = start_remote_backend(tiny_llm_dir, address, "--allow-runtime-lora", "--lora-dir", str(lora_dir))

    async def scenario(engine):
        # Unconfined, as the Python API asks; the backend, not started by this frontend, confines it anyway.
        with pytest.raises(InvalidRequestError, match="outside the server's adapter directory"):
            await engine.load_lora("elsewhere", str(tmp_path / "elsewhere"))
        return await engine.load_lora("sql", "sql")

    try:
        wait_until(lambda: answering(address), f"a backend answers at {address}", interval=0)
        assert run_engine(address, scenario).path == str(lora_dir / "sql")
    finally:
        backend.kill()
        backend.wait()


STEP_TIMEOUT = 3.0  # seconds: a tiny model's step takes milliseconds


@pytest.fixture
def stuck_llm_dir(tiny_llm_dir: Path, tmp_path: Path) -> Path:
    """The tiny Llama served by :class:`stuck_model.StuckLlamaForCausalLM`."""
    path = shutil.copytree(tiny_llm_dir, tmp_path / "stuck")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": [STUCK_ARCHITECTURE]}))
    return path


def hung(connection: BackendConnection) -> str | None:
    """Why ``connection`` finds its backend dead once it has read what the backend sent; ``None`` while it lives."""
    while connection.sync_socket.poll(0):
        connection.decode(connection.sync_socket.recv())
    try:
        connection.check_alive()
    except EngineDeadError as dead:
        return str(dead)
    return None


def test_a_stuck_step_is_detected_while_the_heartbeats_go_on(stuck_llm_dir, private_tmp):  # noqa: F811
    address = f"ipc://{private_tmp}/run/engine.sock"
    register = f"{STUCK_ARCHITECTURE}=stuck_model:{STUCK_ARCHITECTURE}"
    backend = start_remote_backend(
        stuck_llm_dir, address, "--step-timeout", str(STEP_TIMEOUT), "--register-model", register
    )
    connection = None
    try:
        wait_until(lambda: answering(address), f"a backend answers at {address}", interval=0)
        connection = BackendConnection(address)
        connection.add_request(EngineRequest("stuck", [STUCK_TOKEN, 4, 5], SamplingParams(max_tokens=4), time.time()))
        sent = time.monotonic()
        reason = wait_until(lambda: hung(connection), "the frontend declares the backend dead", STEP_TIMEOUT + SLACK)
        # Hung, as the heartbeats tell: not silent, which would say "has not answered".
        assert "is hung: its step loop has been in one step for" in reason
        assert time.monotonic() - sent > STEP_TIMEOUT
        probe = check(address, 5)  # the container's health check fails: the platform replaces the backend
        assert probe.returncode == 1 and "spindle: backend HUNG" in probe.stderr, probe
        assert "over its step_timeout of 3 s" in probe.stderr
    finally:
        if connection is not None:
            connection.close()
        backend.kill()
        backend.wait()


def test_a_frontend_the_backend_forgot_is_dead_at_the_first_refusal(tiny_llm_dir, private_tmp):  # noqa: F811
    """A frontend stalled past ``FRONTEND_TIMEOUT`` (a long call holding the GIL) lost its session and its requests.

    The backend's refusals of what it sends next say so, and must not pass for signs of life: the frontend's
    connection is dead at the first one, so that its supervisor reconnects and its streams are resumed.
    """
    address = f"ipc://{private_tmp}/run/engine.sock"
    backend = start_remote_backend(tiny_llm_dir, address)
    silent = None
    try:
        wait_until(lambda: answering(address), f"a backend answers at {address}", interval=0)
        silent = peer(address, None)  # a frontend that handshakes, then sends no heartbeat
        encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(BackendMessage)
        silent.send(encoder.encode(Hello(PROTOCOL_VERSION)))
        assert silent.poll(SLACK * 1000)
        silent.recv()  # Ready

        # Heartbeats come every HEARTBEAT_INTERVAL while the backend knows this frontend, and stop once it forgot it.
        deadline = time.monotonic() + FRONTEND_TIMEOUT + SLACK
        while silent.poll(4 * HEARTBEAT_INTERVAL * 1000):
            silent.recv()
            assert time.monotonic() < deadline, "the backend did not forget a frontend that sends nothing"
        silent.send(encoder.encode(Call("c", ListLoras())))
        assert silent.poll(SLACK * 1000)
        payload = silent.recv()
        assert decoder.decode(payload).error.kind is RequestErrorKind.NO_SESSION
        connection = BackendConnection(address)
        try:
            assert connection.dead is None
            connection.decode(payload)
            with pytest.raises(EngineDeadError, match="no longer has a session with this frontend"):
                connection.check_alive()
        finally:
            connection.close()
    finally:
        if silent is not None:
            silent.close()
        backend.kill()
        backend.wait()


PROBE_WITHOUT_TORCH = """
import sys
from spindle.cli import main
code = main(["backend", "--check", sys.argv[1], "--check-timeout", "0.5"])
print("torch" in sys.modules)
sys.exit(code)
"""


def test_the_backend_probe_fails_on_a_dead_address_without_loading_torch(private_tmp):  # noqa: F811
    address = f"ipc://{private_tmp}/nobody/engine.sock"
    probe = subprocess.run(
        [sys.executable, "-c", PROBE_WITHOUT_TORCH, address], capture_output=True, text=True, timeout=60
    )
    assert probe.returncode == 1 and probe.stdout == "False\n"
    assert probe.stderr == f"spindle: backend DOWN: no backend answered at {address} within 0.5 s\n"


@contextlib.contextmanager
def serve_logging_to(log: Path, model_dir: Path, log_format: str) -> Iterator[SpindleClient]:
    """``spindle serve`` on ``model_dir``, its log (and its backend's) written to ``log``: a client of it.

    On exit the server gets SIGTERM and must stop cleanly, so that every line is in ``log``.
    """
    env = {**os.environ, "SPINDLE_MODEL": str(model_dir), "SPINDLE_KV_CACHE_MEMORY": "4MiB", "SPINDLE_PORT": "0"}
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [SPINDLE, "serve", "--dtype", "float32", "--log-format", log_format],
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        port = int(process.stdout.readline().rsplit(":", 1)[1])
        with SpindleClient(f"127.0.0.1:{port}", timeout=60) as client:
            yield client
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_json_logs_parse_line_by_line_and_name_the_request(tiny_llm_dir, tmp_path, private_tmp):  # noqa: F811
    log = tmp_path / "serve.log"
    with serve_logging_to(log, tiny_llm_dir, "json") as client:
        assert generated_text(client, request_id="json-1")
        cancelled = client.generate("cancel me", request_id="json-2", **LONG)
        next(cancelled)
        cancelled.cancel()
        with pytest.raises(grpc.RpcError):
            list(cancelled)
    entries = [json.loads(line) for line in log.read_text().splitlines()]  # every line, of both processes
    assert all({"timestamp", "level", "logger", "message"} <= entry.keys() for entry in entries)
    about_requests = [
        # The server names a request by the caller's id under its connection's digest.
        (re.match(r"Request \w+", e["message"])[0], callers_id(e.get("request_id", "")))
        for e in entries
        if e["message"].startswith("Request ")
    ]
    assert about_requests == [("Request finished", "json-1"), ("Request aborted", "json-2")], entries
    assert any(entry["logger"].startswith("spindle.backend.") for entry in entries)  # the child logs JSON too
