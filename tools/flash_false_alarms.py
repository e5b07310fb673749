"""No false alarms on clean data: bench/flash_false_alarms.py, run as ``python -m
tools.flash_false_alarms`` (``--help``)."""

from bench.flash_false_alarms import main

if __name__ == "__main__":
    raise SystemExit(main())
