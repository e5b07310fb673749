"""The measurements behind docs/: benchmarks (attention, overhead, kernels, reads, one timer),
the false-alarm and detection-limit sweeps, the checksum kernels' SASS, the flash tiles' GPU
tuning, the overhead report and the GPU run's summary. Each module with a command line is run
through tools/ (``python -m tools.<name>``); tests import these modules, never tools/."""
