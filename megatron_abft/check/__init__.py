"""The EEC-ABFT check of one GEMM in PyTorch, the reference the compiled kernels match:
checksums (``checksum``), the rounding bound (``tolerance``), detection on both sides
(``sides``), location and correction (``correction``), all behind ``eec.verify_and_correct``;
``checker`` picks, once per GEMM signature, the reference or the compiled ops to run a guard's
check; ``ledger`` counts outcomes on the device."""
