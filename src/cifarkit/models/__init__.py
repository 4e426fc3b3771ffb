"""The model registry; importing the family modules registers their models."""
from cifarkit.models import cifar10net, fastnet, resnet, simplecnn  # noqa: F401  (registration side effect)
from cifarkit.models.registry import CLASSES, count_macs, count_params, create, names

__all__ = ["CLASSES", "create", "names", "count_params", "count_macs"]
