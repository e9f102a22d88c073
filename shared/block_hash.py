"""The prefix cache's block hashes: SHA-256 chains, one digest per full block of a prompt.

The backend keys its cached KV blocks by them (:class:`~spindle.backend.block_manager.BlockManager`), and the
frontend's data-parallel router hashes prompts the same way to tell which engine likely caches a prefix. Only
``hashlib`` and ``array``: both processes load this module.
"""

import hashlib
from array import array
from collections.abc import Iterable

_UNSALTED_ROOT = hashlib.sha256(b"spindle-kv-unsalted").digest()


def root_hash(cache_salt: str | None, lora_id: int | None = None) -> bytes:
    """The digest a sequence's first block chains from: one per salt (or none) and LoRA adapter (or none).

    The salt is hashed under its own prefix, so no salt gives the unsalted root and no two salts give the same one.
    An adapter changes every layer's K/V, so its sequences chain from the salt's root hashed again under another
    prefix with the adapter's id: no two adapters, nor an adapter and the base model, share a block. The id is the
    one :mod:`spindle.backend.lora_manager` gives each loaded adapter, never reused, so an adapter unloaded and loaded
    again with other weights under the same name finds none of the old blocks.
    """
    root = _UNSALTED_ROOT
    if cache_salt is not None:
        root = hashlib.sha256(b"spindle-kv-salt\0" + cache_salt.encode("utf-8", "surrogatepass")).digest()
    if lora_id is not None:
        root = hashlib.sha256(b"spindle-kv-lora\0" + str(lora_id).encode() + b"\0" + root).digest()
    return root


def block_hash(parent: bytes, token_ids: Iterable[int], image_hashes: bytes = b"") -> bytes:
    """SHA-256 of the parent block's 32-byte digest, the block's token ids as 8-byte integers, and image digests.

    Every part has a fixed width (``image_hashes`` is a run of 32-byte digests), so the encoding is unambiguous, and
    the chain makes a block's digest stand for its whole prefix (and the salt at its root). ``image_hashes`` holds the
    content hashes of the images whose placeholder tokens the block holds: the placeholders are the same token ids
    for every image, so without them two different images would share K/V.
    """
    return hashlib.sha256(parent + array("q", token_ids).tobytes() + image_hashes).digest()


def fold_hash(digest: bytes) -> int:
    """A block digest as the signed 64-bit integer the vLLM engine protocol's ``block_hash`` carries.

    Its first 8 bytes, big-endian, two's complement: SHA-256's bytes are uniform, so folding keeps the chain's
    hashes distinct (a collision among a cache's blocks is as likely as in any random 64-bit ids, ~n²/2⁶⁵) and a
    subscriber that sees the same prefix twice sees the same number.
    """
    return int.from_bytes(digest[:8], "big", signed=True)
