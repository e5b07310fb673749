"""tests/interpreter_bounds.py, the suite's memory checker for the kernels Triton's interpreter
runs: it stops a load, a store or an atomic past the end of a launch's tensors, and a TMA
descriptor the hardware would refuse, and lets everything inside them run."""

import pytest
import torch
import triton
import triton.language as tl
from interpreter_bounds import OutOfBounds
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _copy(X, Y, N: tl.constexpr, MASKED: tl.constexpr):
    offs = tl.arange(0, N)
    if MASKED:
        tl.store(Y + offs, tl.load(X + offs, mask=offs < 8, other=0.0), mask=offs < 8)
    else:
        tl.store(Y + offs, tl.load(X + offs))


@triton.jit
def _gather(X, Y, FAR, OUT):
    """Half the elements from X, half from ``FAR`` elements past it (in Y, when FAR is where Y
    lies)."""
    offs = tl.arange(0, 16)
    tl.store(OUT + offs, tl.load(X + tl.where(offs < 8, offs, FAR + offs - 8)))


@triton.jit
def _count(X, AT):
    tl.atomic_add(X + AT, 1.0)


@triton.jit
def _tiles(X, ROWS, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    desc = tl.make_tensor_descriptor(X, [ROWS, WIDTH], [WIDTH, 1], [BLOCK, WIDTH])
    desc.store([0, 0], desc.load([0, 0]) * 2.0)


def run(kernel, *args):
    InterpretedFunction(kernel.fn)[(1,)](*args)


def test_accesses_inside_the_tensors_run():
    x, y = torch.arange(16.0), torch.zeros(16)
    run(_copy, x, y, 16, False)
    assert torch.equal(y, x)
    short = torch.zeros(8)
    run(_copy, x, short, 16, True)  # masked off past the end
    assert torch.equal(short, x[:8])


def test_a_load_or_store_past_the_end_is_stopped():
    with pytest.raises(Exception, match="a load outside the launch's tensors in _copy"):
        run(_copy, torch.zeros(8), torch.zeros(16), 16, False)
    with pytest.raises(Exception, match="a store outside"):
        run(_copy, torch.zeros(16), torch.zeros(8), 16, False)


def test_one_load_across_two_tensors_runs_and_one_into_the_gap_between_is_stopped():
    """The first and last pointers of a load may lie in two tensors: each pointer is then
    checked, so that a pointer between them stops the launch."""
    x, y = sorted((torch.zeros(8), torch.zeros(8)), key=torch.Tensor.data_ptr)
    x.copy_(torch.arange(8.0))
    y.copy_(torch.arange(8.0, 16.0))
    out = torch.zeros(16)
    far = (y.data_ptr() - x.data_ptr()) // 4
    assert far >= 10 and (y.data_ptr() - x.data_ptr()) % 4 == 0  # a gap of 2 or more after x
    run(_gather, x, y, far, out)
    assert torch.equal(out, torch.arange(16.0))
    with pytest.raises(Exception, match="a load outside the launch's tensors in _gather"):
        run(_gather, x, y, far - 2, out)  # two elements before y: in the gap after x


def test_an_atomic_past_the_end_is_stopped():
    x = torch.zeros(4)
    run(_count, x, 3)
    assert x[3] == 1
    with pytest.raises(Exception, match="an atomic outside"):
        run(_count, x, 4)


def test_a_descriptor_the_tma_unit_refuses_is_stopped():
    x = torch.ones(16, 8)  # rows of 32 bytes: a box of 8 fp32 columns is 32 bytes, allowed
    run(_tiles, x, 16, 16, 8)
    assert bool((x == 2).all())
    with pytest.raises(Exception, match="TMA descriptor in _tiles: global dims"):
        run(_tiles, torch.ones(16, 8), 0, 16, 8)
    assert issubclass(OutOfBounds, AssertionError)
