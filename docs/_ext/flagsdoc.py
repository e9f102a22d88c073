"""``.. engine-flags::``, ``.. server-flags::`` and ``.. chosen-flags::``: tables of ``spindle`` flags.

The rows come from the argparse parsers that ``spindle serve`` and ``spindle backend`` build, and each flag's
meaning from the ``Attributes`` section of its settings dataclass: one of :class:`spindle.shared.config.EngineConfig`'s
parts (engine flags, each named with its part) or :class:`spindle.frontend.grpc.args.ServerConfig` (gRPC server
flags), so the tables cannot fall behind the code.
Defaults are read with no ``SPINDLE_*`` variable set, so the builder's environment does not leak in.
"""

import argparse
import os
from collections.abc import Callable
from dataclasses import MISSING, fields
from unittest import mock

from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective


def _parser(*add_args: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    """A parser with ``add_args``' flags, built with no ``SPINDLE_*`` variable set."""
    with mock.patch.dict(os.environ, {k: v for k, v in os.environ.items() if not k.startswith("SPINDLE_")}, clear=True):
        parser = argparse.ArgumentParser()
        for add in add_args:
            add(parser)
    return parser


def _config_rows(cls: type, part: str | None = None) -> list[tuple[str, str, str, str]]:
    """``(flag, environment variable, default, meaning)`` for every field of the settings dataclass ``cls``.

    With ``part``, each meaning starts with the name of the :class:`EngineConfig` part the field belongs to.
    """
    from spindle.shared.config import attribute_help

    meanings = attribute_help(cls)
    rows = []
    for config_field in fields(cls):
        default = None if config_field.default is MISSING else config_field.default
        flag = "--" + config_field.name.replace("_", "-")
        env = f"SPINDLE_{config_field.name.upper()}"
        meaning = meanings[config_field.name] if part is None else f"*{part}*: {meanings[config_field.name]}"
        rows.append((flag, env, repr(default), meaning))
    return rows


def flag_rows() -> list[tuple[str, str, str, str]]:
    """``(flag, environment variable, default, meaning)`` for every engine flag, then the backend-only ones."""
    from spindle.shared.config import SECTIONS, add_backend_args, add_engine_args

    engine, backend = _parser(add_engine_args), _parser(add_backend_args)
    rows = [row for part, cls in SECTIONS.items() for row in _config_rows(cls, part)]
    engine_dests = {action.dest for action in engine._actions}
    for action in backend._actions:
        if action.dest in engine_dests or action.help == argparse.SUPPRESS:
            continue
        rows.append(
            (action.option_strings[0], f"SPINDLE_{action.dest.upper()}", repr(action.default), action.help or "\u2014")
        )
    return rows


def server_flag_rows() -> list[tuple[str, str, str, str]]:
    """``(flag, environment variable, default, meaning)`` for every gRPC server flag of ``spindle serve``.

    Raises:
        AssertionError: :func:`~spindle.frontend.grpc.args.add_server_args` adds a flag that ``ServerConfig``
            lacks, or
            its default differs from the field's.

    """
    from spindle.frontend.grpc.args import ServerConfig, add_server_args

    parser = _parser(add_server_args)
    rows = _config_rows(ServerConfig)
    # The flags are generated from the dataclass too; check they still agree, so the table cannot mislead.
    defaults = {action.option_strings[0]: repr(action.default) for action in parser._actions if action.dest != "help"}
    assert defaults == {flag: default for flag, _, default, _ in rows}, defaults
    return rows


class _FlagTable(SphinxDirective):
    """Render ``rows()`` as a list table."""

    rows: Callable[[], list[tuple[str, str, str, str]]]

    def run(self) -> list:
        """Build the table's reStructuredText and parse it in place."""
        lines = [".. list-table::", "   :header-rows: 1", "   :widths: 22 28 12 38", ""]
        lines += ["   * - flag", "     - environment variable", "     - default", "     - meaning"]
        for flag, env, default, meaning in self.rows():
            lines += [f"   * - ``{flag}``", f"     - ``{env}``", f"     - ``{default}``", f"     - {meaning}"]
        return self.parse_text_to_nodes("\n".join(lines))


class ChosenFlags(_FlagTable):
    """The engine and server flags named in the directive's content, one per line, in that order.

    A name that is no flag fails the build, so a page that lists limits cannot name one that is gone.
    """

    has_content = True

    def rows(self) -> list[tuple[str, str, str, str]]:  # type: ignore[override]
        """The named flags' rows."""
        every = {row[0]: row for row in [*flag_rows(), *server_flag_rows()]}
        unknown = [name for name in self.content if name not in every]
        if unknown:
            raise self.error(f"chosen-flags: no such flag: {', '.join(unknown)}")
        return [every[name] for name in self.content]


class EngineFlags(_FlagTable):
    """The engine and backend flags (:func:`flag_rows`)."""

    rows = staticmethod(flag_rows)


class ServerFlags(_FlagTable):
    """The gRPC server flags of ``spindle serve`` (:func:`server_flag_rows`)."""

    rows = staticmethod(server_flag_rows)


def setup(app: Sphinx) -> dict[str, object]:
    """Register the directives."""
    app.add_directive("engine-flags", EngineFlags)
    app.add_directive("server-flags", ServerFlags)
    app.add_directive("chosen-flags", ChosenFlags)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
