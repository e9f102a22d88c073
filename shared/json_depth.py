"""A bound on how deeply the JSON in a request may nest, checked by a loop before anything recurses into it.

Python's ``json``, a chat template's ``tojson`` and the grammar compiler recurse once per level of nesting, so JSON
nested close to the interpreter's recursion limit (1000 frames) raises ``RecursionError`` wherever it is decoded,
encoded or walked. The request fields that carry JSON (a structured output's ``json_schema``, a tool's
``parameters``, a tool call's ``arguments``) are checked here first, as JSON text or as the Python value, and a
field nested too deep is refused with an :class:`~spindle.shared.errors.InvalidRequestError` that names it.
"""

import itertools
import json
import re

from spindle.shared.errors import InvalidRequestError

MAX_JSON_DEPTH = 64
"""The deepest a request's JSON may nest, counting objects and arrays (``{"a": [1]}`` is 2 levels deep).

Far above what real schemas and arguments need (OpenAI's structured outputs allow 10 levels), far below the
recursion limit, with room for the levels that the engine wraps around a tool's schema.
"""

# A JSON string literal (whose brackets nest nothing; unterminated, it runs to the end, so that the scan never
# starts over: a search that backtracked out of one would try again at each quote inside it), or a bracket.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[\[\]{}]', re.DOTALL)
_LEVEL_CHANGE = {"[": 1, "{": 1, "]": -1, "}": -1}


def check_json_text(text: str, field: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse JSON text nested deeper than ``limit`` levels, before it is decoded.

    Only the brackets outside string literals count, so the check holds for valid JSON; invalid JSON fails to decode
    afterwards anyway.

    Raises:
        InvalidRequestError: ``field`` is nested too deep.

    """
    changes = map(_LEVEL_CHANGE.get, _TOKEN.findall(text), itertools.repeat(0))
    if max(itertools.accumulate(changes), default=0) > limit:
        _refuse(field, limit)


def load_json_text(text: str, field: str, what: str) -> object:
    """``text`` decoded, once :func:`check_json_text` found it shallow enough.

    Raises:
        InvalidRequestError: for ``field``: nested too deep, or not JSON (``what`` names the text in the message).

    """
    check_json_text(text, field)
    try:
        return json.loads(text)
    except ValueError as error:
        raise InvalidRequestError(field, f"{what} is not valid JSON: {error}") from error


def check_json_value(value: object, field: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse a Python value (dicts, lists and tuples as JSON objects and arrays) nested deeper than ``limit`` levels.

    Raises:
        InvalidRequestError: ``field`` is nested too deep (a value that contains itself is infinitely deep).

    """
    walked: dict[int, int] = {}  # id of a container -> the deepest level it was walked at
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        if depth > limit:
            _refuse(field, limit)
        # A container met again (shared by two parents) is walked again only deeper: a value with many shared
        # parts takes at most ``limit`` walks of each, not one per path to it.
        if walked.get(id(node), 0) >= depth:
            continue
        walked[id(node)] = depth
        stack.extend((child, depth + 1) for child in children)


def _refuse(field: str, limit: int) -> None:
    raise InvalidRequestError(
        field, f"{field} is nested deeper than {limit} levels of objects and arrays: flatten it to at most {limit}"
    )
