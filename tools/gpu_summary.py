"""The GPU run's headline figures in one file, from the raw results tools/gpu_check.sh leaves:
bench/gpu_summary.py, run as ``python -m tools.gpu_summary`` (``--help``)."""

from bench.gpu_summary import main

if __name__ == "__main__":
    raise SystemExit(main())
