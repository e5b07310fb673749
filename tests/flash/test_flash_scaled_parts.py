"""fp16's checksum parts carry a power-of-two scale (its range is too short for a row sum): one
scale a head for the row sums, so that the kernels accumulate a reference over the head's tiles
in the MMA and scale it once after the loop; rows far below the head's peak lose bits to fp16's
subnormals, and their masses are widened to cover it (checksums.PART_LOSS, the slack)."""

import math

import pytest
import torch
from flash_cases import DEVICE, inputs, run

from megatron_abft.config import FLASH_SECTIONS
from megatron_abft.flash import checksums, launch

DIM = 64


def _split_sum(parts: torch.Tensor, first: int) -> torch.Tensor:
    return parts[..., first : first + 3].double().sum(-1)


def test_row_sums_share_their_heads_scale_and_keep_their_value():
    """Tiles six orders of magnitude apart get one scale, and each row's three parts times it
    equal its sum within PART_LOSS of the scale and the rounding of an fp32 sum (more rows than
    a program splits at a time, checksums.CHUNK)."""
    g = torch.Generator().manual_seed(0)
    block, tiles = 32, 12
    magnitude = torch.tensor([1e3, 1.0, 1e-3, 3e-4]).repeat(3).repeat_interleave(block)
    x = (torch.randn(2, 3, tiles * block, DIM, generator=g) * magnitude[:, None]).half()
    _, rows, _ = checksums.key_value_sums(x, x, block, DIM, False, True, False, slack=0.0)
    scale = rows.stats[..., 0]
    assert (scale == scale[..., :1]).all()  # one a head
    assert (scale.log2() == scale.log2().round()).all()
    # the head's largest absolute row sum sits below 2**HEADROOM of its scale
    peak = x.float().abs().sum(-1).amax(-1).reshape(6)
    assert ((peak / scale[:, 0]) < 2.0 ** checksums.HEADROOM[torch.float16]).all()
    assert ((peak / scale[:, 0]) >= 2.0 ** (checksums.HEADROOM[torch.float16] - 1)).all()
    want = x.double().sum(-1).reshape(6, -1)
    got = _split_sum(rows.parts, 0) * scale[:, :1].double()
    absolute = x.double().abs().sum(-1).reshape(6, -1)
    allowed = checksums.PART_LOSS * scale[:, :1].double() + 2.0**-24 * (DIM * absolute + want.abs())
    assert ((got - want).abs() <= allowed).all()
    # the smallest tiles' parts did reach the subnormals: the loss is real there
    assert (rows.parts[:, -block:, :3].abs() < 2.0**-14).any()


def test_the_slack_widens_each_rows_absolute_sum_by_the_parts_loss():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1, 64, DIM, generator=g).half()
    _, plain, _ = checksums.key_value_sums(x, x, 32, DIM, False, True, False, slack=0.0)
    _, widened, _ = checksums.key_value_sums(x, x, 32, DIM, False, True, False, slack=2.0**-9)
    diff = _split_sum(widened.parts, 3) - _split_sum(plain.parts, 3)
    assert torch.allclose(diff, torch.full_like(diff, 2.0**-9), rtol=0, atol=2.0**-20)
    assert torch.equal(widened.parts[..., :3], plain.parts[..., :3])  # the sums themselves kept


def _backward_flags(
    do_scale: torch.Tensor, slack: bool, monkeypatch, device: torch.device
) -> dict[str, int]:
    """The sections the backward flags, on clean fp16 inputs, with dO's rows scaled."""
    g = torch.Generator().manual_seed(2)
    seq = do_scale.numel()
    q, k, v = (torch.randn(1, 1, seq, DIM, generator=g).half().to(device) for _ in range(3))
    do = (torch.randn(1, 1, seq, DIM, generator=g) * do_scale[:, None]).half().to(device)
    if not slack:
        monkeypatch.setattr(launch, "_slack", lambda dtype, checks: 0.0)
    tol = launch.TILE_C[torch.float16] * 2.0**-24
    checks = launch.Checks((1 << len(FLASH_SECTIONS)) - 1, tol, 1e10)
    found = launch.Findings.empty(1, q.device)
    o, lse = launch.forward(q, k, v, True, DIM**-0.5, checks, found)
    assert not found.codes.any()
    found = launch.Findings.empty(1, q.device)
    launch.backward(do, q, k, v, o, lse, True, DIM**-0.5, checks, found)
    return {s: int(found.codes[i].max()) for i, s in enumerate(FLASH_SECTIONS) if i >= 2}


@pytest.mark.parametrize("slack", [True, False])
def test_keys_that_only_tiny_rows_see_raise_no_alarm(slack, monkeypatch):
    """Causal: the last keys are seen by the last queries only, whose dO rows sit 2**23 below
    the head's peak; their parts lose bits to fp16's subnormals, by more than the unwidened
    bound allows. With the slack no section flags (on DEVICE: the GPU's tensor cores too);
    without it dV's check does (the interpreter's rounding, on the CPU)."""
    do_scale = torch.ones(384)  # more rows than checksums.CHUNK
    do_scale[:192] = 2.0**12
    do_scale[-64:] = 2.0**-11
    device = DEVICE if slack else torch.device("cpu")
    flags = _backward_flags(do_scale, slack, monkeypatch, device)
    if slack:
        assert not any(flags.values()), flags
    else:
        assert flags["grad_v"], flags


@pytest.mark.parametrize("section", FLASH_SECTIONS)
def test_each_section_alone_runs_clean(section):
    """A call that checks one section makes only its checksum vectors (placeholders for the
    rest), and fp16's launches read the heads' scales only where they made them (a dK/dV
    launch with only S^T due once read a placeholder)."""
    q, k, v, do = inputs(1, 2, 2, 96, DIM, torch.float16, seed=3)
    _, ledger = run(q, k, v, do, sections=(section,))
    assert ledger.counts.sum() == 0, ledger.summary()


def test_slack_is_the_parts_loss_over_the_bound():
    checks = launch.Checks(1, launch.TILE_C[torch.float16] * 2.0**-24, 1e10)
    slack = launch._slack(torch.float16, checks)
    assert math.isclose(slack * checks.tol, checksums.PART_LOSS)
    assert launch._slack(torch.bfloat16, checks) == 0.0
