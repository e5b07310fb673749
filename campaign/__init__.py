"""The fault-injection campaign (cli: which soft errors in attention make training
non-trainable, protection off and on) and the recovery-cost study (recovery: what a fault costs
when it is corrected, recomputed, skipped or rerun), on a small GPT trained by the launch
script on 2 gloo ranks. Run from the repository root: ``python -m tools.fault_campaign``,
``python -m tools.recovery_cost``; docs/fault-campaign.md has the results."""
