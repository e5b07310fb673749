"""Every flash kernel configuration the code can launch on a GPU (the attention kernels and the
ones around them: Delta, the checksum vectors, the ledger's update) builds ahead of time for
sm_80 and sm_90 on this CPU machine (Triton's compiler and ptxas), within the device's shared
memory and without spilling registers (megatron_abft.flash.aot). The builds run two at a time;
about two minutes on the 2-core CI machine with Triton's cache cold."""

import pytest
import torch

from megatron_abft.flash import aot, launch


def test_every_configuration_builds_without_spills():
    configs = aot.configurations()
    attention = {
        (c.kernel, c.head_dim, c.dtype, c.causal, c.variant)
        for c in configs
        if c.kernel in launch.KERNELS
    }
    kinds = len(launch.KERNELS) * len(launch.HEAD_DIMS) * len(launch.GPU_DTYPES)
    assert len(attention) == kinds * 2 * len(aot.VARIANTS)
    assert {c.kernel for c in configs} == {*launch.KERNELS, *aot.HELPERS}
    assert len(set(configs)) == len(configs)
    builds = aot.build_all(configs, workers=2)
    assert len(builds) == 2 * len(configs)
    problems = [(b.config, b.arch, b.problems) for b in builds if b.problems]
    assert not problems, problems
    assert all(0 < b.registers <= 255 for b in builds)


def test_the_tiles_are_those_the_launches_take():
    for (kernel, width), tiles in launch.TILES.items():
        for dtype in launch.GPU_DTYPES:
            assert launch.blocks(kernel, width, dtype) == tiles
    assert launch.blocks("dq", 64, torch.float32) == launch.INTERPRETED
    with pytest.raises(ValueError, match="unknown flash kernel 'fwd'"):
        launch.blocks("fwd", 64, torch.bfloat16)


def test_interpreted_launches_leave_the_compiler_as_they_found_it():
    """A process that interprets the kernels (CPU tensors) compiles them after (CUDA tensors):
    the interpreter's patches of triton.language, its core included, are undone."""
    import triton.language as tl

    from megatron_abft.flash import flash_attention

    before = {name: getattr(tl.core, name) for name in ("cast", "dot", "where", "reduce")}
    q = torch.randn(1, 1, 24, 64, dtype=torch.bfloat16)
    flash_attention(q, q, q)
    assert {name: getattr(tl.core, name) for name in before} == before
    delta = next(c for c in aot.configurations() if c.kernel == "delta")
    assert aot.build(delta, 90).registers > 0
