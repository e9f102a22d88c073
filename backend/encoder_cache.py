"""The model runner's image embeddings, by image content, within a budget of embedding rows.

A vision-language prompt's image is encoded in the first step whose chunk reaches its placeholder, and its
embeddings are kept here for the later chunks (a long placeholder spans several), for the other completions of the
request, and for any other request with the same image (keyed by the image's content hash, as the prefix cache's
blocks are). When the cache holds more than its budget of rows, the least recently used images leave, except those
whose placeholders a sequence has still to compute (the runner says which); an image that left and is needed again
(a preempted sequence, recomputed) is encoded again.
"""

from collections import OrderedDict
from collections.abc import Collection

import torch


class EncoderCache:
    """Image embeddings ``[tokens, hidden]`` by content hash, least recently used first, within ``max_tokens`` rows.

    Attributes:
        max_tokens: the budget of embedding rows; exceeded only while the images still needed hold more.
        num_tokens: the rows held now.

    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __contains__(self, content_hash: bytes) -> bool:
        return content_hash in self._entries

    def get(self, content_hash: bytes) -> torch.Tensor:
        """An image's embeddings, now the most recently used."""
        self._entries.move_to_end(content_hash)
        return self._entries[content_hash]

    def add(self, encoded: dict[bytes, torch.Tensor], keep: Collection[bytes]) -> None:
        """Hold newly encoded images, then leave the budget to the most recently used; never drop those in ``keep``."""
        for content_hash, embeds in encoded.items():
            self._entries[content_hash] = embeds
            self.num_tokens += embeds.shape[0]
        for content_hash in list(self._entries):
            if self.num_tokens <= self.max_tokens:
                break
            if content_hash not in keep:
                self.num_tokens -= self._entries.pop(content_hash).shape[0]
