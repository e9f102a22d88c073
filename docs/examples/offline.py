"""Offline batch generation with ``LLM``: every ``PromptInputs`` form in one call."""

from spindle import LLM, SamplingParams

llm = LLM(kv_cache_memory="256MiB")  # the embedded SmolLM2-135M-Instruct
token_ids = llm.get_tokenizer().encode("The capital of France is")
outputs = llm.generate(
    [
        "Hello, my name is",  # a plain string
        {"prompt": "The capital of France is"},  # a TextPrompt
        {"prompt_token_ids": token_ids},  # a TokensPrompt: passed to the model unchanged
    ],
    SamplingParams(temperature=0, max_tokens=16),
)
for output in outputs:  # in input order
    print(repr(output.prompt), "->", repr(output.outputs[0].text), output.outputs[0].finish_reason)

# The TextPrompt and the TokensPrompt hold the same tokens, so greedy decoding gives the same completion.
assert outputs[1].outputs[0].token_ids == outputs[2].outputs[0].token_ids

# A text-only model refuses multi_modal_data, before anything is queued.
try:
    llm.generate({"prompt": "Describe the image.", "multi_modal_data": {"image": b"..."}})
except ValueError as error:
    print("refused:", error)
