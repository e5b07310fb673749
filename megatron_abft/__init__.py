"""megatron-abft: algorithm-based fault tolerance for Megatron-core attention.

The EEC-ABFT core: reference checksums (``encode``), verification and in-place correction
(``verify_and_correct``) and seeded fault injection (``inject_``), configured by ``ABFTConfig``.
"""

from megatron_abft.checksum import Checksums, encode, encode_columns, encode_rows
from megatron_abft.config import POLICIES, SECTIONS, ABFTConfig
from megatron_abft.eec import (
    CLEAN,
    CORRECTED,
    KINDS,
    OUTCOMES,
    UNCORRECTABLE,
    EECResult,
    GemmOperands,
    Residuals,
    report,
    residuals,
    verify_and_correct,
)
from megatron_abft.faults import FAULT_KINDS, PATTERNS, Injection, TensorFault, inject_

__version__ = "0.1.0"

__all__ = [
    "CLEAN",
    "CORRECTED",
    "UNCORRECTABLE",
    "Residuals",
    "residuals",
    "ABFTConfig",
    "Checksums",
    "EECResult",
    "FAULT_KINDS",
    "GemmOperands",
    "Injection",
    "KINDS",
    "OUTCOMES",
    "PATTERNS",
    "POLICIES",
    "SECTIONS",
    "TensorFault",
    "encode",
    "encode_columns",
    "encode_rows",
    "inject_",
    "report",
    "verify_and_correct",
]
