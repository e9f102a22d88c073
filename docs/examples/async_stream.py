"""``AsyncLLMEngine``: concurrent streams from a backend process, one of them cancelled."""

import asyncio

from spindle import SamplingParams
from spindle.frontend.engine.async_llm_engine import AsyncLLMEngine


async def stream(engine: AsyncLLMEngine, request_id: str, prompt: str) -> str:
    """Print each new piece of text as it arrives; return the whole completion."""
    params = SamplingParams(temperature=0, max_tokens=16)
    text = ""
    async for output in engine.generate(prompt, params, request_id=request_id, delta=True):
        text += output.outputs[0].text
        print(f"{request_id}: +{output.outputs[0].text!r}")
    return text


async def main(engine: AsyncLLMEngine) -> None:
    """Run two streams, cancel a third mid-way, and abort a fourth by id."""
    first = asyncio.create_task(stream(engine, "first", "The capital of France is"))
    second = asyncio.create_task(stream(engine, "second", "Hello, my name is"))
    doomed = asyncio.create_task(stream(engine, "doomed", "Once upon a time"))
    await asyncio.sleep(0)  # let the streams start
    doomed.cancel()  # the request is aborted in the backend and its KV blocks are freed
    print(await first, "|", await second)
    try:
        await doomed
    except asyncio.CancelledError:
        print("doomed: cancelled")

    # abort() ends a stream from outside: its last output says finish_reason="abort".
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async for output in engine.generate("Count: 1, 2, 3,", params, request_id="long"):
        if len(output.outputs[0].token_ids) == 4:
            await engine.abort("long")
    print("long:", output.outputs[0].finish_reason)


engine = AsyncLLMEngine.from_args(kv_cache_memory="256MiB")  # starts the backend process
try:
    asyncio.run(main(engine))
finally:
    engine.shutdown()  # stops the backend this engine started
