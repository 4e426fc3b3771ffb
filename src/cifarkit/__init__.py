"""cifarkit: train, measure, release and serve CIFAR-10 classifiers on CUDA, MPS or a plain CPU."""
__version__ = "0.1.0"
