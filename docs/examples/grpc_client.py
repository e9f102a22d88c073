"""The Python gRPC client against a running ``spindle serve`` (see the Quickstart); prints what the docs show."""

from spindle.client import SpindleClient

with SpindleClient("localhost:50051", timeout=60) as client:
    print(client.health())
    info = client.model_info()
    print(info.model_name, info.max_model_len, info.vocab_size)

    # Generate streams deltas: each message holds only the new text of each choice.
    for response in client.generate("The capital of France is", max_tokens=8, temperature=0):
        for choice in response.choices:
            print(repr(choice.text), end=" ")
        if response.finished:
            print("\nusage:", response.usage.prompt_tokens, "+", response.usage.completion_tokens)

    reply = "".join(
        choice.text
        for response in client.chat([{"role": "user", "content": "Say hi."}], max_tokens=16, temperature=0)
        for choice in response.choices
    )
    print("chat:", reply)
    ids = client.tokenize("Hello, world")
    print(ids, repr(client.detokenize(ids)))
