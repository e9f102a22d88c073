"""Render the gRPC API reference from the ``.proto`` files themselves, so it is never written twice.

``.. proto-reference:: ../protos`` (a folder relative to the page) renders every ``*.proto`` under it: per file,
its services with their RPCs, then its messages with every field, then its enums, each with the comments written
above it (or at the end of its line) in the proto file (parsed by :mod:`protoparse`). Type names link to their
message or enum when the same files define them.
"""

import re
from pathlib import Path

from docutils import nodes
from docutils.statemachine import StringList
from protoparse import ProtoFile, parse_proto
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles


def _label(package: str, name: str) -> str:
    return "proto-" + re.sub(r"[^a-z0-9]+", "-", f"{package}.{name}".lower()).strip("-")


def _cell(text: str) -> str:
    """One list-table cell: a paragraph per comment line group, or a dash when there is none."""
    return text.replace("\n", " ").strip() or "\u2014"


def proto_rst(files: list[ProtoFile]) -> list[str]:
    """The reStructuredText of the reference for ``files``: a section per file, tables per service and message."""
    known = {f"{f.package}.{d.name}": f.package for f in files for d in [*f.messages, *f.enums]}

    def link(type_name: str, package: str) -> str:
        # Resolve the way protoc does for the cases that matter here: relative to the package, then absolute.
        for candidate in (f"{package}.{type_name}", type_name.lstrip(".")):
            if candidate in known:
                name = candidate.removeprefix(known[candidate] + ".")
                return f":ref:`{name} <{_label(known[candidate], name)}>`"
        return f"``{type_name}``"

    def typed(type_name: str, package: str) -> str:
        if type_name.startswith("map<"):
            key, value = type_name[4:-1].split(", ")
            return f"map<``{key}``, {link(value, package)}>"
        return link(type_name, package)

    lines: list[str] = []
    for proto in files:
        title = f"{proto.path}"
        lines += [title, "=" * len(title), ""]
        if proto.package:
            lines += [f"Package ``{proto.package}``.", ""]
        if proto.doc:
            lines += [*proto.doc.splitlines(), ""]
        for service in proto.services:
            heading = f"service {service.name}"
            lines += [f".. _{_label(proto.package, service.name)}:", "", heading, "-" * len(heading), ""]
            lines += [*service.doc.splitlines(), ""]
            lines += [".. list-table::", "   :header-rows: 1", "   :widths: 20 25 25 30", ""]
            lines += ["   * - RPC", "     - request", "     - response", "     - description"]
            for rpc in service.rpcs:
                request = ("stream " if rpc.client_streaming else "") + link(rpc.request, proto.package)
                response = ("stream " if rpc.server_streaming else "") + link(rpc.response, proto.package)
                lines += [
                    f"   * - ``{rpc.name}``",
                    f"     - {request}",
                    f"     - {response}",
                    f"     - {_cell(rpc.doc)}",
                ]
            lines.append("")
        for message in proto.messages:
            heading = f"message {message.name}"
            lines += [f".. _{_label(proto.package, message.name)}:", "", heading, "-" * len(heading), ""]
            lines += [*message.doc.splitlines(), ""]
            if not message.fields:
                lines += ["No fields.", ""]
                continue
            lines += [".. list-table::", "   :header-rows: 1", "   :widths: 20 25 8 12 35", ""]
            lines += ["   * - field", "     - type", "     - number", "     - label", "     - description"]
            for f in message.fields:
                label = f"``{f.label}``" if f.label else ""
                lines += [f"   * - ``{f.name}``", f"     - {typed(f.type, proto.package)}", f"     - {f.number}"]
                lines += [f"     - {label}", f"     - {_cell(f.doc)}"]
            lines.append("")
        for enum in proto.enums:
            heading = f"enum {enum.name}"
            lines += [f".. _{_label(proto.package, enum.name)}:", "", heading, "-" * len(heading), ""]
            lines += [*enum.doc.splitlines(), ""]
            lines += [".. list-table::", "   :header-rows: 1", "   :widths: 30 10 60", ""]
            lines += ["   * - value", "     - number", "     - description"]
            for name, number, doc in enum.values:
                lines += [f"   * - ``{name}``", f"     - {number}", f"     - {_cell(doc)}"]
            lines.append("")
    return lines


class ProtoReference(SphinxDirective):
    """``.. proto-reference:: FOLDER``: the reference of every ``.proto`` file under ``FOLDER``."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        """Parse the files (each becomes a dependency of the page) and render them."""
        _, folder = self.env.relfn2path(self.arguments[0], self.env.docname)
        paths = sorted(Path(folder).rglob("*.proto"))
        if not paths:
            text = f"No ``.proto`` files under ``{self.arguments[0]}`` yet: this reference fills in when they exist."
            return self.parse_text_to_nodes(text)
        files = []
        for path in paths:
            self.env.note_dependency(str(path))
            files.append(parse_proto(path.read_text(), path.relative_to(Path(folder).parent).as_posix()))
        container = nodes.container()
        nested_parse_with_titles(self.state, StringList(proto_rst(files), source=str(folder)), container)
        return container.children


def setup(app: Sphinx) -> dict[str, object]:
    """Register the directive."""
    app.add_directive("proto-reference", ProtoReference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
