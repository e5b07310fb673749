"""Every custom op of the compiled kernels passes ``torch.library.opcheck`` (schema, fake
tensors, autograd registration, AOT dispatch) on the inputs a protected GPT really gives them;
opcheck does not compare strides, and the fakes of FAKE_STRIDES give the real ones too.

One rank (gloo, CPU) runs a protected GPT, fault-free and with an INF fault in each forward
section, with the checks reading the host and without (as on a GPU), and records the first call
of every op for each distinct input layout. The ops the CPU model does not call take inputs made
from those calls. INF rather than NaN faults: opcheck compares eager and traced outputs with
``torch.equal``, and a NaN fault's magnitude is NaN in both.
"""

import pytest
import torch
from mcore import Shape, build_gpt, loss_and_grads, spawn

RECORDED = (
    "check_gemm",
    "check_gemm_tally",
    "encode_pair",
    "encode_pair_from",
    "pair_vectors",
    "add_bias",
    "softmax_check",
    "softmax_correct_tally",
    "verify_correct",
    "verify_correct_tally",
    "tally",
)
"""The ops the protected GPT calls on the CPU."""

DERIVED = (
    "screen",
    "block_sums",
    "block_sums_pair",
    "row_products",
    "row_products_pair",
    "operand_pass",
    "encode_pair_split",
)
"""The other ops, on inputs made from the recorded calls."""


COMPOSITES = (
    "check_gemm",
    "check_gemm_tally",
    "encode_pair",
    "encode_pair_split",
    "encode_pair_from",
    "pair_vectors",
)
"""Ops made of the others (CompositeImplicitAutograd): traced, they decompose into them."""

FAKE_STRIDES = frozenset(RECORDED + DERIVED)
"""The ops whose fakes must give the real outputs' strides (inductor plans buffers from them):
all of them. The COMPOSITES return views whose layout depends on the path they take (kernels or
BLAS, folded batch dims); they have no fake of their own, and their decomposition gives the
real layouts."""


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(item) for item in x)
    return x


def _record() -> dict:
    """Every megatron_abft op the protected GPT calls: the first call per input layout."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_abft import Fault, inject
    from megatron_abft.config import ABFTConfig
    from megatron_abft.runtime import guard
    from megatron_abft.spec import get_gpt_layer_abft_spec

    calls: dict = {}

    def record(name: str, args: tuple, kwargs: dict | None) -> None:
        if name.startswith("megatron_abft::"):
            layout = tuple(
                (tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else None
                for a in args
            )
            calls.setdefault((name.split("::")[1], layout), (_clone(args), _clone(kwargs)))

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            record(func._schema.name, args, kwargs)
            return func(*args, **(kwargs or {}))

    class RecordComposites(TorchFunctionMode):  # they decompose before any dispatch mode
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "_qualified_op_name", None) or getattr(
                getattr(func, "_schema", None), "name", ""
            )
            if name.split("::")[-1] in COMPOSITES:
                record(name, args, kwargs)
            return func(*args, **(kwargs or {}))

    shape = Shape()
    reads = guard.host_reads
    for fused in (True, False):
        for host_reads in (True, False):
            guard.host_reads = lambda config, device, host_reads=host_reads: host_reads
            config = ABFTConfig(fused_softmax=fused)
            model = build_gpt(shape, get_gpt_layer_abft_spec(config, attention="unfused"))
            with RecordComposites(), Record():
                loss_and_grads(model, shape)
                for section in ("qkv", "scores", "context", "proj"):
                    with inject(model, [Fault(section, "inf", layer=1)]):
                        loss_and_grads(model, shape)
    guard.host_reads = reads
    return calls


def _derived(calls: dict) -> list[tuple[str, tuple]]:
    """Inputs for the ops the model does not call, from the calls it makes."""
    first = {}
    for (name, _), (args, _) in calls.items():
        first.setdefault(name, args)
    c, col_block, row_block, col, row, col_bounds, row_bounds = first["verify_correct"][:7]
    a, b, block = first["pair_vectors"]
    u, z = torch.ops.megatron_abft.pair_vectors(a, b, block)
    return [
        ("screen", (c, col_block, row_block, col, row, col_bounds, row_bounds)),
        ("block_sums", (c, col_block, row_block)),
        ("block_sums_pair", (c, col_block, row_block, c, col_block, row_block)),
        ("row_products", (a, u, z, 0.5)),
        ("row_products_pair", (a, u, z, 0.5, a, u, z, 2.0)),
        ("operand_pass", (a, block, u, z, 0.5)),
        ("encode_pair_split", first["encode_pair"]),
    ]


def _layout(t: torch.Tensor) -> tuple:
    """Shape and the strides that matter (of dims longer than 1)."""
    return tuple(t.shape), tuple(s for n, s in zip(t.shape, t.stride(), strict=True) if n > 1)


def _fake_layouts_differ(op, args, kwargs) -> list[int]:
    """The outputs whose fake strides are not the real ones: opcheck does not compare strides,
    and inductor plans its buffers from the fake's."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    real = op(*_clone(args), **_clone(kwargs))
    inputs = _clone((args, kwargs))
    with FakeTensorMode() as mode:
        fake_args, fake_kwargs = tree_map(
            lambda x: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x, inputs
        )
        fake = op(*fake_args, **fake_kwargs)
    real, fake = (x if isinstance(x, tuple) else (x,) for x in (real, fake))
    return [i for i, (r, f) in enumerate(zip(real, fake, strict=True)) if _layout(r) != _layout(f)]


def _worker():
    from torch.library import opcheck

    from megatron_abft.ops import compiled

    if not compiled.available():
        return None
    calls = _record()
    cases = [(name, args, kwargs) for (name, _), (args, kwargs) in calls.items()]
    cases += [(name, args, {}) for name, args in _derived(calls)]
    failures = {}
    for name, args, kwargs in cases:
        op = getattr(torch.ops.megatron_abft, name).default
        result = opcheck(op, _clone(args), _clone(kwargs), raise_exception=False)
        failed = {test: str(out)[:500] for test, out in result.items() if out != "SUCCESS"}
        if name in FAKE_STRIDES and (differ := _fake_layouts_differ(op, args, kwargs)):
            failed["fake strides"] = f"outputs {differ}"
        if failed:
            failures.setdefault(name, failed)
    return sorted({name for name, _, _ in cases}), failures


@pytest.fixture(scope="module")
def checked():
    """Spawns 1 rank."""
    [result] = spawn(1, 1, _worker)
    if isinstance(result, Exception):
        raise result
    if result is None:
        pytest.skip("megatron_abft._C is not built")
    return result


def test_every_op_is_checked(checked):
    names, _ = checked
    assert set(names) == set(RECORDED) | set(DERIVED)


def test_every_op_passes_opcheck(checked):
    _, failures = checked
    assert failures == {}
