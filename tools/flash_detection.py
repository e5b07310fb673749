"""Detection limit of the flash kernels' checks: bench/flash_detection.py, run as ``python -m
tools.flash_detection`` (``--help``)."""

from bench.flash_detection import main

if __name__ == "__main__":
    raise SystemExit(main())
