"""tools/flash_detection.py: the positions it perturbs have a first computation to scale the
error by, and an error of a window's RMS there is flagged (the documented limits are far
below it)."""

import torch

from bench.flash_detection import limit, positions
from megatron_abft.config import FLASH_SECTIONS
from megatron_abft.flash.faults import first_computations


def test_every_position_scales_its_error_and_one_rms_is_flagged():
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 1, 256, 64, generator=g).to(torch.bfloat16) for _ in range(4))
    matrices = first_computations(q, k, v, do)
    for section in FLASH_SECTIONS:
        for r, _ in positions(section, 256, matrices[section]):
            assert matrices[section][r].any(), (section, r)
    # dV's late keys: their block's first query tile sees none of them; an earlier key stands in
    at = positions("grad_v", 256, matrices["grad_v"])
    assert at[0][0] < 253
    assert limit(q, k, v, do, "grad_v", at[0], matrices["grad_v"], steps=2) <= 1.0
