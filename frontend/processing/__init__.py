"""Request processing on the frontend's side of the engine core.

The tokenizer and chat templates, prompt and image checks, tool calls, incremental detokenization, and the outputs
built from each step's deltas.
"""
