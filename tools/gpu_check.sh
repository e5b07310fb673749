#!/usr/bin/env bash
# Everything a lent GPU machine should run, in one call: install the carried wheels, build the
# CUDA extension, run the GPU tests, then the benchmarks, then compute-sanitizer on the kernels.
# Logs and JSON go under $OUT (default out/gpu). On this side, first carry megatron-core:
#     python -m pip download --no-deps megatron-core==0.19.2 -d wheels
# then run (device tool): bash tools/gpu_check.sh   with carry: ["wheels"]
# A device call ends after 600 s: each step has a time limit of its own (in seconds), the steps
# run most needed first, and a step cut short leaves its log and lets the next one run. The tests
# run to the end (no -x), so that one lease shows every failure. A second call,
#     bash tools/gpu_check.sh more
# (the machine still warm, or it installs again) runs what did not fit: the host's time per check
# and per step (bench_host.py), the GPT-3 350M step at micro-batch 4 (at 1 the host may bound the
# step, and its overhead with it) and the kernels at sequence 4096. A third,
#     bash tools/gpu_check.sh flash
# runs the protected flash attention (Triton; no CUDA extension needed): its tests on the GPU's
# compiled kernels, the no-false-alarm sweep on the tensor cores (the margin of each check),
# compute-sanitizer on a few of its tests, and bench_attention.py against SDPA and the unfused
# attention. Run it first when a session has one call: it is the unmeasured part.
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
status=0
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, go on
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/summary.txt"
    local begin=$SECONDS
    if timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then
        echo "   ok in $((SECONDS - begin))s" | tee -a "$OUT/summary.txt"
    else
        echo "   FAILED (exit $?) after $((SECONDS - begin))s, see $name.log" \
            | tee -a "$OUT/summary.txt"
        status=1
    fi
}

if [ "${1:-}" = flash ]; then
    if ! "$PY" -c "import megatron, megatron_abft.flash" 2>/dev/null; then
        step install 60 bash -c "$PY -m pip install --no-index --no-deps wheels/*.whl && \
ABFT_BUILD=none $PY -m pip install --no-index --no-build-isolation --no-deps -e ."
    fi
    step environment 20 bash -c "nvidia-smi; $PY -c 'import torch, triton; \
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), triton.__version__)'"
    step flash_tests 200 env ABFT_FLASH_DEVICE=cuda "$PY" -m pytest -q \
        tests/flash/test_flash_equality.py tests/flash/test_flash_correction.py
    step flash_false_alarms 90 "$PY" tools/flash_false_alarms.py --device cuda --seq 2048 \
        --tiles 200000 --dtypes bf16 fp16 --json "$OUT/flash_false_alarms.json"
    if command -v compute-sanitizer >/dev/null; then
        step flash_sanitizer 90 env ABFT_FLASH_DEVICE=cuda compute-sanitizer --tool memcheck \
            --error-exitcode 1 "$PY" -m pytest -q tests/flash/test_flash_equality.py -k "seq129"
    fi
    step bench_attention 200 "$PY" tools/bench_attention.py --json "$OUT/bench_attention.json"
    exit $status
fi

if [ "${1:-}" = more ]; then
    if ! "$PY" -c "import megatron, megatron_abft._C" 2>/dev/null; then
        # sm_90 only (H100, H200): half the CUDA compile time of the default 8.0 and 9.0
step install 160 bash -c "$PY -m pip install --no-index --no-deps wheels/*.whl && \
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 $PY -m pip install --no-index --no-build-isolation \
--no-deps -e ."
    fi
    step bench_host 45 "$PY" tools/bench_host.py --out "$OUT/bench_host.json"
    step bench_overhead_350m_mb4 300 "$PY" tools/bench_overhead.py --layers 24 --hidden 1024 \
        --heads 16 --seq 2048 --vocab 50304 --dtype bf16 --reps 10 --micro-batch 4 \
        --out "$OUT/bench_gpt3_350m_mb4.json"
    step bench_kernels_4k 120 "$PY" tools/bench_kernels.py --device cuda --dtype bf16 \
        --seq 4096 --heads 16
    exit $status
fi

step environment 20 bash -c "nvidia-smi; $PY -c 'import torch, triton; print(torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name(), triton.__version__)'; nvcc --version"
# sm_90 only (H100, H200): half the CUDA compile time of the default 8.0 and 9.0
step install 160 bash -c "$PY -m pip install --no-index --no-deps wheels/*.whl && \
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 $PY -m pip install --no-index --no-build-isolation \
--no-deps -e ."
step backend 20 "$PY" -c "from megatron_abft import _ext; print(_ext.backend())"
# the GPU's tests, not their emulated twins (CPU work that every CI run already does)
step tests 150 "$PY" -m pytest -q tests/test_ext.py tests/test_ext_correct.py \
    tests/test_ext_tally.py tests/test_eec.py tests/test_checksum.py tests/test_fused_softmax.py \
    tests/test_fused_softmax_correct.py -k "not emulat"
step bench_kernels 60 "$PY" tools/bench_kernels.py --device cuda --dtype bf16 --seq 2048 \
    --heads 16
step bench_overhead_350m 120 "$PY" tools/bench_overhead.py --layers 24 --hidden 1024 \
    --heads 16 --seq 2048 --vocab 50304 --dtype bf16 --reps 10 \
    --out "$OUT/bench_gpt3_350m.json"
if command -v compute-sanitizer >/dev/null; then
    # the GPU tests but the two 150-example property tests, which memcheck would make too slow
    step sanitizer 60 compute-sanitizer --tool memcheck --error-exitcode 1 \
        "$PY" -m pytest -q tests/test_ext.py tests/test_ext_correct.py tests/test_ext_tally.py \
        tests/test_fused_softmax.py tests/test_fused_softmax_correct.py \
        -k "(cuda or on_the_gpu) and not fp64 and not emulat"
fi
exit $status
