"""Every flash kernel configuration the code can launch on a GPU builds ahead of time for sm_80
and sm_90 on this CPU machine (Triton's compiler and ptxas), within the device's shared memory
and without spilling registers (megatron_abft.flash.aot). The builds run two at a time; about
two minutes on the 2-core CI machine with Triton's cache cold."""

import pytest
import torch

from megatron_abft.flash import aot, launch


def test_every_configuration_builds_without_spills():
    configs = aot.configurations()
    kernels = {(c.kernel, c.head_dim, c.dtype, c.causal, c.variant) for c in configs}
    assert (
        len(kernels)
        == len(configs)
        == (
            len(launch.KERNELS)
            * len(launch.HEAD_DIMS)
            * len(launch.GPU_DTYPES)
            * 2
            * len(aot.VARIANTS)
        )
    )
    builds = aot.build_all(configs, workers=2)
    assert len(builds) == 2 * len(configs)
    problems = [(b.config, b.arch, b.problems) for b in builds if b.problems]
    assert not problems, problems
    assert all(0 < b.registers <= 255 and b.shared > 0 for b in builds)


def test_the_tiles_are_those_the_launches_take():
    for (kernel, width), tiles in launch.TILES.items():
        for dtype in launch.GPU_DTYPES:
            assert launch.blocks(kernel, width, dtype) == tiles
    assert launch.blocks("dq", 64, torch.float32) == launch.INTERPRETED
    with pytest.raises(ValueError, match="unknown flash kernel 'fwd'"):
        launch.blocks("fwd", 64, torch.bfloat16)
