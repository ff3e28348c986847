"""The device a rank computes on: which one and in which dtype (``choice``), clocks
that time its work and waiting for it (``clocks``), named ranges in profiler
traces (``ranges``)."""
