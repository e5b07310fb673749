"""Measure what protection costs: bench/overhead.py, run as ``python -m tools.bench_overhead``
(``--help``)."""

from bench.overhead import main

if __name__ == "__main__":
    raise SystemExit(main())
