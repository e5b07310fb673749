"""What a fault costs a training run, by how it is handled: corrected in place, recomputed,
the step skipped, rerun by Megatron's rerun state machine (campaign.recovery;
docs/fault-campaign.md).

    python -m tools.recovery_cost
"""

from campaign.recovery import main

if __name__ == "__main__":
    raise SystemExit(main())
