"""The base layer: errors, atomic files, the device and precision, the allocator, shared constants.

Imports nothing else of cifarkit: every other layer may import it."""
