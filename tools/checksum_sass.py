"""What the sm_90 SASS of the CUDA checksum kernels (block sums, products) does a row:
bench/checksum_sass.py, run as ``python -m tools.checksum_sass`` (``--help``)."""

from bench.checksum_sass import main

if __name__ == "__main__":
    raise SystemExit(main())
