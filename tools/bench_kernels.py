"""Time the compiled checksum kernels against the PyTorch path, on the attention scores' GEMM:
bench/kernels.py, run as ``python -m tools.bench_kernels`` (``--help``)."""

from bench.kernels import main

if __name__ == "__main__":
    raise SystemExit(main())
