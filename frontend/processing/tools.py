"""Tool calling in chat: tools and tool choice checked, the constraint a choice puts on the reply, calls parsed.

A request's tools are OpenAI's function tools, ``{"type": "function", "function": {"name", "description",
"parameters"}}`` (the bare ``{"name", "description", "parameters"}`` is taken too); the chat template receives them
in that form, as Hugging Face templates expect. The tool choice is ``"auto"`` (the model may call tools: its reply is
parsed), ``"none"`` (no tools: the template does not see them and nothing is parsed), ``"required"`` (the reply is
constrained to a JSON array of calls) or a tool's name, also as OpenAI's ``{"type": "function", "function": {"name":
...}}`` (the reply is constrained to that tool's arguments). A constraint is a
:class:`~spindle.shared.StructuredOutput` on the request's sampling parameters, which the backend enforces as any
other, so nothing here needs the backend.
"""

import json
import re
import secrets
import string
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from spindle.shared import SamplingParams, StructuredOutput, ToolCall
from spindle.shared.errors import InvalidRequestError
from spindle.shared.json_depth import MAX_JSON_DEPTH, check_json_value

TOOL_CHOICE_MODES = ("auto", "none", "required")
"""The tool choices that are not a tool's name."""

MAX_PARAMETERS_DEPTH = MAX_JSON_DEPTH - 5
"""The deepest a tool's ``parameters`` schema may nest: ``"required"`` puts it 5 levels deep in the schema of the
reply (``items.anyOf[i].properties.arguments``), which must stay within
:data:`~spindle.shared.json_depth.MAX_JSON_DEPTH`."""

_ID_ALPHABET = string.ascii_letters + string.digits
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_CLOSED_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_CODE_FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)
# Markers some models write before a JSON reply of calls (Mistral, Llama 3.1), when they decode as text.
_CALL_PREFIXES = ("[TOOL_CALLS]", "<|python_tag|>")
_JSON_SEPARATORS = " \t\r\n;,"
# Where a call's arguments object starts: after its name (the name first, as models write calls).
_CALL_START = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_DECODER = json.JSONDecoder()
# What decoding (and encoding again) a model's JSON can raise: bad JSON, or JSON nested past the recursion limit.
_UNPARSEABLE = (ValueError, RecursionError)


@dataclass(frozen=True)
class CallInProgress:
    """A tool call as a reply writes it: its tool, and the JSON text of its arguments so far.

    Attributes:
        name: the tool's name.
        arguments: the arguments object's text as the model wrote it, up to where the reply stands (the whole
            object once ``complete``).
        complete: the arguments object is closed.

    """

    name: str
    arguments: str
    complete: bool


def new_tool_call_id() -> str:
    """A fresh tool call id: ``call_`` and 24 random letters and digits, as OpenAI's look."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass(frozen=True)
class ChatTools:
    """The checked tools of one chat request and what its tool choice asks of the reply.

    Build it with :meth:`from_request`, which returns ``None`` when the request has no tools or chose ``"none"``.

    Attributes:
        tools: the tools in OpenAI's form, for the chat template: ``{"type": "function", "function": {"name",
            "description", "parameters", ...}}``, ``parameters`` always an object schema (an empty one for a tool
            that takes no arguments).
        choice: ``"auto"``, ``"required"`` or ``"named"``.
        name: the tool a ``"named"`` choice calls, else ``None``.

    """

    tools: list[dict[str, Any]]
    choice: str
    name: str | None = None

    @classmethod
    def from_request(
        cls, tools: Sequence[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None, params: SamplingParams
    ) -> "ChatTools | None":
        """Check a request's tools and tool choice.

        Args:
            tools: the request's tools, in OpenAI's form or bare, or ``None``.
            tool_choice: ``"auto"`` (also ``None``), ``"none"``, ``"required"``, a tool's name, or
                ``{"type": "function", "function": {"name": ...}}``.
            params: the request's sampling parameters: a ``"required"`` or named choice cannot take a
                ``structured_output`` of its own.

        Returns:
            The checked tools and choice; ``None`` when there are no tools or the choice is ``"none"``.

        Raises:
            InvalidRequestError: a tool is malformed (``tools[i]``, ``tools[i].name``, ``tools[i].description``,
                ``tools[i].parameters``), two tools share a name, or the choice is not one of the above, names no
                given tool, needs tools that are not there, or conflicts with ``structured_output``
                (``tool_choice``, ``tool_choice.function_name``).

        """
        checked = _check_tools(tools)
        names = [tool["function"]["name"] for tool in checked]
        choice, name = _check_tool_choice(tool_choice, names)
        if choice in ("required", "named") and params.structured_output is not None:
            raise InvalidRequestError(
                "tool_choice",
                f"tool_choice={tool_choice!r} constrains the reply to tool calls, which conflicts with "
                "sampling_params.structured_output: set one of them, or use tool_choice='auto'",
                also=("sampling_params.structured_output",),
            )
        if choice == "none" or not checked:
            return None
        return cls(checked, choice, name)

    @property
    def names(self) -> list[str]:
        """The tools' names, in the order given."""
        return [tool["function"]["name"] for tool in self.tools]

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema the reply must match: ``None`` for ``"auto"``.

        ``"required"``: a non-empty JSON array of ``{"name": <a tool's name>, "arguments": <its parameters>}``
        objects; a named tool: its arguments object, valid against its parameters.
        """
        if self.choice == "named":
            return next(tool["function"]["parameters"] for tool in self.tools if tool["function"]["name"] == self.name)
        if self.choice != "required":
            return None
        calls: list[dict[str, Any]] = []
        definitions: dict[str, Any] = {}
        for index, tool in enumerate(self.tools):
            function = tool["function"]
            arguments = _hoist_definitions(function["parameters"], f"tool{index}.", definitions)
            calls.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": function["name"]}, "arguments": arguments},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if definitions:
            schema["$defs"] = definitions
        return schema

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the structured output the choice asks for (a copy), or ``params`` itself for ``"auto"``."""
        schema = self.output_schema()
        if schema is None:
            return params
        return msgspec.structs.replace(params, structured_output=StructuredOutput(json_schema=schema))

    def parse(self, text: str) -> list[ToolCall]:
        """The tool calls in a finished reply; an empty list when it has none that parse.

        A named choice's reply is the arguments (one call, when it is a JSON object); any other is read by
        :func:`parse_tool_calls`, which takes the JSON array that ``"required"`` constrains the reply to.
        """
        if self.choice != "named":
            return parse_tool_calls(text, self.names)
        arguments = text.strip()
        try:
            is_object = isinstance(json.loads(arguments), dict)
        except _UNPARSEABLE:
            is_object = False
        return [ToolCall(new_tool_call_id(), self.name, arguments)] if is_object else []

    def writing(self, text: str) -> list[CallInProgress]:
        """The calls in a reply still being written, each with its arguments' text so far, for streaming them.

        A named choice's reply is its call's arguments; any other reply's calls are the objects that start
        ``{"name": "<a tool>", "arguments": {`` (or ``"parameters"``), in order, in whichever format holds them.
        """
        if self.choice == "named":
            assert self.name is not None
            arguments = text.lstrip()
            end = _object_end(arguments, 0)
            return [CallInProgress(self.name, arguments[:end], end is not None)] if arguments.startswith("{") else []
        calls, position = [], 0
        while (match := _CALL_START.search(text, position)) is not None:
            try:
                name = json.loads(f'"{match[1]}"')
            except _UNPARSEABLE:
                name = None
            end = _object_end(text, match.end())
            if name in self.names:
                calls.append(CallInProgress(name, text[match.end() : end], end is not None))
            if end is None:
                break
            position = end
        return calls

    def parse_so_far(self, text: str) -> list[ToolCall]:
        """The calls that are whole in a reply still being written, so that a stream can send each as it completes.

        Hermes blocks count once closed (``</tool_call>``), JSON calls once their object is; a named choice's
        arguments, and anything else, only when the reply ends (:meth:`parse`).
        """
        if self.choice == "named":
            return []
        return parse_tool_calls(text, self.names, partial=True)


def parse_tool_calls(text: str, tool_names: Collection[str], partial: bool = False) -> list[ToolCall]:
    """Read the tool calls a model wrote in its reply, in the formats chat models use.

    - Hermes / Qwen / SmolLM3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, any number, each
      with one call or a JSON list of calls; text around them is ignored, and the last block may be unterminated.
    - Llama 3 / Mistral JSON: the whole reply is a JSON object or list of ``{"name": ..., "arguments": {...}}``
      (``"parameters"`` instead of ``"arguments"`` too), or several objects separated by ``;``, possibly in a
      Markdown code fence or after a ``[TOOL_CALLS]`` / ``<|python_tag|>`` marker.

    A call is ``{"name", "arguments"}``, also wrapped as OpenAI's ``{"function": {...}}``; arguments that are JSON
    text of an object are decoded, missing ones are ``{}``. Only calls of the given tools count, and a reply that
    does not parse (bad JSON, or JSON nested too deep for Python to decode) has no calls: its text stays as it is.

    Args:
        text: the reply.
        tool_names: the names of the request's tools.
        partial: the reply is still being written: only closed blocks, and the JSON values that are whole (those
            before the first one that does not decode yet), count.

    Returns:
        The calls in order, each with a fresh id and its arguments as compact JSON text.

    """
    if "<tool_call>" in text:
        blocks = _CLOSED_TOOL_CALL_BLOCK.findall(text) if partial else _TOOL_CALL_BLOCK.findall(text)
        values = [value for block in blocks for value in _json_values(block)]
    else:
        body = text.strip()
        for prefix in _CALL_PREFIXES:
            body = body.removeprefix(prefix).lstrip()
        if partial:
            values = _whole_json_values(body.removeprefix("```json").removeprefix("```").lstrip())
        else:
            fence = _CODE_FENCE.fullmatch(body)
            values = _json_values(fence[1] if fence else body)
    calls = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            call = _tool_call(item, tool_names)
            if call is not None:
                calls.append(call)
    return calls


def _object_end(text: str, start: int) -> int | None:
    """Where the JSON object at ``text[start]`` ends (the index after its ``}``); ``None`` while it is open."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        character = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif character == "\\":
                escaped = True
            elif character == '"':
                in_string = False
        elif character == '"':
            in_string = True
        elif character in "{[":
            depth += 1
        elif character in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _json_values(text: str) -> list[Any]:
    """The JSON values that make up all of ``text`` (separated by whitespace, ``;`` or ``,``); ``[]`` otherwise."""
    values = []
    position = 0
    while True:
        while position < len(text) and text[position] in _JSON_SEPARATORS:
            position += 1
        if position == len(text):
            return values
        try:
            value, position = _DECODER.raw_decode(text, position)
        except _UNPARSEABLE:
            return []
        values.append(value)


def _whole_json_values(text: str) -> list[Any]:
    """The JSON values at the start of a reply still being written that are whole.

    Those decoded before the first that does not decode (yet); the elements of a list that has begun, one by one.
    """
    values: list[Any] = []
    position, inside_list = 0, text.startswith("[")
    if inside_list:
        position = 1
    while True:
        while position < len(text) and text[position] in _JSON_SEPARATORS:
            position += 1
        if position == len(text) or (inside_list and text[position] == "]"):
            return values
        try:
            value, position = _DECODER.raw_decode(text, position)
        except _UNPARSEABLE:
            return values
        values.append(value)


def _tool_call(value: Any, tool_names: Collection[str]) -> ToolCall | None:
    if isinstance(value, dict) and isinstance(value.get("function"), dict):
        value = value["function"]
    if not isinstance(value, dict) or value.get("name") not in tool_names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    try:
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            return None
        return ToolCall(new_tool_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))
    except _UNPARSEABLE:
        return None


def _check_tools(tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The tools in OpenAI's form, each checked; raises for the first that is malformed."""
    if tools is None:
        return []
    if not isinstance(tools, list | tuple):
        raise InvalidRequestError("tools", f"tools must be a list of tool dicts, not {type(tools).__name__}")
    checked: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for index, tool in enumerate(tools):
        field = f"tools[{index}]"
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            raise InvalidRequestError(
                field,
                f"{field} must be {{'type': 'function', 'function': {{'name': str, 'description': str, "
                f"'parameters': dict}}}} or the inner dict alone, not {tool!r}",
            )
        if "function" in tool and tool.get("type", "function") != "function":
            raise InvalidRequestError(field, f"{field} has type {tool['type']!r}: only 'function' tools are supported")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequestError(f"{field}.name", f"{field} needs a non-empty str name, got {name!r}")
        if name in seen:
            raise InvalidRequestError(
                f"{field}.name", f"{field} is named {name!r}, as tools[{seen[name]}] is: tool names must be unique"
            )
        seen[name] = index
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError(
                f"{field}.description", f"{field}'s description must be a str, not {type(description).__name__}"
            )
        checked_function = {**function, "parameters": _check_parameters(function.get("parameters"), field)}
        if description is None:
            checked_function.pop("description", None)
        checked.append({"type": "function", "function": checked_function})
    return checked


def _check_parameters(parameters: Any, field: str) -> dict[str, Any]:
    """The JSON schema of a tool's arguments as an object schema; ``None`` (no arguments) is the empty one."""
    if parameters is None:
        return {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        got = parameters.get("type") if isinstance(parameters, dict) else type(parameters).__name__
        raise InvalidRequestError(
            f"{field}.parameters",
            f"{field}'s parameters must be a JSON schema of type 'object' (the arguments are a JSON object), "
            f"got {got!r}",
        )
    check_json_value(parameters, f"{field}.parameters", MAX_PARAMETERS_DEPTH)
    try:
        json.dumps(parameters)
    except (TypeError, ValueError) as error:
        raise InvalidRequestError(f"{field}.parameters", f"{field}'s parameters are not JSON: {error}") from error
    return parameters if "type" in parameters else {"type": "object", **parameters}


def _check_tool_choice(tool_choice: str | dict[str, Any] | None, names: list[str]) -> tuple[str, str | None]:
    """The choice (``"auto"``, ``"none"``, ``"required"`` or ``"named"``) and the named tool."""
    if tool_choice is None or tool_choice in TOOL_CHOICE_MODES:
        choice = tool_choice or "auto"
        if choice == "required" and not names:
            raise InvalidRequestError(
                "tool_choice", "tool_choice='required' needs tools to call: give tools, or leave tool_choice unset"
            )
        return choice, None
    if isinstance(tool_choice, str):
        name = tool_choice
    elif isinstance(tool_choice, dict):
        function = tool_choice.get("function", tool_choice)
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(
                "tool_choice.function_name",
                f"a named tool choice is {{'type': 'function', 'function': {{'name': str}}}}, not {tool_choice!r}",
            )
    else:
        raise InvalidRequestError(
            "tool_choice",
            f"tool_choice must be 'auto', 'none', 'required', a tool's name or "
            f"{{'type': 'function', 'function': {{'name': str}}}}, not {tool_choice!r}",
        )
    if name not in names:
        raise InvalidRequestError(
            "tool_choice.function_name",
            f"tool_choice {name!r} is neither 'auto', 'none' nor 'required', nor the name of a given tool "
            f"(the tools are {names})",
        )
    return "named", name


def _hoist_definitions(schema: dict[str, Any], prefix: str, definitions: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``$defs`` / ``definitions`` moved into ``definitions`` under ``prefix``.

    Nested in the array schema of ``"required"``, a tool's ``#/$defs/X`` references would point at the outer
    root; they are rewritten to the hoisted names.
    """
    local = {**schema.get("$defs", {}), **schema.get("definitions", {})}
    if not local:
        return schema
    renamed = {f"#/{kind}/{name}": f"#/$defs/{prefix}{name}" for kind in ("$defs", "definitions") for name in local}

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                key: renamed.get(value, value) if key == "$ref" and isinstance(value, str) else rewrite(value)
                for key, value in node.items()
            }
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        return node

    for name, definition in local.items():
        definitions[prefix + name] = rewrite(definition)
    return rewrite({key: value for key, value in schema.items() if key not in ("$defs", "definitions")})
