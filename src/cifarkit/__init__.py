"""cifarkit: train, measure, release and serve CIFAR-10 classifiers on CUDA, MPS or a plain CPU."""
__version__ = "0.1.0"


def __getattr__(name):
    # `from cifarkit import Classifier` without importing torch for every `import cifarkit`
    if name in ("Classifier", "CIFAR10Classifier"):
        from cifarkit import inference
        return getattr(inference, name)
    raise AttributeError(f"module 'cifarkit' has no attribute {name!r}")
