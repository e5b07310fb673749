"""Benchmarks, the fault campaign, the overhead report and the GPU check, run from the
repository root as modules: ``python -m tools.<name> --help``."""
