"""Choosing what protection costs: the overhead model that predicts it on GPUs (``scaling``)
and the check-frequency optimizer (``frequency``)."""
