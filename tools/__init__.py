"""The command lines, run from the repository root as modules (``python -m tools.<name>
--help``): benchmarks and sweeps (their code in bench/), the fault campaign and the recovery
cost (campaign/), the flash gate's report, data preparation, the demos and the GPU check
(gpu_check.sh). Nothing imports a tool."""
