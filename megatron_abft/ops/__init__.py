"""The compiled checksum kernels' Python side: bindings and eligibility (``compiled``), their
known-answer self-test (``selftest``) and the fused softmax, the softmax that checks the scores GEMM
(``fused_softmax``). The kernels themselves are in csrc/."""
