"""Versioned releases of trained weights: build, check, compare, evaluate and export them."""
