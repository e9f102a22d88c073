"""What the paged attention kernels share: K/V addressing in the paged cache, an online-softmax step, layout checks."""

import torch
import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)

INTERPRETED: bool = triton.knobs.runtime.interpret
"""Whether this package's kernels were built for Triton's interpreter (``TRITON_INTERPRET=1`` when it was imported)."""


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the attention kernels must hand ``tl.dot`` float32 operands instead of ``dtype`` ones.

    Only under the interpreter with bfloat16: numpy has no bfloat16, so the interpreter keeps such tensors as raw
    ``uint16`` and its ``tl.dot`` multiplies the bit patterns. Products of bf16 values are exact in float32, so the
    upcast changes the speed, not the result.
    """
    return INTERPRETED and dtype == torch.bfloat16


@triton.jit
def kv_offsets(block_table_ptr, positions, mask, kv_head, stride_cb, stride_cs, stride_ch, BLOCK_SIZE: tl.constexpr):
    """Element offsets (int64) of the K/V rows of one KV head at ``positions`` of a sequence, through its block table.

    Tokens are gathered one by one, so a tile may span several cache blocks of any power-of-two size. ``mask`` says
    which positions are in the context; None when all of them are.
    """
    if mask is None:
        block = tl.load(block_table_ptr + positions // BLOCK_SIZE)
    else:
        block = tl.load(block_table_ptr + positions // BLOCK_SIZE, mask=mask, other=0)
    return block.to(tl.int64) * stride_cb + (positions % BLOCK_SIZE) * stride_cs + kv_head * stride_ch


@triton.jit
def attend_tile(
    q,
    k_cache_ptr,
    v_cache_ptr,
    offsets,
    kv_mask,
    score_mask,
    m,
    row_sum,
    acc,
    scale_log2e,
    softcap,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SOFTCAP: tl.constexpr = False,
    WINDOWED: tl.constexpr = False,
):
    """Fold one K/V tile into the running max ``m``, sum ``row_sum`` and output ``acc`` of the query rows ``q``.

    ``q`` is ``[rows, BLOCK_D]``; ``offsets``/``kv_mask`` address the tile's ``BLOCK_N`` tokens; ``score_mask``
    (``[rows, BLOCK_N]``) says which scores count. Both masks are None for a tile whose keys are all in the context
    and seen by every row: such a tile loads and scores unmasked (but for the padding of a head size that is no
    power of two). ``DOT_FP32`` is :func:`dot_in_fp32`. Scores live in the log2 domain (``exp2``), hence
    ``scale_log2e = scale * log2(e)``. Every row must see at least one key in the first tile it folds, so that its
    running max is finite from then on, unless ``WINDOWED``: then a row may see no key of a tile, even its first.
    With ``SOFTCAP`` each scaled score ``s`` becomes ``softcap * tanh(s / softcap)``.
    """
    d = tl.arange(0, BLOCK_D)
    k_ptrs = k_cache_ptr + offsets[None, :] + d[:, None]
    v_ptrs = v_cache_ptr + offsets[:, None] + d[None, :]
    if kv_mask is not None:
        d_mask = d < HEAD_SIZE
        k = tl.load(k_ptrs, mask=kv_mask[None, :] & d_mask[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask[:, None] & d_mask[None, :], other=0.0)
    elif HEAD_SIZE < BLOCK_D:
        k = tl.load(k_ptrs, mask=(d < HEAD_SIZE)[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=(d < HEAD_SIZE)[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if DOT_FP32:
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    # "ieee" keeps fp32 products exact on GPUs that would round them to TF32 (bf16/fp16 are unaffected).
    scores = tl.dot(q, k, input_precision="ieee")
    if SOFTCAP:
        # tanh(x) = 1 - 2 / (e^(2x) + 1): exact at both ends (e^(2x) overflowing to inf gives 1), and portable.
        doubled = tl.exp2(scores * (2.0 * scale_log2e / softcap))
        scores = (softcap * LOG2E) * (1.0 - 2.0 / (doubled + 1.0))
    else:
        scores = scores * scale_log2e
    if score_mask is not None:
        scores = tl.where(score_mask, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    if WINDOWED:
        # A row that has seen no key yet keeps a max of -inf: exponentiate against 0 instead of -inf - -inf = NaN.
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    # The probabilities are rounded to the cache dtype for the tensor cores, as flash attention does.
    p = p.to(v.dtype)
    if DOT_FP32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, row_sum, acc


def check_layout(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    """Refuse layouts the attention kernels cannot address: they assume unit strides where this checks for them.

    Raises:
        ValueError: for a query or output whose last dimension is strided, caches that are not contiguous or not
            alike, or query heads that are not a multiple of the KV heads.

    """
    if query.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("paged attention needs query and out with a contiguous last dimension")
    if not k_cache.is_contiguous() or not v_cache.is_contiguous() or k_cache.shape != v_cache.shape:
        raise ValueError("paged attention needs contiguous K and V caches of the same shape")
    if query.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{query.shape[1]} query heads do not share {k_cache.shape[2]} KV heads evenly")
