"""cifarkit: train, measure, release and serve CIFAR-10 classifiers on CUDA, MPS or a plain CPU."""
from cifarkit.core.constants import VERSION as __version__  # noqa: F401  (cifarkit.__version__)


def __getattr__(name):
    # `from cifarkit import Classifier` without importing torch for every `import cifarkit`
    if name in ("Classifier", "CIFAR10Classifier"):
        from cifarkit.inference import classifier
        return getattr(classifier, name)
    raise AttributeError(f"module 'cifarkit' has no attribute {name!r}")
