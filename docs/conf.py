"""Sphinx configuration of the Spindle docs (``make docs``; see ``docs/build_docs.py``)."""

import sys
from pathlib import Path
from typing import Union

from docutils.nodes import Element
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.ext.napoleon import _process_docstring

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))

project = "Spindle"
author = "The Spindle authors"
copyright = "2025, The Spindle authors"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.graphviz",
    "sphinx.ext.doctest",
    "flagsdoc",
    "metricsdoc",
    "protodoc",
]

# The docs build in an environment with only docs/requirements.txt: the model side's heavy imports are mocked, so
# autodoc can import the backend modules and read their docstrings (tests/test_docs.py checks the pages are full).
autodoc_mock_imports = ["torch", "triton", "transformers", "safetensors", "gguf", "accelerate", "numpy", "PIL"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_class_signature = "separated"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Resolve every cross-reference, or fail the -W build: a broken link is a docs bug.
nitpicky = True
nitpick_ignore_regex = [
    # Types from mocked, third-party or standard modules that these docs do not host.
    (
        "py:class",
        r"(torch|numpy|zmq|msgspec|tokenizers|argparse|asyncio|enum|subprocess|pathlib|collections\.abc|typing"
        r"|xgrammar|concurrent\.futures|PIL)\..*",
    ),
    # xgrammar's classes, named in annotations only when type-checking (the backend imports xgrammar lazily).
    ("py:class", r"(Future|CompiledGrammar|GrammarCompiler|GrammarMatcher|TokenizerInfo)(\[.*\])?"),
    # The generated protobuf message classes: the gRPC reference page documents them from the .proto files.
    ("py:class", r"spindle\.v1\..*"),
    # Model and kernel internals these pages do not cover.
    ("py:class", r"spindle\.(kernels|backend\.models)\..*"),
    # An attribute that BackendConnection's docstring names but does not document (see the docs report).
    ("py:attr", "socket"),
    ("py:class", r"(Path|Iterable|AsyncIterator|Callable|Sequence|Struct|Namespace|Popen|Tensor)"),
    ("py:class", r"(TypedDict|NotRequired|Any|dict|list|tuple|str|int|float|bool|bytes|object|None)(\[.*\])?"),
]

graphviz_output_format = "svg"

html_theme = "alabaster"
html_title = "Spindle"
html_theme_options = {"description": "An LLM serving engine that ships as a gRPC microservice"}
exclude_patterns = ["_build"]


def _allow_union_with_mocks() -> None:
    # Modules evaluate annotations such as ``torch.device | str`` at import time; a mocked ``torch.device`` must
    # support ``|`` for the import (and so autodoc) to succeed without torch.
    from sphinx.ext.autodoc._dynamic._mock import _MockObject

    _MockObject.__or__ = lambda self, other: Union[self, other]  # noqa: UP007 - a mock is not a type for `|`
    _MockObject.__ror__ = lambda self, other: Union[other, self]  # noqa: UP007


def _resolve_short_names(app: Sphinx, env: BuildEnvironment, node: Element, contnode: Element) -> Element | None:
    """Resolve a partly qualified Python reference (``:class:`SamplingParams```, ``:meth:`GrpcServer.start```).

    It resolves to the one documented object whose qualified name ends with the target.
    """
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or not target:
        return None
    domain = env.domains["py"]
    # Skip the canonical aliases autodoc adds (``spindle.shared.sampling_params.SamplingParams`` for
    # ``spindle.shared.SamplingParams``).
    matches = [name for name, obj in domain.objects.items() if name.endswith("." + target) and not obj.aliased]
    if len(matches) != 1:
        return None
    return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], matches[0], node, contnode)


def _napoleon_except_attributes(app: Sphinx, what: str, name: str, obj: object, options: object, lines: list) -> None:
    # Napoleon reads the first line of an attribute, property or data docstring as ``type: description``, so
    # "Bytes of one block: 2 x ..." would render "Bytes of one block" as a type. Our docstrings never use that
    # form: only functions, classes and modules go through napoleon.
    if what not in ("attribute", "property", "data"):
        _process_docstring(app, what, name, obj, options, lines)


def setup(app: Sphinx) -> None:
    """Hook the mock fix in before autodoc imports anything, the short-name resolver and napoleon's filter."""
    _allow_union_with_mocks()
    app.connect("missing-reference", _resolve_short_names)
    for listener in list(app.events.listeners["autodoc-process-docstring"]):
        if listener.handler is _process_docstring:
            app.disconnect(listener.id)
    app.connect("autodoc-process-docstring", _napoleon_except_attributes)
