"""The checked GEMM's static gate (megatron_abft.dev.gemm_gate): its launches built for sm_90 on
this CPU machine as checked_linear specialises them, bf16 and fp16, checked and not, with a bias
and without. None spills or has ptxas serialise its wgmma, every MMA of the main loop is a
wgmma, and each loop issues in fewer cycles than its MMAs take, so that the checks' CUDA-core
work can hide under the tensor cores' (about 15 s)."""

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
    assert set(made) == {"weight_sums", "findings"}
    for name, (registers, spilled, warnings) in made.items():
        assert spilled == 0 and warnings == () and registers <= 128, (name, made[name])
