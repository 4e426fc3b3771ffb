"""Measurements: training and inference benchmarks, the profiler, timed speed runs, recipe variants compared on a
validation split, and the load test of `cifarkit serve`."""
