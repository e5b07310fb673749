"""How fast the checksum kernels read a matrix on this machine, by its size, layout and cache
state: bench/reads.py, run as ``python -m tools.bench_reads`` (``--help``)."""

from bench.reads import main

if __name__ == "__main__":
    raise SystemExit(main())
