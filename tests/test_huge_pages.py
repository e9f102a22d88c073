"""The CPU kernels' weights gathered onto huge pages: aligned, advised, and computing what they computed before."""

import sys
from collections.abc import Callable

import pytest
import torch

from spindle.kernels import huge_pages, quant
from spindle.kernels.linear import Projection
from spindle.kernels.moe import Experts, quantize_experts


def vm_flags(address: int) -> list[str]:
    """The ``VmFlags`` of this process' mapping that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if not fields[0].endswith(":"):  # a mapping's first line: "start-end perms offset dev inode path"
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "VmFlags:":
                return fields[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_empty_is_zeroed_and_starts_on_a_huge_page() -> None:
    block = huge_pages.empty(5 << 20)

    assert block.dtype == torch.uint8 and block.numel() == 5 << 20
    assert block.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert not block.any()
    if sys.platform == "linux":
        assert "hg" in vm_flags(block.data_ptr())  # advised: MADV_HUGEPAGE


def assert_gathered(holders: list[huge_pages.KernelWeights], run: Callable[[], list[torch.Tensor]]) -> None:
    """Gather ``holders`` and check it: one block, in order, the same tensors, and ``run()`` computing as before."""
    before = run()
    layouts = [holder.kernel_tensors() for holder in holders]

    moved = huge_pages.gather(holders)

    after = [holder.kernel_tensors() for holder in holders]
    assert [len(tensors) for tensors in after] == [len(tensors) for tensors in layouts]
    if not any(layouts):  # a CPU where none of these kernels runs: nothing to move
        assert moved == 0
        return
    flat = [tensor for tensors in after for tensor in tensors]
    assert len({tensor.untyped_storage().data_ptr() for tensor in flat}) == 1  # one block
    addresses = [tensor.data_ptr() for tensor in flat]
    assert addresses == sorted(addresses) and all(address % 64 == 0 for address in addresses)  # in order, lines apart
    assert moved == sum(-(-tensor.nbytes // 64) * 64 for tensor in flat)
    for old, new in zip([tensor for tensors in layouts for tensor in tensors], flat, strict=True):
        assert old.dtype == new.dtype and torch.equal(old, new)
    for got, expected in zip(run(), before, strict=True):
        assert torch.equal(got, expected)


def test_gather_moves_every_projection_layout_into_one_block_and_keeps_the_results() -> None:
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(96, 128, generator=generator) * 0.1 for _ in range(3)]
    projections = [
        Projection(weights[0].to(torch.bfloat16), None, quant.quantize(weights[0], 4)),  # a8_linear where AVX2 is
        Projection(weights[1].to(torch.bfloat16)),  # bf16_linear's tiles where AVX-512 bf16 is
        Projection(weights[2].to(torch.bfloat16), None, quant.quantize(weights[2], 8)),  # W8A8 where VNNI is
    ]
    x = torch.randn(3, 128, generator=generator).to(torch.bfloat16)

    assert_gathered(projections, lambda: [projection(x) for projection in projections])


def test_gather_moves_the_experts_tiles_and_quantized_stacks() -> None:
    generator = torch.Generator().manual_seed(1)
    w13 = (torch.randn(4, 64, 64, generator=generator) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(4, 64, 32, generator=generator) * 0.1).to(torch.bfloat16)
    experts = [Experts(w13, w2), Experts(quantize_experts(w13.float(), 4), quantize_experts(w2.float(), 8))]
    x = torch.randn(5, 64, generator=generator).to(torch.bfloat16)
    weights = torch.rand(5, 2, generator=generator)
    ids = torch.randint(0, 4, (5, 2), generator=generator)

    assert_gathered(experts, lambda: [layer(x, weights, ids) for layer in experts])
    assert experts[1].kernel_tensors()  # the quantized stacks run the C++ op on every CPU


def test_gather_moves_nothing_without_kernel_layouts() -> None:
    dense = Projection(torch.randn(16, 32))  # float32: oneDNN's packed weight or the plain one, no layout of ours

    assert dense.kernel_tensors() == [] and huge_pages.gather([dense]) == 0


@pytest.mark.parametrize("nbytes", [1, huge_pages.HUGE_PAGE + 1])
def test_empty_holds_sizes_around_a_page(nbytes: int) -> None:
    block = huge_pages.empty(nbytes)
    block.fill_(7)
    assert block.numel() == nbytes and int(block.sum()) == 7 * nbytes
