"""Time attention implementations, forward and backward, against the protected flash attention:
bench/attention.py, run as ``python -m tools.bench_attention`` (``--help``)."""

from bench.attention import main

if __name__ == "__main__":
    raise SystemExit(main())
