"""No false alarms in the unfused path's checked GEMMs: bench/gemm_false_alarms.py, run as ``python
-m tools.gemm_false_alarms`` (``--help``)."""

from bench.gemm_false_alarms import main

if __name__ == "__main__":
    raise SystemExit(main())
