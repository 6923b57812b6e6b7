"""Fitting a device budget: the devices' rates (`profiles`), the step-time estimate
(`estimate`), the search over configurations (`search`, with `table` and `candidates`),
and their text (`render`)."""
