"""Reasoning parsers: a reasoning model's thoughts apart from its answer, as vLLM's ``--reasoning-parser`` gives them.

Models of the DeepSeek-R1 and Qwen3 families think in a block between ``<think>`` and ``</think>`` before they
answer. A parser splits a completion's text into its ``reasoning_content`` and its content (the answer): on the whole
text when the completion finishes, and on the text so far while it streams, holding back the end of the text that may
be the start of a tag, so that nothing streamed as reasoning turns out to be a tag, or the answer.
"""

from typing import ClassVar, NamedTuple


class ReasoningSplit(NamedTuple):
    """A completion's text so far, split: ``reasoning`` (None without a thinking block) and ``content``."""

    reasoning: str | None
    content: str


class ReasoningParser:
    """Splits the text of a model that thinks between ``start`` and ``end`` tags before it answers.

    A subclass names its family (``name``, what ``--reasoning-parser`` takes) and whether its text starts in the
    thinking block without writing ``start`` (the chat template wrote it into the prompt).
    """

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    starts_thinking: ClassVar[bool]
    """Whether the completion is reasoning from its first token, the start tag written or not."""

    def split(self, text: str, finished: bool) -> ReasoningSplit:
        """Split ``text``, the completion so far; ``finished`` says it is whole (nothing is held back then).

        While the completion runs, a tail of ``text`` that could begin a tag is in neither part, so that the parts
        only ever grow as the text does.
        """
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            body = stripped[len(self.start) :]
        elif not finished and self.start.startswith(stripped):
            return ReasoningSplit(None, "")  # perhaps the start tag, still coming
        elif self.starts_thinking:
            body = text
        else:
            return ReasoningSplit(None, text)
        reasoning, found, content = body.partition(self.end)
        if found:
            return ReasoningSplit(reasoning, content)
        if not finished:
            reasoning = reasoning[: len(reasoning) - _partial_tag(reasoning, self.end)]
        return ReasoningSplit(reasoning, "")


class DeepSeekR1Parser(ReasoningParser):
    """DeepSeek-R1 and its distills: the text is reasoning until ``</think>``.

    Their chat template opens the thinking block, so ``<think>``, when the model writes it anyway, is dropped; a
    completion cut before ``</think>`` is all reasoning.
    """

    name = "deepseek_r1"
    starts_thinking = True


class Qwen3Parser(ReasoningParser):
    """Qwen3 (and models that write both tags): reasoning only when the text starts with ``<think>``.

    With thinking turned off (``enable_thinking=False``: the template writes an empty block into the prompt) the text
    is all answer.
    """

    name = "qwen3"
    starts_thinking = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1Parser, Qwen3Parser)
}
"""The parsers by the name ``--reasoning-parser`` and ``reasoning_parser=`` take."""


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser of ``name``, or None for None (no parsing: the text is all content).

    Raises:
        ValueError: no parser has that name.

    """
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: the parsers are {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]()


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``tag`` (0 when none is)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
