"""Developers' machinery that the library never imports: the flash kernels' ahead-of-time
builds for NVIDIA GPUs on any machine (``aot``: Triton, ptxas and cuobjdump) and the reading of
their SASS (``sass``), which make the static speed gate (tests/flash/test_flash_gate.py,
``python -m tools.flash_sass``)."""
