"""Facts every layer shares: the package's version (pyproject.toml holds the same) and the data set's classes."""

VERSION = "0.1.0"

# What output i of every model means: CIFAR-10's label order, as its archive numbers the labels.
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
