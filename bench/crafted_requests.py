"""Crafted requests beside ordinary streams: does any one request take the server down, or starve the others?

Starts ``spindle serve`` (its own backend, the embedded model unless ``--model``), measures a few ordinary greedy
streams alone, then runs each crafted case beside them: a hostile or careless tenant's request (deep JSON in request
fields, huge inputs, unbounded per-token work, forged log lines, a stream nobody reads, other tenants' request ids,
...). Each row says what the crafted request got (a gRPC status, ``ok`` or ``HUNG`` past ``--deadline``), whether
the ordinary streams beside it kept their solo text, and their time as a multiple of their time alone, run just
before the case (the machine's pace drifts). A case
*holds* when its request gets a clear status (or finishes, bounded) and the ordinary streams are unchanged within
``--slow`` times their solo time::

    python -m bench.crafted_requests            # every case
    python -m bench.crafted_requests --case stop_strings --case embed_inputs
"""

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from spindle.client import sampling_params
from spindle.v1 import spindle_pb2, spindle_pb2_grpc

ORDINARY_PROMPTS = ["The capital of France is", "Write a haiku about rivers.", "List three prime numbers:"]
DEEP = 5000  # nesting levels of the deep-JSON cases: past Python's recursion limit
FORGED = "2026-01-01 00:00:00,000 INFO spindle: forged line"


@dataclass
class Ordinary:
    """What the ordinary streams produced: their texts and the time all of them took."""

    texts: list[str]
    seconds: float
    error: str | None = None


def deep_schema(levels: int) -> str:
    """A JSON schema of objects nested ``levels`` deep."""
    return '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels


def deep_array(levels: int) -> str:
    """A JSON array nested ``levels`` deep."""
    return "[" * levels + "]" * levels


async def ordinary_streams(stub: spindle_pb2_grpc.SpindleServiceStub, max_tokens: int) -> Ordinary:
    """Run the ordinary greedy streams at once; their texts and the time they took together."""

    async def one(prompt: str) -> str:
        request = spindle_pb2.GenerateRequest(
            prompt=spindle_pb2.Prompt(text=prompt),
            sampling_params=sampling_params(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        )
        return "".join([c.text for r in [r async for r in stub.Generate(request)] for c in r.choices])

    start = time.perf_counter()
    try:
        texts = await asyncio.gather(*(one(p) for p in ORDINARY_PROMPTS))
    except grpc.aio.AioRpcError as error:
        return Ordinary([], time.perf_counter() - start, error.code().name)
    return Ordinary(list(texts), time.perf_counter() - start)


async def status_of(call: Awaitable[object]) -> str:
    """``ok``, or the name of the gRPC status the call ended with."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code().name
    return "ok"


async def drain(stream: grpc.aio.UnaryStreamCall) -> None:
    """Read a stream to its end."""
    async for _ in stream:
        pass


async def bracket_bias(stub: spindle_pb2_grpc.SpindleServiceStub) -> dict[int, float]:
    """+100 on the tokens of runs of opening brackets: the model's reply becomes ever deeper JSON."""
    runs = ["[" * 64, "{" * 64, "[{" * 32]
    tokenized = await asyncio.gather(
        *(stub.Tokenize(spindle_pb2.TokenizeRequest(text=run, add_special_tokens=False)) for run in runs)
    )
    return {token_id: 100.0 for response in tokenized for token_id in response.token_ids}


WEATHER_TOOL = spindle_pb2.Tool(
    name="get_weather",
    description="The weather in a city",
    parameters=json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}),
)


def cases(
    stub: spindle_pb2_grpc.SpindleServiceStub,
    peer: spindle_pb2_grpc.SpindleServiceStub,
    bias: dict[int, float],
    log: Path,
) -> dict[str, Callable[[], Awaitable[str]]]:
    """Each crafted case: a coroutine factory returning what its request got (``peer`` is another connection)."""

    def chat(**fields: object) -> spindle_pb2.ChatRequest:
        return spindle_pb2.ChatRequest(messages=[spindle_pb2.ChatMessage(role="user", content="Hi")], **fields)

    def generate(**params: object) -> spindle_pb2.GenerateRequest:
        return spindle_pb2.GenerateRequest(
            prompt=spindle_pb2.Prompt(text="Once upon a time"), sampling_params=sampling_params(**params)
        )

    async def never_read() -> str:
        stream = stub.Generate(generate(temperature=0, max_tokens=4000, ignore_eos=True))
        await stream.initial_metadata()
        await asyncio.sleep(30)  # a client that reads nothing for a while, then goes away
        stream.cancel()
        return "ok"

    async def forge_a_log_line() -> str:
        request = spindle_pb2.GenerateRequest(
            request_id=f"x\n{FORGED}",
            prompt=spindle_pb2.Prompt(text="Hi"),
            sampling_params=sampling_params(max_tokens=4),
        )
        status = await status_of(drain(stub.Generate(request)))
        forged = any(line.startswith(FORGED) for line in log.read_text().splitlines())
        return "FORGED a log line" if forged else status

    async def other_tenants_abort() -> str:
        victim = stub.Generate(
            spindle_pb2.GenerateRequest(
                request_id="victim-1",
                prompt=spindle_pb2.Prompt(text="Count to fifty:"),
                sampling_params=sampling_params(temperature=0, max_tokens=64, ignore_eos=True),
            )
        )
        await victim.initial_metadata()
        try:
            answer = await peer.Abort(spindle_pb2.AbortRequest(request_id="victim-1"))
        except grpc.aio.AioRpcError as error:
            aborted = error.code().name
        else:
            aborted = "ABORTED" if answer.aborted else "refused"
        finish = [c.finish_reason for r in [r async for r in victim] for c in r.choices if c.finish_reason]
        return f"{aborted}, the victim {spindle_pb2.FinishReason.Name(finish[-1])}"

    return {
        "tools_nested_brackets": lambda: status_of(
            drain(
                stub.Chat(
                    chat(
                        tools=[WEATHER_TOOL],
                        sampling_params=sampling_params(temperature=0, max_tokens=3000, logit_bias=bias),
                    )
                )
            )
        ),
        "deep_json_schema": lambda: status_of(
            drain(
                stub.Generate(
                    generate(
                        max_tokens=8, structured_output=spindle_pb2.StructuredOutput(json_schema=deep_schema(DEEP))
                    )
                )
            )
        ),
        "deep_tool_parameters": lambda: status_of(
            drain(stub.Chat(chat(tools=[spindle_pb2.Tool(name="f", parameters=deep_schema(DEEP))])))
        ),
        "deep_tool_call_arguments": lambda: status_of(
            drain(
                stub.Chat(
                    spindle_pb2.ChatRequest(
                        messages=[
                            spindle_pb2.ChatMessage(role="user", content="Hi"),
                            spindle_pb2.ChatMessage(
                                role="assistant",
                                tool_calls=[spindle_pb2.ToolCall(id="c1", name="f", arguments=deep_array(DEEP))],
                            ),
                            spindle_pb2.ChatMessage(role="tool", tool_call_id="c1", content="done"),
                        ],
                        tools=[WEATHER_TOOL],
                        sampling_params=sampling_params(max_tokens=8),
                    )
                )
            )
        ),
        "very_deep_schema_compile": lambda: status_of(
            drain(
                stub.Generate(
                    generate(max_tokens=8, structured_output=spindle_pb2.StructuredOutput(json_schema=deep_schema(60)))
                )
            )
        ),
        "embed_inputs": lambda: status_of(
            stub.Embed(spindle_pb2.EmbedRequest(inputs=[spindle_pb2.Prompt(text=f"item {i}") for i in range(20000)]))
        ),
        "stop_strings": lambda: status_of(
            drain(stub.Generate(generate(max_tokens=200, ignore_eos=True, stop=[f"zq{i:05d}x" for i in range(20000)])))
        ),
        "stop_token_ids": lambda: status_of(
            drain(stub.Generate(generate(max_tokens=200, ignore_eos=True, stop_token_ids=list(range(40000, 49000)))))
        ),
        "bias_most_of_vocab": lambda: status_of(
            drain(
                stub.Generate(
                    generate(n=16, max_tokens=100, ignore_eos=True, logit_bias={i: 0.5 for i in range(40000)})
                )
            )
        ),
        "newline_request_id": forge_a_log_line,
        "lowest_priority_value": lambda: status_of(
            drain(stub.Generate(spindle_pb2.GenerateRequest(prompt=spindle_pb2.Prompt(text="Hi"), priority=-(2**31))))
        ),
        "huge_tokenize": lambda: status_of(stub.Tokenize(spindle_pb2.TokenizeRequest(text="lorem ipsum " * 300_000))),
        "watch_load_subscribers": lambda: watchers(peer),  # a tenant of its own connection
        "never_read_stream": never_read,
        "abort_other_tenants_request": other_tenants_abort,
    }


async def watchers(stub: spindle_pb2_grpc.SpindleServiceStub, count: int = 2000) -> str:
    """Open ``count`` WatchLoad streams at once and hold them briefly: the statuses they got, by count."""
    streams = [stub.WatchLoad(spindle_pb2.WatchLoadRequest()) for _ in range(count)]

    async def first(stream: grpc.aio.UnaryStreamCall) -> str:
        try:
            await asyncio.wait_for(stream.read(), 10)
        except grpc.aio.AioRpcError as error:
            return error.code().name
        except TimeoutError:
            return "NO_REPORT"
        return "ok"

    outcomes = await asyncio.gather(*(first(s) for s in streams))
    for stream in streams:
        stream.cancel()
    return " ".join(f"{o}x{outcomes.count(o)}" for o in sorted(set(outcomes)))


async def alone(stub: spindle_pb2_grpc.SpindleServiceStub, max_tokens: int, timeout: float = 120.0) -> Ordinary:
    """The ordinary streams alone, once they succeed (an earlier case may have cost the server its backend: a
    restart takes ~20 s); their error if they do not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (ordinary := await ordinary_streams(stub, max_tokens)).error is not None and time.monotonic() < deadline:
        await asyncio.sleep(1)
    return ordinary


async def run(args: argparse.Namespace, port: int, log: Path) -> list[tuple[str, str, str, float]]:
    """Every chosen case beside the ordinary streams: (case, its status, ordinary texts kept, ordinary time ratio)."""
    options = [("grpc.max_receive_message_length", 64 * 2**20), ("grpc.max_send_message_length", 64 * 2**20)]
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel,
        grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[*options, ("grpc.primary_user_agent", "peer")]
        ) as other,
    ):
        stub, peer = spindle_pb2_grpc.SpindleServiceStub(channel), spindle_pb2_grpc.SpindleServiceStub(other)
        solo = [await ordinary_streams(stub, args.max_tokens) for _ in range(3)]
        reference = solo[0].texts
        print(f"ordinary streams alone: {statistics.median(s.seconds for s in solo):.2f} s (median of 3)")
        rows = []
        for name, crafted in cases(stub, peer, await bracket_bias(stub), log).items():
            if args.case and name not in args.case:
                continue
            # Alone just before, as the machine's pace drifts: the ratio compares neighbours.
            before = await alone(stub, args.max_tokens)
            if before.error is not None:
                rows.append((name, "not run: the server no longer serves", before.error, math.inf))
                print(f"{name:>28}: not run, the server no longer serves ({before.error})", flush=True)
                continue
            solo_seconds = before.seconds
            task = asyncio.ensure_future(asyncio.wait_for(crafted(), args.deadline))
            await asyncio.sleep(0.2)  # the crafted request first, as an attacker would
            beside = await ordinary_streams(stub, args.max_tokens)
            try:
                status = await task
            except TimeoutError:
                status = "HUNG"
            kept = beside.error or ("same" if beside.texts == reference else "DIFFERENT")
            rows.append((name, status, kept, beside.seconds / solo_seconds))
            print(f"{name:>28}: {status:<40} ordinary {kept:<9} x{beside.seconds / solo_seconds:5.2f}", flush=True)
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model to serve (default: the embedded SmolLM2)")
    parser.add_argument("--case", action="append", help="run only this case (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per ordinary stream")
    parser.add_argument("--deadline", type=float, default=180.0, help="seconds before a crafted request is HUNG")
    parser.add_argument("--log", help="keep the server's log in this file (default: a temporary one)")
    parser.add_argument("--slow", type=float, default=2.0, help="ordinary time ratio above which a case fails")
    args = parser.parse_args()
    env = {**os.environ, "SPINDLE_PORT": "0"}
    if args.model:
        env["SPINDLE_MODEL"] = args.model
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(args.log or Path(scratch) / "serve.log")
        with log.open("w") as stderr:
            server = subprocess.Popen(
                [sys.executable, "-m", "spindle.cli", "serve", "--log-format", "text"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        try:
            banner = server.stdout.readline()  # "spindle: serving MODEL on HOST:PORT" once it listens
            if not banner:
                raise SystemExit(f"spindle serve exited with code {server.wait()} before it listened")
            rows = asyncio.run(run(args, int(banner.rsplit(":", 1)[1]), log))
        finally:
            server.terminate()
            server.wait(60)
        restarts = log.read_text().count("Engine ready on") - 1  # the first start, then each restart
    print(f"backend restarts during the run: {restarts}")
    unclear = ("HUNG", "INTERNAL", "UNAVAILABLE", "FORGED", "ABORTED")
    held = [
        name
        for name, status, kept, ratio in rows
        if not status.startswith(unclear) and kept == "same" and ratio <= args.slow
    ]
    print(f"held: {len(held)} of {len(rows)}; not held: {', '.join(r[0] for r in rows if r[0] not in held) or '-'}")


if __name__ == "__main__":
    main()
