"""The model registry; importing the family modules registers their models."""
from cifarkit.core.constants import CLASSES
from cifarkit.models import cifar10net, fastnet, resnet, simplecnn  # noqa: F401  (registration side effect)
from cifarkit.models.registry import count_macs, count_params, create, names

__all__ = ["CLASSES", "create", "names", "count_params", "count_macs"]
