"""Detection limit of the checked GEMM against the checks after the GEMM: bench/gemm_detection.py,
run as ``python -m tools.gemm_detection`` (``--help``)."""

from bench.gemm_detection import main

if __name__ == "__main__":
    raise SystemExit(main())
