"""The column sums the score checks start from, added up over a head's tiles: a prefix of K's
in the forward, a suffix of Q's and dO's in dK/dV (checksums._prefix_sums). Each tile's three
parts times its scale equal the float64 running sum within fp32's rounding, and the masses are
the running sums of the tiles' own; heads of more tiles than a step of the scan takes, with a
ragged last step. On the DEVICE flash_cases names (a GPU in tools/gpu_check.sh)."""

import pytest
import torch
from flash_cases import DEVICE

from megatron_abft.flash import checksums

DIM = 64


def _tiles(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x [b, h, n, d]`` as ``[b * h, tiles, block, d]`` float64, zero past n."""
    b, h, n, d = x.shape
    tiles = -(-n // block)
    padded = torch.zeros(b * h, tiles * block, d, dtype=torch.float64)
    padded[:, :n] = x.double().reshape(b * h, n, d)
    return padded.reshape(b * h, tiles, block, d)


def _running(tiles: torch.Tensor, reverse: bool) -> torch.Tensor:
    """A running sum over dim 1: from the first tile to each, or from each to the last."""
    if reverse:
        return tiles.flip(1).cumsum(1).flip(1)
    return tiles.cumsum(1)


def _assert_running(parts, scale, columns, masses, got_masses, reverse, magnitude):
    """``parts [bh, tiles, d, 3]`` times ``scale [bh, tiles]`` against the running sum of the
    tiles' ``columns [bh, tiles, d]`` (float64), and ``got_masses`` against ``masses``'s."""
    parts, scale, got_masses = (t.cpu() for t in (parts, scale, got_masses))
    got = parts.double().sum(-1) * scale.double()[..., None]
    want = _running(columns, reverse)
    tiles = columns.shape[1]
    # fp32's rounding of each tile's column sum (its block's rows) and of the running sum
    allowed = (tiles + 64) * 2.0**-24 * _running(magnitude, reverse)
    allowed += checksums.PART_LOSS * scale.double()[..., None]
    assert ((got - want).abs() <= allowed).all()
    assert torch.allclose(got_masses.double(), _running(masses, reverse), rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq", [40, 700])
def test_key_prefix_sums_equal_float64(dtype, seq):
    g = torch.Generator().manual_seed(seq)
    block = 32
    # tiles of magnitudes six orders apart, so that fp16's scale moves from tile to tile
    rows = torch.arange(seq)
    magnitude = torch.tensor([1e3, 1.0, 1e-3])[(rows // block) % 3]
    k = (torch.randn(2, 3, seq, DIM, generator=g) * magnitude[:, None]).to(dtype)
    on = k.to(DEVICE)
    sums, _, _ = checksums.key_value_sums(on, on, block, DIM, True, False, False)
    columns = checksums.Sums(sums.parts.cpu(), sums.stats.cpu())
    tiles = _tiles(k, block)
    summed = tiles.abs().sum(2)  # each tile's absolute rows summed, a [d] vector
    _assert_running(
        columns.parts[..., :3], columns.stats[..., 0], tiles.sum(2),
        summed.norm(dim=-1), columns.stats[..., 1], False, summed,
    )  # fmt: skip
    assert (columns.parts[..., 3:] == 0).all()
    largest_row = tiles.norm(dim=-1).amax(-1)
    assert torch.allclose(columns.stats[..., 2].double(), largest_row, rtol=1e-5, atol=0)
    if dtype == torch.float16:  # the scale follows the running sum's peak, a tile at a time
        scale = columns.stats[..., 0]
        assert (scale.log2() == scale.log2().round()).all()
        assert len(scale.unique()) > 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq", [40, 700])
def test_backward_suffix_sums_equal_float64(dtype, seq):
    g = torch.Generator().manual_seed(seq + 1)
    block = 32
    q, o = (torch.randn(1, 2, seq, DIM, generator=g).to(dtype) for _ in range(2))
    do = (torch.randn(1, 2, seq, DIM, generator=g) * 1e-2).to(dtype)
    on = (t.to(DEVICE) for t in (o, do, q))
    made = checksums.backward(*on, block, DIM, False, False, False, True)
    for tensor, columns, mass in ((q, slice(0, 3), 3), (do, slice(3, 6), 4)):
        tiles = _tiles(tensor, block)
        summed = tiles.abs().sum(2)
        _assert_running(
            made.columns[..., columns], made.stats[..., 2], tiles.sum(2),
            summed.norm(dim=-1), made.stats[..., mass], True, summed,
        )  # fmt: skip
    assert (made.columns[..., 6:] == 0).all()
