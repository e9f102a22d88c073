"""``LLMEngine``: add requests, abort one, and step until the rest finish."""

from spindle import LLMEngine, SamplingParams

engine = LLMEngine.from_args(kv_cache_memory="256MiB")
greedy = SamplingParams(temperature=0, max_tokens=8)
engine.add_request("capital", "The capital of France is", greedy)
engine.add_request("story", "Once upon a time", SamplingParams(temperature=0.8, seed=0, max_tokens=64))
engine.add_request("name", "Hello, my name is", greedy, delta=True)  # each output holds only the new text

step = 0
while engine.has_unfinished_requests():
    step += 1
    for output in engine.step():
        completion = output.outputs[0]
        print(f"step {step}: {output.request_id}: {completion.text!r} finished={output.finished}")
    if step == 2:
        engine.abort_request("story")  # its blocks are free at once; it gets no more outputs
print("KV blocks:", engine.num_kv_blocks, "- unfinished:", engine.get_num_unfinished_requests())
