"""The engines users call, the one admission path their requests take, and the engine clients below them.

``LLM``, ``LLMEngine`` and ``AsyncLLMEngine``; ``admission``; the clients of an engine core in this process, of a
backend process (blocking or asyncio, with the supervisor that brings a dead one back), and of several backends
behind data-parallel routing.
"""
