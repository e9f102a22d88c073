"""Spindle's disk caches (converted GGUF models, the CPU kernels' library): an entry is trusted only when complete.

An entry left incomplete (a builder killed mid-write, a file cut short since, an entry of the old layout with no
marker) or foreign (another CPU, another version) is rebuilt; two builders of one entry build it once.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from waiting import wait_until

from spindle.backend.models import loader
from spindle.kernels import cache_entry, cpu
from spindle.kernels.cache_entry import MARKER, build_entry, is_complete

INPUTS = "0123abcd"

# A builder in its own process: writes half of its file, says so, and waits for its death.
KILLED_BUILDER = """
import sys, time
from pathlib import Path
from spindle.kernels.cache_entry import build_entry

def build(out: Path) -> None:
    (out / "weights").write_bytes(b"x" * 1000)
    Path(sys.argv[2]).touch()
    time.sleep(600)

build_entry(Path(sys.argv[1]), "0123abcd", build)
"""

# Two of these build one entry at once; each build records its process and takes a while, so that they overlap.
RACING_BUILDER = """
import os, sys, time
from pathlib import Path
from spindle.kernels.cache_entry import build_entry

def build(out: Path) -> None:
    with open(sys.argv[2], "a") as log:
        log.write(f"{os.getpid()}\\n")
    time.sleep(2)
    (out / "weights").write_bytes(b"x" * 1000)

build_entry(Path(sys.argv[1]), "0123abcd", build)
"""


def write_weights(out: Path) -> None:
    (out / "weights").write_bytes(b"x" * 1000)


def test_a_built_entry_is_complete_and_not_built_again(tmp_path):
    entry = tmp_path / "entry"
    build_entry(entry, INPUTS, write_weights)
    assert is_complete(entry, INPUTS)
    assert json.loads((entry / MARKER).read_text())["files"] == {"weights": 1000}
    build_entry(entry, INPUTS, lambda out: pytest.fail("a complete entry was built again"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".entry.lock", "entry"]  # no scratch left behind


def test_the_same_content_shares_its_entry_and_other_content_gets_its_own(gguf_file):
    path, converted = gguf_file
    path.write_bytes(b"GGUF" + bytes(range(256)) * 2**13)  # 2 MiB: data past the hashed header
    model_dir = loader.resolve_model(str(path))
    reinstalled = path.with_name("again") / path.name
    reinstalled.parent.mkdir()
    shutil.copyfile(path, reinstalled)  # a fresh copy, dated now: as a new virtualenv installs the package
    os.utime(reinstalled, ns=(1, 1))
    assert loader.resolve_model(str(reinstalled)) == model_dir and len(converted) == 1
    data = bytearray(path.read_bytes())
    data[len(data) * 3 // 4] ^= 1  # one byte of tensor data, at one of the sampled places
    path.write_bytes(data)
    assert loader.resolve_model(str(path)) != model_dir and len(converted) == 2


@pytest.mark.parametrize(
    "damage",
    [
        lambda entry: (entry / MARKER).unlink(),  # killed between the files and the marker (or an old layout)
        lambda entry: (entry / "weights").write_bytes(b"x" * 10),  # a file cut short
        lambda entry: (entry / "weights").unlink(),
        lambda entry: (entry / MARKER).write_text('{"inputs": "01'),  # the marker itself cut short
    ],
)
def test_a_damaged_entry_is_rebuilt(tmp_path, damage):
    entry = tmp_path / "entry"
    build_entry(entry, INPUTS, write_weights)
    damage(entry)
    assert not is_complete(entry, INPUTS)
    build_entry(entry, INPUTS, write_weights)
    assert is_complete(entry, INPUTS) and (entry / "weights").stat().st_size == 1000


def test_an_entry_of_other_inputs_or_another_version_is_foreign(tmp_path, monkeypatch):
    entry = tmp_path / "entry"
    build_entry(entry, INPUTS, write_weights)
    assert not is_complete(entry, "ffff")
    monkeypatch.setattr(cache_entry, "spindle_version", lambda: "999.0")
    assert not is_complete(entry, INPUTS)


def test_a_builder_killed_mid_write_leaves_nothing_trusted(tmp_path):
    entry, started = tmp_path / "entry", tmp_path / "started"
    builder = subprocess.Popen([sys.executable, "-c", KILLED_BUILDER, str(entry), str(started)])
    try:
        wait_until(started.exists, "the builder has written half of its entry")
    finally:
        builder.send_signal(signal.SIGKILL)
        builder.wait()
    assert not entry.exists() and not is_complete(entry, INPUTS)
    build_entry(entry, INPUTS, write_weights)  # the dead builder's lock is free, its scratch directory cleared
    assert is_complete(entry, INPUTS)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".entry.lock", "entry", "started"]


def test_two_builders_at_once_build_the_entry_once(tmp_path):
    entry, log = tmp_path / "entry", tmp_path / "builds"
    builders = [subprocess.Popen([sys.executable, "-c", RACING_BUILDER, str(entry), str(log)]) for _ in range(2)]
    assert [builder.wait(timeout=120) for builder in builders] == [0, 0]
    assert len(log.read_text().split()) == 1
    assert is_complete(entry, INPUTS)


@pytest.fixture
def gguf_file(tmp_path, monkeypatch) -> tuple[Path, list[Path]]:
    """A GGUF file (any bytes: the conversion is replaced), a fresh cache, and the directories converted into."""
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path / "cache"))
    converted = []

    def convert(gguf_file: Path, out_dir: Path) -> None:
        converted.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"w" * 4096)

    monkeypatch.setattr(loader, "_convert_gguf", convert)
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    return path, converted


def test_a_gguf_file_is_converted_once(gguf_file):
    path, converted = gguf_file
    model_dir = loader.resolve_model(str(path))
    assert loader.resolve_model(str(path)) == model_dir and len(converted) == 1
    assert (model_dir / "model.safetensors").stat().st_size == 4096


@pytest.mark.parametrize(
    "damage",
    [
        lambda model_dir: (model_dir / MARKER).unlink(),  # as the old cache left it: config.json, no marker
        lambda model_dir: os.truncate(model_dir / "model.safetensors", 100),
    ],
)
def test_a_truncated_converted_model_is_converted_again(gguf_file, damage):
    path, converted = gguf_file
    model_dir = loader.resolve_model(str(path))
    damage(model_dir)
    assert loader.resolve_model(str(path)) == model_dir and len(converted) == 2
    assert (model_dir / "model.safetensors").stat().st_size == 4096


@pytest.mark.parametrize(
    "feature,changes_key",
    [
        ("avx2", True),
        ("avx512_f", True),
        ("avx512_bf16", True),
        ("avx512_vnni", True),
        ("amx_tile", True),
        ("num_logical_cores", False),  # not an instruction set: the same library serves any core count
        ("l2_cache_size", False),
    ],
)
def test_the_kernel_cache_key_holds_the_instruction_sets(monkeypatch, feature, changes_key):
    capabilities = torch.cpu.get_capabilities()
    here = cpu.cache_key()
    value = capabilities[feature]
    flipped = not value if isinstance(value, bool) else value + 1  # bool first: it is an int too
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {**capabilities, feature: flipped})
    assert (cpu.cache_key() != here) == changes_key


def commit_library(cache: Path, key: str, library: bytes) -> None:
    """Commit a kernel cache entry for ``key`` holding ``library`` as the compiled extension."""
    build_entry(
        cache / "kernels" / f"spindle_cpu_ops-{key[:16]}",
        key,
        lambda out: (out / "spindle_cpu_ops.so").write_bytes(library),
    )


@pytest.mark.parametrize("whose", ["this CPU's", "another CPU's"])
def test_a_kernel_library_is_loaded_only_on_the_cpu_it_was_built_for(tmp_path, monkeypatch, caplog, whose):
    """A cached library of this CPU's key is loaded (here garbage: it fails to load, and is built again), one of a
    CPU with other instruction sets is not even opened; the build then fails here, with no compiler."""
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    key = cpu.cache_key()
    if whose == "another CPU's":
        capabilities = torch.cpu.get_capabilities()
        with monkeypatch.context() as patch:
            patch.setattr(torch.cpu, "get_capabilities", lambda: {**capabilities, "avx2": not capabilities["avx2"]})
            key = cpu.cache_key()
    commit_library(tmp_path, key, b"not an ELF library")
    with pytest.raises(Exception, match="no-such-compiler|Error building extension"):
        cpu.cpu_ops.__wrapped__()
    loaded = "could not be loaded" in caplog.text
    assert loaded == (whose == "this CPU's"), caplog.text


def test_a_build_after_a_failed_one_in_the_same_process_is_committed_and_loads(tmp_path, monkeypatch):
    """torch names a process' second build of an extension ``<name>_v1`` (its build directory differs): the library
    is cached under the name it was built with and imported under it. A one-function source keeps the builds short."""
    source = tmp_path / "tiny.cpp"
    source.write_text(
        "#include <pybind11/pybind11.h>\n"
        'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", [] { return 42; }); }\n'
    )
    monkeypatch.setattr(cpu, "_SOURCES", [source])
    monkeypatch.setattr(cpu, "_HEADERS", [])
    with monkeypatch.context() as patch:
        patch.setenv("SPINDLE_CACHE_DIR", str(tmp_path / "failed"))
        patch.setenv("CXX", str(tmp_path / "no-such-compiler"))
        with pytest.raises(Exception, match="no-such-compiler|Error building extension"):
            cpu.cpu_ops.__wrapped__()
    monkeypatch.setenv("SPINDLE_CACHE_DIR", str(tmp_path / "cache"))
    assert cpu.cpu_ops.__wrapped__().answer() == 42
    [entry] = (tmp_path / "cache" / "kernels").glob("spindle_cpu_ops-*")
    assert is_complete(entry, cpu.cache_key())
    assert cpu._load(entry).answer() == 42
