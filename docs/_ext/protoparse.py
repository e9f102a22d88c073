"""A plain parser for the subset of proto3 that service definitions use, for the docs' gRPC reference.

It reads ``package``, ``import``, ``option``, messages (nested too) with scalar, message, ``repeated``, ``optional``,
``map<K, V>`` and ``oneof`` fields, enums, services with unary and streaming RPCs, ``reserved`` ranges and
``[field options]``, and keeps the comments written above a declaration (or at the end of its line) as its doc. It
needs neither ``protoc`` nor ``grpcio-tools``, nor Sphinx, so the tests can import it from the project venv.
"""

import re
from dataclasses import dataclass, field

_TOKEN = re.compile(
    r"""(?P<comment>//[^\n]*|/\*.*?\*/)
      | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
      | (?P<word>[A-Za-z_.][A-Za-z0-9_.]*|-?[0-9][0-9A-Za-z_.+-]*)
      | (?P<symbol>[{}()\[\]<>;=,])
      | (?P<space>\s+)""",
    re.VERBOSE | re.DOTALL,
)


@dataclass
class ProtoField:
    """One field of a message; ``label`` is ``repeated``, ``optional``, ``oneof <name>`` or empty."""

    name: str
    type: str
    number: int
    label: str = ""
    doc: str = ""


@dataclass
class ProtoEnum:
    """An enum and its ``(name, number, doc)`` values."""

    name: str
    values: list[tuple[str, int, str]] = field(default_factory=list)
    doc: str = ""


@dataclass
class ProtoMessage:
    """A message; nested messages and enums are flattened into the file with dotted names (``Outer.Inner``)."""

    name: str
    fields: list[ProtoField] = field(default_factory=list)
    doc: str = ""


@dataclass
class ProtoRpc:
    """One RPC of a service, with whether each side streams."""

    name: str
    request: str
    response: str
    client_streaming: bool = False
    server_streaming: bool = False
    doc: str = ""


@dataclass
class ProtoService:
    """A service and its RPCs."""

    name: str
    rpcs: list[ProtoRpc] = field(default_factory=list)
    doc: str = ""


@dataclass
class ProtoFile:
    """What one ``.proto`` file declares."""

    path: str
    package: str = ""
    doc: str = ""
    services: list[ProtoService] = field(default_factory=list)
    messages: list[ProtoMessage] = field(default_factory=list)
    enums: list[ProtoEnum] = field(default_factory=list)


@dataclass
class _Token:
    kind: str
    text: str
    line: int


def _tokenize(source: str) -> list[_Token]:
    tokens, line, pos = [], 1, 0
    while pos < len(source):
        match = _TOKEN.match(source, pos)
        if match is None:
            raise ValueError(f"line {line}: cannot read {source[pos : pos + 20]!r}")
        if match.lastgroup != "space":
            tokens.append(_Token(match.lastgroup, match.group(), line))
        line += match.group().count("\n")
        pos = match.end()
    return tokens


def _comment_text(comment: str) -> str:
    if comment.startswith("//"):
        return comment[2:].removeprefix(" ").rstrip()
    lines = [re.sub(r"^\s*\*? ?", "", text).rstrip() for text in comment[2:-2].splitlines()]
    return "\n".join(lines).strip()


class _Parser:
    """Recursive descent over the tokens; comments are gathered as docs of the declaration they precede or end."""

    def __init__(self, source: str, path: str) -> None:
        self.tokens = _tokenize(source)
        self.pos = 0
        self.leading: list[str] = []
        self.file = ProtoFile(path)

    def parse(self) -> ProtoFile:
        # A comment block at the top, separated from the first declaration, documents the file.
        first_code = next((t for t in self.tokens if t.kind != "comment"), None)
        head = [t for t in self.tokens if t.kind == "comment" and (first_code is None or t.line < first_code.line)]
        if head and first_code is not None and first_code.line - (head[-1].line + head[-1].text.count("\n")) > 1:
            self.file.doc = "\n".join(_comment_text(t.text) for t in head)
            self.pos = len(head)
        while self._peek() is not None:
            self._top_level()
        return self.file

    def _peek(self) -> str | None:
        self._gather_comments()
        return self.tokens[self.pos].text if self.pos < len(self.tokens) else None

    def _gather_comments(self) -> None:
        while self.pos < len(self.tokens) and self.tokens[self.pos].kind == "comment":
            self.leading.append(_comment_text(self.tokens[self.pos].text))
            self.pos += 1

    def _next(self) -> str:
        if self._peek() is None:
            raise ValueError(f"{self.file.path}: unexpected end of file")
        token = self.tokens[self.pos]
        self.pos += 1
        return token.text

    def _expect(self, text: str) -> None:
        got = self._next()
        if got != text:
            raise ValueError(f"{self.file.path} line {self.tokens[self.pos - 1].line}: expected {text!r}, got {got!r}")

    def _take_doc(self) -> str:
        doc, self.leading = "\n".join(self.leading).strip(), []
        return doc

    def _trailing(self, doc: str) -> str:
        """Append a comment on the same line as the token just consumed."""
        end = self.tokens[self.pos - 1]
        if self.pos < len(self.tokens) and self.tokens[self.pos].kind == "comment":
            comment = self.tokens[self.pos]
            if comment.line == end.line:
                self.pos += 1
                return "\n".join(filter(None, [doc, _comment_text(comment.text)]))
        return doc

    def _skip_statement(self) -> None:
        depth = 0
        while True:
            token = self._next()
            depth += (token in "{[(") - (token in "}])")
            if depth == 0 and token in (";", "}"):
                return

    def _top_level(self) -> None:
        keyword = self._peek()
        if keyword == "package":
            self._next()
            self.file.package = self._next()
            self._expect(";")
            self.leading = []
        elif keyword == "message":
            self._message("")
        elif keyword == "enum":
            self._enum("")
        elif keyword == "service":
            self._service()
        elif keyword == ";":
            self._next()
        else:  # syntax, edition, import, option
            self._skip_statement()
            self.leading = []

    def _message(self, prefix: str) -> None:
        doc = self._take_doc()
        self._expect("message")
        message = ProtoMessage(prefix + self._next(), doc=doc)
        self._expect("{")
        message.doc = self._trailing(message.doc)
        self.file.messages.append(message)
        self._body(message, "")
        self._take_doc()

    def _body(self, message: ProtoMessage, oneof: str) -> None:
        while (token := self._peek()) != "}":
            if token == "message" and not oneof:
                self._message(message.name + ".")
            elif token == "enum" and not oneof:
                self._enum(message.name + ".")
            elif token == "oneof":
                self._next()
                name = self._next()
                self._expect("{")
                self.leading = []
                self._body(message, name)
            elif token in ("option", "reserved", "extensions", ";"):
                self._skip_statement() if token != ";" else self._next()
                self.leading = []
            else:
                message.fields.append(self._field(oneof))
        self._expect("}")
        self.leading = []

    def _field(self, oneof: str) -> ProtoField:
        doc = self._take_doc()
        label = f"oneof {oneof}" if oneof else ""
        kind = self._next()
        if kind in ("repeated", "optional", "required"):
            label, kind = kind, self._next()
        if kind == "map":
            self._expect("<")
            key = self._next()
            self._expect(",")
            value = self._next()
            self._expect(">")
            kind = f"map<{key}, {value}>"
        name = self._next()
        self._expect("=")
        number = int(self._next(), 0)
        self._skip_options()
        self._expect(";")
        return ProtoField(name, kind, number, label, self._trailing(doc))

    def _skip_options(self) -> None:
        """Skip a field's or enum value's ``[...]`` options, which the reference does not show."""
        if self._peek() == "[":
            while self._next() != "]":
                continue

    def _enum(self, prefix: str) -> None:
        enum = ProtoEnum(prefix, doc=self._take_doc())
        self._expect("enum")
        enum.name += self._next()
        self._expect("{")
        enum.doc = self._trailing(enum.doc)
        while (token := self._peek()) != "}":
            if token in ("option", "reserved", ";"):
                self._skip_statement() if token != ";" else self._next()
                self.leading = []
                continue
            doc = self._take_doc()
            name = self._next()
            self._expect("=")
            number = int(self._next(), 0)
            self._skip_options()
            self._expect(";")
            enum.values.append((name, number, self._trailing(doc)))
        self._expect("}")
        self.leading = []
        self.file.enums.append(enum)

    def _service(self) -> None:
        service = ProtoService("", doc=self._take_doc())
        self._expect("service")
        service.name = self._next()
        self._expect("{")
        service.doc = self._trailing(service.doc)
        while (token := self._peek()) != "}":
            if token != "rpc":
                self._skip_statement() if token != ";" else self._next()
                self.leading = []
                continue
            doc = self._take_doc()
            self._expect("rpc")
            rpc = ProtoRpc(self._next(), "", "", doc=doc)
            rpc.client_streaming, rpc.request = self._rpc_type()
            self._expect("returns")
            rpc.server_streaming, rpc.response = self._rpc_type()
            if self._next() == "{":  # an options body
                self.pos -= 1
                self._skip_statement()
            rpc.doc = self._trailing(rpc.doc)
            service.rpcs.append(rpc)
        self._expect("}")
        self.leading = []
        self.file.services.append(service)

    def _rpc_type(self) -> tuple[bool, str]:
        self._expect("(")
        kind = self._next()
        streaming = kind == "stream"
        if streaming:
            kind = self._next()
        self._expect(")")
        return streaming, kind


def parse_proto(source: str, path: str = "<string>") -> ProtoFile:
    """Parse the text of one ``.proto`` file."""
    return _Parser(source, path).parse()
