"""The flash kernels' tiles, timed on a GPU: bench/flash_tune.py, run as ``python -m
tools.flash_tune`` (``--help``)."""

from bench.flash_tune import main

if __name__ == "__main__":
    raise SystemExit(main())
