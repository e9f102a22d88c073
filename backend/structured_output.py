"""Structured output with xgrammar: grammars compiled off the step loop, a matcher per sequence, a bitmask per step.

A constrained request's spec (:class:`~spindle.shared.sampling_params.StructuredOutput`) is compiled by a worker
thread while the engine keeps stepping the other requests; its sequences wait (the scheduler passes them over) until
the grammar is ready. Compiled grammars are cached by spec, so a schema that many requests share compiles once. Each
sequence then owns a ``GrammarMatcher``: before sampling, the runner asks it which tokens may come next (one bit per
token, filled on the CPU while the device runs the forward pass) and the sampler masks the others out of the logits;
after sampling, the engine core feeds it the chosen tokens, and ends the sequence when its grammar is complete.

xgrammar imports torch, and building its tokenizer table takes seconds, so nothing here is loaded before the first
constrained request arrives (on the worker thread).
"""

import json
import logging
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from spindle.backend.sequence import Sequence
from spindle.shared.errors import EngineUnavailableError, InvalidRequestError
from spindle.shared.sampling_params import StructuredOutput

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar, GrammarCompiler, GrammarMatcher

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 512
"""Distinct specs whose compiled grammar (or compile error) is kept; the least recently used goes first."""

CACHE_LIMIT_BYTES = 256 * 2**20
"""What xgrammar's own cache of compiled grammars (shared by all specs) may hold."""

# xgrammar's errors start with a timestamp and the C++ source line: "[22:52:48] /project/cpp/x.cc:820: ...".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class StructuredOutputManager:
    """Compiles specs to grammars in a worker thread, with a cache, and builds the matchers and bitmasks.

    Args:
        model_dir: the model directory, whose tokenizer files xgrammar reads to map grammar bytes to token ids.
        vocab_size: the model's vocabulary (rows of the lm head): the width of the bitmask.
        eos_token_ids: the tokens that end a sequence; a matcher accepts them once its grammar is complete.

    """

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if t < vocab_size]
        # One worker: compiles are CPU-bound, and a second would take a core from the forward passes.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spindle-grammar")
        self._compiler: GrammarCompiler | None = None
        self._grammars: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()

    def compile(self, spec: StructuredOutput) -> "Future[CompiledGrammar]":
        """The compiled grammar of ``spec``, now or later: a finished future when it is cached.

        The future's exception, when the spec does not compile, is an
        :class:`~spindle.shared.errors.InvalidRequestError` for ``sampling_params.structured_output.<kind>`` with the
        compiler's message; when xgrammar cannot load the model's tokenizer, an
        :class:`~spindle.shared.errors.EngineUnavailableError` (that failure is not cached).
        """
        key = (spec.kind, _spec_text(spec))
        future = self._grammars.get(key)
        if future is not None and future.done() and isinstance(future.exception(), EngineUnavailableError):
            future = None
        if future is None:
            future = self._executor.submit(self._compile, *key)
            self._grammars[key] = future
            if len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        return future

    def matcher(self, grammar: "CompiledGrammar") -> "GrammarMatcher":
        """A fresh matcher of ``grammar`` for one sequence, at the start of its output."""
        import xgrammar

        return xgrammar.GrammarMatcher(grammar, override_stop_tokens=self.eos_token_ids)

    def _compile(self, kind: str, text: str) -> "CompiledGrammar":
        try:
            compiler = self._compiler or self._load_compiler()
        except Exception as error:  # the request is fine; this backend cannot constrain (tried again next time)
            logger.exception("Structured output is unavailable: xgrammar could not load the tokenizer")
            raise EngineUnavailableError(f"structured output is unavailable on this backend: {error}") from error
        try:
            match kind:
                case "json_schema" | "json_object":
                    # No free whitespace: a model could pad with it forever, and compact JSON is what it wants.
                    return compiler.compile_json_schema(text, any_whitespace=False)
                case "regex":
                    return compiler.compile_regex(text)
                case _:  # grammar, and choice (turned into one)
                    return compiler.compile_grammar(text)
        except Exception as error:
            field = f"sampling_params.structured_output.{kind}"
            message = _LOG_PREFIX.sub("", str(error)).strip()
            raise InvalidRequestError(field, f"the {kind} does not compile: {message}") from None

    def _load_compiler(self) -> "GrammarCompiler":
        import xgrammar
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_LIMIT_BYTES)
        return self._compiler

    def shutdown(self) -> None:
        """Stop the worker thread (a compile under way finishes first)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def grammar_bitmask(
    seqs: list[Sequence], num_drafts: list[int], vocab_size: int
) -> tuple[torch.Tensor, list[int]] | None:
    """The tokens allowed at each sampled row of a step, for the rows of constrained sequences.

    Args:
        seqs: the sequences that sample this step, in row order; a sequence with drafts (speculative decoding)
            samples ``1 + num_drafts`` consecutive rows, row ``i`` after its first ``i`` drafts.
        num_drafts: the number of drafts of each sequence.
        vocab_size: the model's vocabulary: the bitmask has a bit per token.

    Returns:
        ``None`` when no sequence is constrained; else a ``[rows, ceil(vocab / 32)]`` int32 bitmask on the CPU
        (bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed) and the constrained rows, the only
        rows filled.

    """
    if all(seq.grammar is None for seq in seqs):
        return None
    import xgrammar

    mask = xgrammar.allocate_token_bitmask(len(seqs) + sum(num_drafts), vocab_size)
    rows: list[int] = []
    row = 0
    for seq, drafts in zip(seqs, num_drafts, strict=True):
        matcher = seq.grammar
        if matcher is not None:
            # The drafts are accepted for the rows after them, then rolled back: the engine core accepts the
            # tokens the step really emits. They were trimmed to what the grammar allows when proposed.
            for i in range(drafts + 1):
                matcher.fill_next_token_bitmask(mask, row + i)
                if i < drafts:
                    matcher.accept_token(seq.spec_token_ids[i])
            matcher.rollback(drafts)
            rows += range(row, row + drafts + 1)
        row += drafts + 1
    return mask, rows


def _spec_text(spec: StructuredOutput) -> str:
    """The spec as the compiler takes it: a schema, a regex or an EBNF grammar (choices become one)."""
    if spec.json_object:
        return '{"type": "object"}'
    if spec.choice is not None:
        # JSON string literals are valid EBNF ones (the same escapes); non-ASCII text stays as it is.
        return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
    value = getattr(spec, spec.kind)
    assert isinstance(value, str)  # a dict schema became JSON text when the spec was built
    return value
