"""``.. engine-flags::``: the table of ``spindle`` flags and environment variables, read from ``backend.config``.

The rows come from the argparse parsers that ``spindle serve`` and ``spindle backend`` build, and each engine flag's
meaning from the ``Attributes`` section of :class:`backend.config.EngineConfig`, so the table cannot fall behind
the code. Defaults are read with no ``SPINDLE_*`` variable set, so the builder's environment does not leak in.
"""

import argparse
import inspect
import os
import re
from dataclasses import MISSING, fields
from unittest import mock

from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective


def _attribute_docs(cls: type) -> dict[str, str]:
    """``name -> description`` from a Google-style ``Attributes:`` section (continuation lines joined)."""
    docs: dict[str, str] = {}
    section = inspect.getdoc(cls).split("Attributes:", 1)[1]
    for name, text in re.findall(r"^    (\w+): (.*(?:\n        .*)*)", section, re.MULTILINE):
        docs[name] = " ".join(text.split())
    return docs


def flag_rows() -> list[tuple[str, str, str, str]]:
    """``(flag, environment variable, default, meaning)`` for every engine flag, then the backend-only ones."""
    from backend.config import EngineConfig, add_backend_args, add_engine_args

    with mock.patch.dict(os.environ, {k: v for k, v in os.environ.items() if not k.startswith("SPINDLE_")}, clear=True):
        engine, backend = argparse.ArgumentParser(), argparse.ArgumentParser()
        add_engine_args(engine)
        add_backend_args(backend)
    meanings = _attribute_docs(EngineConfig)
    rows = []
    for config_field in fields(EngineConfig):
        default = None if config_field.default is MISSING else config_field.default
        flag = "--" + config_field.name.replace("_", "-")
        env = f"SPINDLE_{config_field.name.upper()}"
        rows.append((flag, env, repr(default), meanings[config_field.name]))
    engine_dests = {action.dest for action in engine._actions}
    for action in backend._actions:
        if action.dest in engine_dests or action.help == argparse.SUPPRESS:
            continue
        rows.append(
            (action.option_strings[0], f"SPINDLE_{action.dest.upper()}", repr(action.default), action.help or "\u2014")
        )
    return rows


class EngineFlags(SphinxDirective):
    """Render :func:`flag_rows` as a list table."""

    def run(self) -> list:
        """Build the table's reStructuredText and parse it in place."""
        lines = [".. list-table::", "   :header-rows: 1", "   :widths: 22 28 12 38", ""]
        lines += ["   * - flag", "     - environment variable", "     - default", "     - meaning"]
        for flag, env, default, meaning in flag_rows():
            lines += [f"   * - ``{flag}``", f"     - ``{env}``", f"     - ``{default}``", f"     - {meaning}"]
        return self.parse_text_to_nodes("\n".join(lines))


def setup(app: Sphinx) -> dict[str, object]:
    """Register the directive."""
    app.add_directive("engine-flags", EngineFlags)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
