"""The overhead report: bench/overhead_report.py, run as ``python -m tools.overhead_report``
(``--help``)."""

from bench.overhead_report import main

if __name__ == "__main__":
    raise SystemExit(main())
