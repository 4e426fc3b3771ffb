"""The data layer: CIFAR-10 found, verified, cached and split (`cifar10`), augmented in batches (`loader`), and the
recipe sections that configure both (`config`). Imports core and artifacts (the normalization constants)."""
