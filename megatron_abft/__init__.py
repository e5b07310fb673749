"""megatron-abft: algorithm-based fault tolerance for Megatron-core attention.

The EEC-ABFT core: reference checksums (``encode``), verification and in-place correction
(``verify_and_correct``) and seeded fault injection (``inject_``), configured by ``ABFTConfig``.
The protected Megatron-core layers live in ``megatron_abft.spec`` (``get_gpt_layer_abft_spec``),
with ``ABFT``, the one object a training loop holds (steps, the per-step policy, telemetry),
model-wide counters (``stats``) and fault injection (``inject``) exported here; a loop that
calls none of them is still never silent (``megatron_abft.runtime.model_runtime``). Importing this
package does not import Megatron.
"""

from megatron_abft.check.checksum import Checksums, encode, encode_columns, encode_rows
from megatron_abft.check.eec import (
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
from megatron_abft.config import POLICIES, SECTIONS, ABFTConfig, Policy
from megatron_abft.faults import (
    FAULT_KINDS,
    MODEL_SECTIONS,
    PATTERNS,
    Fault,
    Injection,
    TensorFault,
    inject_,
)
from megatron_abft.ops import selftest  # noqa: F401  registers the kernels' known-answer test
from megatron_abft.runtime.guard import ABFTUncorrectableError, collect_events, reset_stats, stats
from megatron_abft.runtime.model_runtime import inject, set_step
from megatron_abft.runtime.policy import StepOutcome, finish_step, validate_with_rerun
from megatron_abft.runtime.session import ABFT

__version__ = "0.1.0"

__all__ = [
    "ABFT",
    "ABFTUncorrectableError",
    "collect_events",
    "Fault",
    "MODEL_SECTIONS",
    "StepOutcome",
    "finish_step",
    "inject",
    "reset_stats",
    "set_step",
    "stats",
    "validate_with_rerun",
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
    "Policy",
    "SECTIONS",
    "TensorFault",
    "encode",
    "encode_columns",
    "encode_rows",
    "inject_",
    "report",
    "verify_and_correct",
]
