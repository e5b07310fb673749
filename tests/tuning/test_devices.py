"""The device profiles (megatron_abft.tuning.devices, devices.json): their provenance, their
rates, and the measured H200 profile against the runs it comes from."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_abft.tuning.devices import DEVICES, DeviceProfile
from megatron_abft.tuning.scaling import predict
from megatron_abft.tuning.shapes import CATALOGUE, Work


def test_every_device_profile_says_where_its_rates_come_from():
    """devices.json: a datasheet profile gives its dense peaks, which the model takes at
    GEMM_SHARE and MEMORY_SHARE; a measured one its rates as measured, the flash rates of a
    datasheet profile; each names its source. DEVICES holds one profile an entry, in order."""
    from megatron_abft.tuning.devices import GEMM_SHARE, MEMORY_SHARE, PROFILES

    entries = json.loads(PROFILES.read_text())
    assert list(DEVICES) == list(entries)
    for key, entry in entries.items():
        assert entry["source"] in ("datasheet", "measured") and len(entry["provenance"]) > 40
        profile = DEVICES[key]
        if entry["source"] == "datasheet":
            assert profile.matmul["bf16"] == GEMM_SHARE * entry["matmul_peak"]["bf16"]
            assert profile.bandwidth == MEMORY_SHARE * entry["bandwidth_peak"]
        else:
            assert profile.matmul == entry["matmul"] and profile.bandwidth == entry["bandwidth"]
            flash = DEVICES[entry["flash_rates_of"]]
            assert (profile.vector, profile.exp) == (flash.vector, flash.exp)


def test_gpu_profiles_price_cuda_core_ops_and_exponentials():
    """DeviceProfile.vector and .exp: half the datasheet's fp32 FLOP/s (an FMA is one op) and
    exp2 at 16 a clock an SM (H100 SXM: 3.9 T/s), at 70%; check_terms gives each kind of work's
    time, which check_time sums; a profile without a rate refuses work that needs it."""
    h100, a100 = DEVICES["H100"], DEVICES["A100"]
    assert h100.vector == pytest.approx(0.7 * 67e12 / 2) and h100.exp == pytest.approx(0.7 * 3.9e12)
    assert (DEVICES["H200"].vector, DEVICES["H200"].exp) == (h100.vector, h100.exp)
    assert a100.vector == pytest.approx(0.7 * 19.5e12 / 2) and a100.exp < h100.exp
    work = Work(flops=1e12, bytes=1e9, ops=3, vector=2e12, exps=1e11, stream=4e9, launches=5)
    terms = h100.check_terms(work, "bf16")
    assert terms == pytest.approx(
        {
            "flops": 1e12 / h100.matmul["bf16"],
            "bytes": 1e9 / h100.bandwidth,
            "ops": 3 * h100.launch,
            "vector": 2e12 / h100.vector,
            "exps": 1e11 / h100.exp,
            "dots": 0.0,
            "stream": 4e9 / h100.bandwidth,
            "launches": 5 * h100.launch,
        }
    )
    assert h100.check_time(work, "bf16") == pytest.approx(sum(terms.values()))
    assert h100.time(work, "bf16") == pytest.approx(sum(terms.values()))
    # the checksum kernels' bytes and ops at the checks' own rates, the library ops' at the
    # device's
    slow = replace(h100, check_bandwidth=h100.bandwidth / 8, check_op=10 * h100.launch)
    checked = slow.check_terms(work, "bf16")
    assert checked["bytes"] == pytest.approx(8 * terms["bytes"])
    assert checked["ops"] == pytest.approx(10 * terms["ops"])
    assert (checked["stream"], checked["launches"]) == (terms["stream"], terms["launches"])
    assert h100.gpu and not DeviceProfile("a CPU", {"bf16": 1e12}, 1e10, 1e-3).gpu
    with pytest.raises(ValueError, match="no exp rate"):
        DeviceProfile("d", {"bf16": 1e12}, 1e10, 1e-3).time(Work(exps=1), "bf16")


def test_the_measured_h200_profile_is_the_h200_runs_micro_benchmarks():
    """DEVICES["H200-measured"] holds the medians of the micro-benchmarks of the H200 runs its
    provenance names (2026-11-27; as bench/overhead_report.py's roofline reads them): the rates
    and the fused path's op counts of the unfused run, the kernels' op counts of the flash run
    (its projections' checks), the flash rates the H200 datasheet's. Given each run's own
    unprotected step (its host made it 1.6 to 3.1 times the roofline's: calibrated), the model
    lands within tolerance of the run's measured step overhead, or within its 95% interval
    (the model prices today's launches: the flash run's calls launched two a layer more, the
    ledger's updates, which the kernels' last programs now make)."""

    from bench.overhead_report import calibrated, in_interval, roofline, within
    from megatron_abft.tuning.devices import PROFILES

    runs = {}
    provenance = json.loads(PROFILES.read_text())["H200-measured"]["provenance"]
    for impl in ("unfused", "flash"):
        name = f"docs/figures/gpu/2026-11-27/bench_gpt3_350m_{impl}.json"
        assert name in provenance
        runs[impl] = json.loads(Path(__file__).parents[2].joinpath(name).read_text())
    run, profile = roofline(runs["unfused"]), DEVICES["H200-measured"]
    assert profile.matmul == pytest.approx(run.matmul, rel=1e-5)
    for rate in ("bandwidth", "launch", "check_op", "optimizer_bandwidth", "check_bandwidth"):
        assert getattr(profile, rate) == pytest.approx(getattr(run, rate), rel=1e-5), rate
    kernels = roofline(runs["flash"]).check_ops["kernels"]
    assert profile.check_ops == {**run.check_ops, "kernels": kernels} and kernels == 2
    assert profile.bias_ops == run.bias_ops
    assert profile.softmax == pytest.approx(run.softmax, rel=1e-5)
    assert (profile.vector, profile.exp) == (DEVICES["H200"].vector, DEVICES["H200"].exp)
    # the checksum products' multiply-adds: the datasheet's CUDA-core rate for every GPU run (the
    # unfused one too), a CPU run's vector units at half its measured fp32 matmul rate
    assert run.vector == DEVICES["H200"].vector
    cpu = {"device": "cpu", "args": {"dtype": "fp32"}}
    cpu["machine"] = {"matmul": 1e11, "bandwidth": 2e10, "launch": 1e-5}
    assert roofline(cpu).vector == 0.5e11
    shape = next(s for s in CATALOGUE if s.name == "GPT-3 350M")
    for result in runs.values():
        on_its_host = replace(profile, baseline_scale=calibrated(result).baseline_scale)
        predicted = predict(shape, on_its_host, result["impl"]).step
        measured, spread = result["overhead"]["all"]["step"], result["interval"]["all"]["step"]
        assert within(predicted, measured) or in_interval(predicted, measured, spread), (
            result["impl"],
            predicted,
        )
