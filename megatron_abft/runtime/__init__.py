"""What runs around the checks: the guards that decide what is due and count what they find
(``guard``), the runtime of a model that knows the step and settles every fault nothing consumed
(``model_runtime``), the loop's own policy decisions (``policy``), the ``ABFT`` object a loop
holds (``session``) and the telemetry (``telemetry``)."""
