"""The checked GEMM's static gate (megatron_abft.dev.gemm_gate): its launches built for sm_90 on
this CPU machine as checked_linear specialises them, bf16 and fp16, checked and not, with a bias
and without. None spills or has ptxas serialise its wgmma, every MMA of the main loop is a
wgmma, and each loop issues in fewer cycles than its MMAs take, the checks' CUDA-core work
between the wgmma's issue and the wait for them, so that it can hide under the tensor cores'
(about 15 s)."""

from dataclasses import replace

import pytest

from megatron_abft.dev import gemm_gate


@pytest.fixture(scope="module")
def builds():
    return gemm_gate.builds()


def test_every_launch_passes_the_gate(builds):
    assert len(builds) == 8
    assert [(b.dtype, b.check, b.bias, b.problems) for b in builds if b.problems] == []


def test_the_checks_add_work_but_no_stage_or_mma(builds):
    for b in builds:
        assert dict(b.mma) == {
            f"HGMMA.64x128x16.F32{'.BF16' if b.dtype == 'bfloat16' else ''}": 4
        }, b
    checked = {(b.dtype, b.bias): b for b in builds if b.check}
    plain = {(b.dtype, b.bias): b for b in builds if not b.check}
    for key, b in checked.items():
        # X's tile read again into registers: about three instructions an element of it
        assert b.loop_instructions > plain[key].loop_instructions + 64
        assert b.shared >= plain[key].shared
        # nearly all of it between the wgmma's issue and the wait for them
        outside = b.loop_instructions - b.in_flight
        assert outside <= plain[key].loop_instructions - plain[key].in_flight + 16, b


def test_the_window_of_a_loop_is_between_its_first_wgmma_and_its_wait():
    from megatron_abft.dev import sass

    body = sass.parse(
        """
        /*0000*/                   LDS R2, [R3] ;
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
        /*0020*/                   FFMA R4, R5, R6, R4 ;
        /*0030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;
        /*0040*/                   FADD R4, R4, R7 ;
        /*0050*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0060*/                   FADD R8, R8, R9 ;
    """
    )
    assert gemm_gate.in_flight(body) == 2
    assert gemm_gate.in_flight(body[:2]) == 0  # no wait: no window


def test_the_gate_names_what_fails(builds):
    good = builds[0]
    assert good.problems == []
    spilled = replace(good, stack=16, spills=16)
    assert spilled.problems == ["spills: stack 16 B, spill stores 16 B"]
    assert replace(good, warnings=("C7515",)).problems == ["ptxas serialises the wgmma (C7515)"]
    assert "not all wgmma" in replace(good, mma=(("HMMA.16816.F32.BF16", 8),)).problems[0]
    slow = replace(good, loop_instructions=good.loop_instructions * 3)
    assert "issues in" in slow.problems[0]


def test_the_helper_launches_build_without_a_spill():
    made = gemm_gate.helper_builds()
    assert set(made) == {"weight_sums", "tally"}
    for name, (registers, spilled, warnings) in made.items():
        assert spilled == 0 and warnings == () and registers <= 128, (name, made[name])


def test_an_a100_build_does_not_spill_either():
    made = gemm_gate.a100_builds()
    assert len(made) == 4 and all(spilled == 0 for *_, spilled in made), made


@pytest.fixture(scope="module")
def attention():
    return gemm_gate.attention_builds()


def test_the_attentions_launches_pass_the_gate_on_wgmma(attention):
    """The scores (K read as Megatron holds it, k-contiguous) and the context (V^T: n-contiguous)
    at head dims 64 and 128: every main-loop MMA a wgmma of the linear's shape, no spill or
    C7515, and a loop that issues in fewer cycles than its MMAs take, checked or not."""
    assert len(attention) == 16
    assert [(b.launch, b.dtype, b.check, b.problems) for b in attention if b.problems] == []
    for b in attention:
        assert [op.split(".F32")[0] for op, _ in b.mma] == ["HGMMA.64x128x16"], b
    plain = {(b.launch, b.dtype): b for b in attention if not b.check}
    for b in attention:
        if b.check:  # the checks' CUDA-core work, most of it in the wgmma's flight
            assert b.in_flight > plain[b.launch, b.dtype].in_flight + 64, b
