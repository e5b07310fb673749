"""A memory checker for the Triton kernels the tests run in Triton's interpreter (the flash
attention, its checksum launches, the checked GEMM): every load, store and atomic of a launch
must fall inside the storage of one of the launch's tensors, and every TMA descriptor a kernel
makes must be one the hardware takes. On a GPU such an access is an illegal address, or a wrong
value read from a neighbouring tensor; the interpreter itself reads any address it is given.
tests/conftest.py installs it for the whole suite."""

from __future__ import annotations

import numpy as np
from triton.runtime import interpreter


class OutOfBounds(AssertionError):
    """An access outside the launch's tensors, or a descriptor the TMA unit would refuse."""


_launch = {"ranges": [], "kernel": "?"}


def _ranges(args) -> list[tuple[int, int]]:
    """[start, end) of each tensor argument's storage (a descriptor's base tensor included)."""
    found = []
    for arg in args:
        tensor = getattr(arg, "base", arg)  # TensorDescriptor: its base
        if hasattr(tensor, "untyped_storage"):
            storage = tensor.untyped_storage()
            found.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return found


def _check(pointers, mask, size: int, what: str) -> None:
    """Raise unless every active pointer's ``size`` bytes lie in one of the launch's ranges."""
    pointers = np.asarray(pointers)
    active = pointers.astype(np.int64)
    if mask is not None:
        active = active[np.broadcast_to(np.asarray(mask, dtype=bool), pointers.shape)]
    active = active.ravel()
    if not active.size:
        return
    low, high = int(active.min()), int(active.max()) + size
    if any(start <= low and high <= end for start, end in _launch["ranges"]):
        return  # all in one tensor (the common case): no test of each pointer
    inside = np.zeros(active.shape, dtype=bool)
    for start, end in _launch["ranges"]:
        inside |= (active >= start) & (active + size <= end)
    if not inside.all():
        outside = [hex(int(p)) for p in active[~inside][:4]]
        grid = interpreter.interpreter_builder.grid_idx
        raise OutOfBounds(
            f"{what} outside the launch's tensors in {_launch['kernel']} (program {grid}): "
            f"{outside}; tensors at {[(hex(s), e - s) for s, e in _launch['ranges']]}"
        )


def _descriptor(base, shape, block_shape) -> None:
    """Raise for a TMA descriptor the hardware refuses (cuTensorMapEncodeTiled's limits beyond
    the alignment the interpreter checks itself): every dim at least 1, a box of at most 256 a
    dim whose inner extent is a multiple of 16 bytes."""
    itemsize = base.dtype.element_ty.primitive_bitwidth // 8
    dims = [int(np.asarray(d.data).reshape(-1)[0]) for d in shape]
    wrong = []
    if any(not 1 <= d < 2**32 for d in dims):
        wrong.append(f"global dims {dims}")
    if any(not 1 <= b <= 256 for b in block_shape):
        wrong.append(f"box {list(block_shape)}")
    if block_shape[-1] * itemsize % 16:
        wrong.append(f"an inner box of {block_shape[-1] * itemsize} bytes")
    if wrong:
        raise OutOfBounds(f"TMA descriptor in {_launch['kernel']}: {', '.join(wrong)}")


def install() -> None:
    """Patch Triton's interpreter (once): each launch records its tensors' storage, and its
    memory operations and descriptors are checked against them."""
    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    if getattr(builder, "bounds_checked", False):
        return
    init_args = executor._init_args_hst

    def init(self, args_dev, kwargs):
        args, kwargs_hst = init_args(self, args_dev, kwargs)
        _launch["ranges"] = _ranges([*args, *kwargs_hst.values()])
        _launch["kernel"] = getattr(self.fn, "__name__", "?")
        return args, kwargs_hst

    load, store = builder.create_masked_load, builder.create_masked_store
    atomic, swap = builder.create_atomic_rmw, builder.create_atomic_cas
    make = builder.create_make_tensor_descriptor

    def masked_load(self, ptrs, mask, other, *args, **kwargs):
        size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        _check(ptrs.data, mask.data, size, "a load")
        return load(self, ptrs, mask, other, *args, **kwargs)

    def masked_store(self, ptrs, value, mask, *args, **kwargs):
        _check(ptrs.data, mask.data, value.data.dtype.itemsize, "a store")
        return store(self, ptrs, value, mask, *args, **kwargs)

    def atomic_rmw(self, op, ptr, value, mask, *args, **kwargs):
        _check(ptr.data, mask.data, value.data.dtype.itemsize, "an atomic")
        return atomic(self, op, ptr, value, mask, *args, **kwargs)

    def atomic_cas(self, ptr, compare, value, *args, **kwargs):
        _check(ptr.data, None, value.data.dtype.itemsize, "an atomic")
        return swap(self, ptr, compare, value, *args, **kwargs)

    def make_descriptor(self, base, shape, strides, block_shape, *args, **kwargs):
        _descriptor(base, shape, block_shape)
        return make(self, base, shape, strides, block_shape, *args, **kwargs)

    executor._init_args_hst = init
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder.create_atomic_rmw, builder.create_atomic_cas = atomic_rmw, atomic_cas
    builder.create_make_tensor_descriptor = make_descriptor
    builder.bounds_checked = True
