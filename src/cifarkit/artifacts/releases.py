"""The release folder: its files' names, where a named release is, its metrics and the check of its weights."""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from cifarkit.core.errors import CifarkitError
from cifarkit.core.files import file_digest

log = logging.getLogger(__name__)


SHIPPED = Path(__file__).resolve().parent.parent / "pretrained"  # the releases that ship with the package
MODELS = Path("cifar10_models")  # where `cifarkit release` writes them, relative to the working folder
DEFAULT_VERSION = "A"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
WEIGHTS_NAME = "model.safetensors"
METRICS_NAME = "metrics.json"
ONNX_NAME = "model.onnx"
UNVERIFIED = "load it unverified with verify=False (cifarkit predict --no-verify)"


def release_dir(name_or_path: str | Path, root: str | Path | None = None,
                accepts: str = "a release folder, a run folder or a .safetensors file") -> Path:
    """Where the release (or weights) a user named is, the same for every command and the API: an existing path as
    it is; else a version name, looked up as <root>/version_NAME (root: ./cifar10_models), then among the shipped
    releases. Otherwise an error that says where it looked, which names exist and (`accepts`) what else to give."""
    text, root = str(name_or_path), Path(root or MODELS)
    restore_replaced(Path(text))
    if Path(text).exists():
        return Path(text)
    places = {root: f"in {root}", SHIPPED: "shipped"}  # one entry where root is the shipped folder itself
    where = text
    if NAME_PATTERN.fullmatch(text) and not text.endswith(".safetensors"):
        for folder in places:
            candidate = folder / f"version_{text}"
            restore_replaced(candidate)
            if candidate.is_dir():
                # The same name may exist in both places: say which one this command uses.
                log.info("version %s: %s", text, "the shipped release" if folder == SHIPPED else candidate)
                return candidate
        where = f"{text}, {root / f'version_{text}'} or the shipped version_{text}"
    found = "; ".join(f"{', '.join(names)} ({label})" for folder, label in places.items()
                      if (names := versions(folder)))
    raise CifarkitError(f"no weights at {where}; give a version name (found: {found or 'none'}) or {accepts}")


def versions(folder: Path) -> dict[str, Path]:
    return {p.name.removeprefix("version_"): p for p in sorted(folder.glob("version_*")) if p.is_dir()}


def known_releases(root: str | Path | None = None) -> dict[str, Path]:
    """name -> folder of every release a version name reaches (see `release_dir`), sorted by name."""
    found = {**versions(SHIPPED), **versions(Path(root or MODELS))}  # the user's shadow shipped ones of that name
    return dict(sorted(found.items()))


def replaced_path(target: Path) -> Path:
    """Where `cifarkit release --force` parks the old release between its two renames, where it cannot swap."""
    return target.with_name(f".{target.name}.replaced")


def restore_replaced(target: Path) -> None:
    """A replacement killed between its two renames leaves no release at `target`: move the parked one back."""
    parked = replaced_path(Path(target))
    if not os.path.lexists(target) and parked.is_dir():
        os.rename(parked, target)
        log.warning("restored %s from %s, left there by an interrupted `cifarkit release`", target, parked.name)


def read_metrics(folder: Path) -> dict | None:
    """A release's metrics.json, or None where the folder has none (a run folder, a folder of bare weights)."""
    path = Path(folder) / METRICS_NAME
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CifarkitError(f"{path} is unreadable ({e}); restore the release or write it again with "
                            f"`cifarkit release`") from None


def weights_sha256(weights: Path, metrics: dict | None, verify: bool = True) -> str:
    """The weights file's sha256; with `verify`, refused unless it is the one `metrics` (a release's) records."""
    try:
        actual = file_digest(weights, "sha256")
    except FileNotFoundError:
        raise CifarkitError(f"no weights at {weights}; give a release folder (cifarkit release), a run folder or a "
                            f".safetensors file") from None
    expected = (metrics or {}).get("weights_sha256")
    if verify and metrics is not None and actual != expected:
        raise CifarkitError(f"{weights} has sha256 {actual} but {METRICS_NAME} records {expected}: the file was "
                            f"changed or damaged; restore the release or write it again with `cifarkit release`, "
                            f"or {UNVERIFIED}")
    return actual
