"""Fault-injection campaign: which soft errors in attention make training non-trainable, with
ABFT protection off and on (campaign.cli; docs/fault-campaign.md).

    python -m tools.fault_campaign                      # the default campaign, then the report
    python -m tools.fault_campaign --report-only        # tables and figure from the results
"""

from campaign.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
