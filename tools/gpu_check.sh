#!/usr/bin/env bash
# Everything a lent GPU machine should run, in one call: install the carried wheels, build the
# CUDA extension, run the GPU tests (and compute-sanitizer on the kernels), then the benchmarks.
# Logs and JSON go under $OUT (default out/gpu). On this side, first carry megatron-core:
#     python -m pip download --no-deps megatron-core==0.19.2 -d wheels
# then run (device tool): bash tools/gpu_check.sh   with carry: ["wheels"]
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
status=0
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, remember failures, go on
    local name=$1; shift
    echo "== $name: $*" | tee -a "$OUT/summary.txt"
    if "$@" >"$OUT/$name.log" 2>&1; then echo "   ok" | tee -a "$OUT/summary.txt"
    else echo "   FAILED (exit $?), see $name.log" | tee -a "$OUT/summary.txt"; status=1; fi
}

step environment bash -c "nvidia-smi; $PY -c 'import torch, triton; print(torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name(), triton.__version__)'; nvcc --version"
step install bash -c "$PY -m pip install --no-index --no-deps wheels/*.whl && \
$PY -m pip install --no-index --no-build-isolation --no-deps -e ."
step backend "$PY" -c "from megatron_abft import _ext; print(_ext.backend())"
step tests "$PY" -m pytest -q tests/test_ext.py tests/test_ext_correct.py tests/test_eec.py \
    tests/test_checksum.py
if command -v compute-sanitizer >/dev/null; then
    step sanitizer compute-sanitizer --tool memcheck --error-exitcode 1 \
        "$PY" -m pytest -q tests/test_ext.py tests/test_ext_correct.py -k cuda
fi
step bench_kernels "$PY" tools/bench_kernels.py --device cuda --dtype bf16 --seq 2048 --heads 16
step bench_overhead_350m "$PY" tools/bench_overhead.py --layers 24 --hidden 1024 --heads 16 \
    --seq 2048 --vocab 50304 --dtype bf16 --reps 10 --out "$OUT/bench_gpt3_350m.json"
exit $status
