"""Measurements: training and inference benchmarks, the profiler, timed speed runs, recipe values searched on a
validation split, and the load test of `cifarkit serve`."""
