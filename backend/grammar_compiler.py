"""Grammar compiles in worker processes: each one bounded in time, and a crash ends a worker, never the engine.

xgrammar compiles a spec in native code that keeps its thread until it is done: a pathological schema can take
minutes (a JSON schema of 2,000 optional properties does), and a bug in the compiler can crash the process it runs
in. So :class:`GrammarCompilePool` compiles in a small pool of spawned worker processes (pebble's ``ProcessPool``):
a compile that runs past its timeout has its worker killed, a worker that dies fails only the compile it ran, and
pebble starts a fresh worker in either case. The grammar comes back as xgrammar's JSON serialization, without the
tokenizer table that both sides hold (the workers get the engine's own, serialized, when they start), and is rebuilt
here: the engine's process never runs the compiler.

xgrammar imports torch, and building its tokenizer table takes seconds, so nothing starts before the first compile
(the pool's own thread loads the table and starts the workers).
"""

import contextlib
import json
import logging
import multiprocessing
import os
import re
import signal
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from pebble import ProcessExpired, ProcessPool

from spindle.backend.parent_death import die_with_parent
from spindle.shared.errors import EngineUnavailableError, InvalidRequestError

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar, GrammarCompiler, TokenizerInfo

logger = logging.getLogger(__name__)

# xgrammar's errors start with a timestamp and the C++ source line: "[22:52:48] /project/cpp/x.cc:820: ...".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class CompileAbandonedError(InvalidRequestError):
    """A spec's compile ran past the timeout, or crashed its worker: the spec is refused, but not for good.

    It may compile on a quieter machine (a timeout), and a crash is the compiler's fault as much as the spec's, so
    a cache keeps this refusal for a while only (:data:`~spindle.backend.structured_output.REFUSAL_TTL`).
    """


class GrammarCompilePool:
    """Compiles structured-output specs in ``workers`` worker processes, each compile within ``timeout`` seconds.

    Args:
        model_dir: the model directory, whose tokenizer files xgrammar reads to map grammar bytes to token ids.
        vocab_size: the model's vocabulary (rows of the lm head).
        eos_token_ids: the tokens that end a sequence (already those below ``vocab_size``).
        workers: worker processes; a compile beyond them waits for one to be free.
        timeout: seconds a compile may run in its worker (waiting for a free worker does not count).

    Attributes:
        num_compiles: compiles sent to the workers since start-up.

    """

    def __init__(
        self, model_dir: Path, vocab_size: int, eos_token_ids: list[int], workers: int, timeout: float
    ) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.workers = workers
        self.timeout = timeout
        self.num_compiles = 0
        # One thread hands the compiles to the pool, after loading the tokenizer table first: never the caller's.
        self._scheduler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spindle-grammar")
        self._tokenizer_info: TokenizerInfo | None = None
        self._pool: ProcessPool | None = None

    def submit(self, kind: str, text: str) -> "Future[CompiledGrammar]":
        """Compile ``text``, a spec of ``kind`` as the compiler takes it; the future's result is the grammar.

        The future's exception: an :class:`~spindle.shared.errors.InvalidRequestError` for
        ``sampling_params.structured_output.<kind>`` with the compiler's message when the spec does not compile, a
        :class:`CompileAbandonedError` when it ran past the timeout or crashed its worker, an
        :class:`~spindle.shared.errors.EngineUnavailableError` when the tokenizer table cannot be built or the
        workers cannot start.
        """
        result: Future[CompiledGrammar] = Future()
        self._scheduler.submit(self._schedule, kind, text, result)
        return result

    def shutdown(self) -> None:
        """Stop the workers (a compile under way is killed) and the thread; pending compiles never finish."""
        self._scheduler.shutdown(wait=False, cancel_futures=True)
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join()

    def _schedule(self, kind: str, text: str, result: "Future[CompiledGrammar]") -> None:
        try:
            # compile_in_worker is looked up at each compile, so that a test can have the workers run its own.
            task = self._running_pool().schedule(compile_in_worker, args=(kind, text), timeout=self.timeout)
        except Exception as error:  # the request is fine; this backend cannot constrain (tried again next time)
            logger.exception("Structured output is unavailable: no tokenizer table for xgrammar, or no workers")
            result.set_exception(EngineUnavailableError(f"structured output is unavailable on this backend: {error}"))
            return
        self.num_compiles += 1
        task.add_done_callback(lambda task: self._receive(kind, task, result))

    def _running_pool(self) -> ProcessPool:
        """The pool, started (or started again, when it broke) along with the tokenizer table it needs."""
        if self._tokenizer_info is None:
            self._tokenizer_info = self._load_tokenizer_info()
        if self._pool is None or not self._pool.active:
            # Spawned, not forked: this process runs threads (ZeroMQ, torch's), which a fork would copy mid-flight.
            self._pool = ProcessPool(
                max_workers=self.workers,
                initializer=start_worker,
                initargs=(self._tokenizer_info.serialize_json(), os.getpid()),
                context=multiprocessing.get_context("spawn"),
            )
        return self._pool

    def _load_tokenizer_info(self) -> "TokenizerInfo":
        import xgrammar
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids or None
        )

    def _receive(self, kind: str, task: Future, result: "Future[CompiledGrammar]") -> None:
        """Settle ``result`` from the worker's ``task``: the grammar rebuilt here, or why there is none."""
        import xgrammar

        field = f"sampling_params.structured_output.{kind}"
        try:
            grammar = xgrammar.CompiledGrammar.deserialize_json(task.result(), self._tokenizer_info)
        except InvalidRequestError as error:
            result.set_exception(error)
        except TimeoutError:
            logger.warning("A %s did not compile within %g s: its worker was killed", kind, self.timeout)
            reason = f"the {kind} did not compile within {self.timeout:g} s: simplify it (fewer optional properties"
            result.set_exception(CompileAbandonedError(field, reason + ", alternatives or repetitions)"))
        except ProcessExpired as error:
            how = _exit_status(error.exitcode)
            logger.error("The grammar compiler crashed (%s) on a %s: its worker is replaced", how, kind)
            reason = f"the {kind} crashed the grammar compiler ({how}): simplify it, or report it as a bug"
            result.set_exception(CompileAbandonedError(field, reason))
        except Exception as error:  # the pool broke, or the grammar came back unreadable: not the request's fault
            logger.exception("A grammar compile failed in the compile pool")
            result.set_exception(EngineUnavailableError(f"structured output failed on this backend: {error}"))
        else:
            result.set_result(grammar)


_compiler: "GrammarCompiler | None" = None
"""A worker's compiler (no cache: the engine caches compiled grammars by spec)."""


def start_worker(tokenizer_info: str, parent_pid: int) -> None:
    """Set up a worker process: exit with the engine's process, build the compiler of the serialized table."""
    import xgrammar

    global _compiler
    # SIGKILL, not SIGTERM: a worker in the middle of a compile runs no Python signal handler until it is done.
    die_with_parent(parent_pid, signal.SIGKILL)
    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info)
    _compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


# xgrammar's JSON number rules: an integer part of unbounded digits, a fraction and an exponent of one or more.
_INTEGER_PART = re.compile(r"\[1-9\] \[0-9\]\*")
_FRACTION = re.compile(r'\("\." (\w+)\{1, -1\}\)')
_EXPONENT = re.compile(r"\[eE\] (\w+) (\w+)\{1, -1\}")


def bounded_numbers(ebnf: str) -> str:
    """A JSON grammar's (xgrammar's EBNF) number literals bounded to what a double holds.

    xgrammar lets a number have any count of digits, and a model writing one can go on until ``max_tokens`` cuts the
    JSON off (``2000000000.000000000125000022393411251...``). Here an integer part has at most 16 digits (a double's
    15-17 significant ones), a fraction at most 16, and an exponent at most 308: every literal parses to a finite
    double, and a long one must end where a double would stop telling its digits apart.

    Raises:
        RuntimeError: the grammar has numbers whose rules are not the ones this rewrites (another xgrammar).

    """
    bounded, integers = _INTEGER_PART.subn("[1-9] [0-9]{0, 15}", ebnf)
    bounded, fractions = _FRACTION.subn(r'("." \1{1, 16})', bounded)
    bounded, exponents = _EXPONENT.subn(r'[eE] \1 (\2 | \2 \2 | [0-2] \2 \2 | "30" [0-8])', bounded)
    if "basic_number ::=" in ebnf and not (integers and fractions == exponents == 1):
        raise RuntimeError("xgrammar's JSON number rules changed: bounded_numbers() needs updating")
    return bounded


def structural_tag_format(text: str) -> str:
    """A structural tag in xgrammar's ``format`` form.

    The older ``structures``/``triggers`` form (vLLM's first) becomes the ``triggered_tags`` format it stands for;
    the ``format`` form is taken as it is.
    """
    tag = json.loads(text)
    if "structures" not in tag:
        return text
    tags = [
        {"begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]}, "end": s["end"]}
        for s in tag["structures"]
    ]
    triggered = {"type": "triggered_tags", "triggers": tag.get("triggers", []), "tags": tags}
    return json.dumps({"type": "structural_tag", "format": triggered})


def compile_in_worker(kind: str, text: str) -> str:
    """Compile a spec in a worker; its grammar serialized as JSON.

    Raises:
        InvalidRequestError: the spec does not compile (field ``sampling_params.structured_output.<kind>``, the
            compiler's message without its log prefix).

    """
    assert _compiler is not None, "start_worker runs first"
    try:
        match kind:
            case "json_schema" | "json_object":
                import xgrammar

                # No free whitespace: a model could pad with it forever, and compact JSON is what it wants.
                schema = xgrammar.Grammar.from_json_schema(text, any_whitespace=False)
                grammar = _compiler.compile_grammar(bounded_numbers(str(schema)))
            case "regex":
                grammar = _compiler.compile_regex(text)
            case "structural_tag":
                import xgrammar

                tagged = xgrammar.Grammar.from_structural_tag(structural_tag_format(text))
                grammar = _compiler.compile_grammar(bounded_numbers(str(tagged)))
            case _:  # grammar, and choice (turned into one)
                grammar = _compiler.compile_grammar(text)
    except Exception as error:
        message = _LOG_PREFIX.sub("", str(error)).strip()
        field = f"sampling_params.structured_output.{kind}"
        raise InvalidRequestError(field, f"the {kind} does not compile: {message}") from None
    return grammar.serialize_json()


def _exit_status(code: int | None) -> str:
    """How a worker ended, in words: ``killed by SIGSEGV``, ``exit code 3``."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
