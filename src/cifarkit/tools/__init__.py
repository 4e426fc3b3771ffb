"""Measurements: training and inference benchmarks, the profiler and timed speed runs."""
