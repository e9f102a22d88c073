"""How an embedding request turns a prompt's hidden states into one vector, validated when built."""

import msgspec

from spindle.shared.errors import InvalidRequestError

POOLING_TYPES = ("last", "mean", "cls")
"""``last``: the last token's hidden state (a causal model's default); ``mean``: the mean over the prompt's tokens;
``cls``: the first token's."""


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The pooling of one embedding request, as in vLLM.

    Attributes:
        pooling: one of :data:`POOLING_TYPES`; ``None`` is the model's default (``last``).
        normalize: scale the embedding to unit L2 norm (after truncation to ``dimensions``).
        dimensions: keep the first ``dimensions`` values (for models trained so that a prefix is an embedding of its
            own); ``None`` keeps the whole hidden size.

    Raises:
        InvalidRequestError: for ``pooling_params.<field>``, with the value and what is allowed.

    """

    pooling: str | None = None
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise InvalidRequestError(
                "pooling_params.pooling",
                f"PoolingParams.pooling={self.pooling!r} is invalid: it must be None or one of "
                + ", ".join(POOLING_TYPES),
            )
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(
                "pooling_params.dimensions",
                f"PoolingParams.dimensions={self.dimensions!r} is invalid: it must be None or an integer >= 1",
            )
