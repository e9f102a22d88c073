"""Out-of-tree architectures: registered by class or by "module:Class", served in-process and by a backend process.

The architecture is tests/registered_model.py's ``SignedLlamaForCausalLM``: the tiny random Llama with its logits
multiplied by ``logit_sign`` from its config.json, -1 here, so greedy decoding follows transformers' *argmin*.
"""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from registered_model import ARCHITECTURE, SignedLlamaForCausalLM

from spindle import LLM, ModelRegistry, SamplingParams
from spindle.backend.models import CheckpointConfig, model_class
from spindle.frontend.engine.connection import start_backend
from spindle.shared.config import EngineConfig

PROMPTS = [[5, 17, 99, 3], [200, 8]]
MAX_TOKENS = 6


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from the built-in architectures alone, and leaves the process-wide registry as it was."""
    monkeypatch.setattr(ModelRegistry, "_registered", {})
    monkeypatch.setattr(ModelRegistry, "_classes", {})
    monkeypatch.setattr(ModelRegistry, "_plugins", None)


@pytest.fixture(scope="module")
def signed_dir(tiny_llm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with its tokenizer, its config.json naming ``SignedLlamaForCausalLM`` and ``logit_sign: -1``."""
    path = tmp_path_factory.mktemp("tiny-signed")
    for file in tiny_llm_dir.iterdir():
        shutil.copy(file, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": [ARCHITECTURE], "logit_sign": -1}))
    return path


def greedy(model: transformers.PreTrainedModel, prompt: list[int], pick: str) -> list[int]:
    """``MAX_TOKENS`` tokens after ``prompt``, each the ``argmin`` or ``argmax`` of transformers' logits."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            token = getattr(model(ids).logits[0, -1], pick)()
            ids = torch.cat([ids, token.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def argmin_paths(tiny_llama_dir: Path) -> list[list[int]]:
    """What the signed model must generate: transformers' plain Llama, least likely token first."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    paths = [greedy(model, prompt, "argmin") for prompt in PROMPTS]
    assert paths != [greedy(model, prompt, "argmax") for prompt in PROMPTS]  # else the check below proves nothing
    return paths


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_a_class_registered_in_process_serves_its_architecture(signed_dir, argmin_paths):
    ModelRegistry.register_model(ARCHITECTURE, SignedLlamaForCausalLM)
    assert ARCHITECTURE in ModelRegistry.get_supported_archs()
    assert CheckpointConfig.from_dir(signed_dir).hf_config["logit_sign"] == -1
    assert generate(LLM(str(signed_dir), dtype="float32", kv_cache_memory="4MiB")) == argmin_paths


def test_a_module_class_string_reaches_a_backend_process(signed_dir, argmin_paths):
    # Lazy: nothing is imported here; the backend imports the module from the tests folder, on this process's path.
    ModelRegistry.register_model(ARCHITECTURE, "registered_model:SignedLlamaForCausalLM")
    llm = LLM(str(signed_dir), multiprocess=True, dtype="float32", kv_cache_memory="4MiB")
    assert generate(llm) == argmin_paths


def test_an_unknown_architecture_names_every_served_one(signed_dir):
    ModelRegistry.register_model(ARCHITECTURE, SignedLlamaForCausalLM)
    config = json.loads((signed_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'") as error:
        CheckpointConfig.from_dict({**config, "architectures": ["GPT2LMHeadModel"]})
    assert all(name in str(error.value) for name in ("LlamaForCausalLM", "Qwen2ForCausalLM", ARCHITECTURE))


def test_a_registered_architecture_still_needs_the_fields_the_engine_reads(signed_dir):
    ModelRegistry.register_model(ARCHITECTURE, SignedLlamaForCausalLM)
    config = json.loads((signed_dir / "config.json").read_text())
    del config["num_hidden_layers"]
    with pytest.raises(ValueError, match=f"{ARCHITECTURE} lacks num_hidden_layers"):
        CheckpointConfig.from_dict(config)


@pytest.mark.parametrize("target", ["registered_model.SignedLlamaForCausalLM", "registered_model:", "a b:C", ""])
def test_a_malformed_string_is_refused_when_registered(target):
    with pytest.raises(ValueError, match=f"cannot register architecture 'Custom' as '{target}'"):
        ModelRegistry.register_model("Custom", target)
    assert "Custom" not in ModelRegistry.get_supported_archs()


@pytest.mark.parametrize(
    "target, error, reason",
    [
        ("no_such_module_for_spindle:Model", ImportError, "which cannot be imported: No module named"),
        ("registered_model:NoSuchClass", ImportError, "which cannot be imported: .* has no attribute 'NoSuchClass'"),
        ("registered_model:ARCHITECTURE", TypeError, "which is a str, not a class"),
        (
            "collections:OrderedDict",
            TypeError,
            "which lacks forward, compute_logits, load_weights, prepare_weights, eval",
        ),
    ],
)
def test_a_string_that_does_not_name_a_model_class_fails_at_load_naming_both(target, error, reason):
    ModelRegistry.register_model("Custom", target)  # accepted: nothing is imported before a model is loaded
    with pytest.raises(error, match=f"architecture 'Custom' is served by '{target}', {reason}"):
        model_class("Custom")


def test_registrations_travel_as_flags_and_come_back_from_them(monkeypatch):
    ModelRegistry.register_model(ARCHITECTURE, SignedLlamaForCausalLM)
    ModelRegistry.register_model("OtherForCausalLM", "pkg.models:Other")
    flags = ModelRegistry.backend_args()
    assert flags == [
        "--register-model",
        f"{ARCHITECTURE}=registered_model:SignedLlamaForCausalLM",
        "--register-model",
        "OtherForCausalLM=pkg.models:Other",
    ]
    monkeypatch.setattr(ModelRegistry, "_registered", {})  # as a backend process starts: no registration, no class
    monkeypatch.setattr(ModelRegistry, "_classes", {})
    ModelRegistry.register_models(flags[1::2])
    assert ModelRegistry.get_model_cls_target("OtherForCausalLM") == "pkg.models:Other"
    assert model_class(ARCHITECTURE) is SignedLlamaForCausalLM
    with pytest.raises(ValueError, match="'Broken' is not ARCH=module:Class"):
        ModelRegistry.register_models(["Broken"])


def test_a_class_that_another_process_cannot_import_is_not_forwarded():
    class LocalLlama(SignedLlamaForCausalLM):
        pass

    ModelRegistry.register_model("LocalForCausalLM", LocalLlama)
    assert model_class("LocalForCausalLM") is LocalLlama  # in this process the class object serves
    with pytest.raises(ValueError, match="'LocalForCausalLM' is served by .*<locals>.*cannot import"):
        start_backend(EngineConfig())


def test_a_plugin_entry_point_is_found_and_a_registration_overrides_it(tmp_path, monkeypatch):
    dist_info = tmp_path / "spindle_test_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: spindle-test-plugin\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(
        "[spindle.models]\nPluginLlamaForCausalLM = registered_model:SignedLlamaForCausalLM\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "PluginLlamaForCausalLM" in ModelRegistry.get_supported_archs()
    assert model_class("PluginLlamaForCausalLM") is SignedLlamaForCausalLM
    assert ModelRegistry.backend_args() == []  # a backend finds the plugin itself
    ModelRegistry.register_model("PluginLlamaForCausalLM", "spindle.backend.models.llama:LlamaForCausalLM")
    assert model_class("PluginLlamaForCausalLM").__name__ == "LlamaForCausalLM"


def test_registering_and_forwarding_import_no_torch():
    code = textwrap.dedent(
        """
        import sys
        import spindle
        registry = spindle.ModelRegistry
        registry.register_model("MyForCausalLM", "my_models.tiny:MyForCausalLM")
        import spindle.frontend.cli, spindle.frontend.engine.connection
        assert "MyForCausalLM" in registry.get_supported_archs()
        assert registry.backend_args() == ["--register-model", "MyForCausalLM=my_models.tiny:MyForCausalLM"]
        print(sorted(m for m in ("torch", "transformers", "my_models") if m in sys.modules))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
