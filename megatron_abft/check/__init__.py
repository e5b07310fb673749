"""The EEC-ABFT check of one GEMM in PyTorch, the reference the compiled kernels match:
checksums (``checksum``), the rounding bound (``tolerance``), detection on both sides
(``sides``), location and correction (``correction``), all behind ``eec.verify_and_correct``;
``plan`` runs a planned check on the compiled ops, ``ledger`` counts outcomes on the device."""
