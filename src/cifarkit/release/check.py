"""`cifarkit release --check`: every file of a release against the sha256 its metrics.json records."""
from __future__ import annotations

from pathlib import Path

import yaml

from cifarkit.artifacts import weights
from cifarkit.artifacts.releases import (
    METRICS_NAME,
    WEIGHTS_NAME,
    read_metrics,
)
from cifarkit.core.errors import CifarkitError
from cifarkit.core.files import (
    file_digest,
)

UNRECORDED = ("__pycache__",)  # written by `from preprocess import preprocess` run inside the release folder


def check(folder: Path) -> list[tuple[str, str, str]]:
    """Every file of a release against what its metrics.json records: (file, 'ok' | 'error' | 'warning', what is
    wrong). Beyond the sha256s, the weights must load, name the model config.yaml and metrics.json name, and each
    recorded export must have been made from these weights. Files the manifest does not list are warnings."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CifarkitError(f"{folder} is not a release folder; give a version name or a release folder")
    try:
        metrics = read_metrics(folder)
    except CifarkitError as e:
        return [(METRICS_NAME, "error", str(e))]
    if metrics is None:
        return [(METRICS_NAME, "error", "missing: this folder is not a release (write one with `cifarkit release`)")]
    expected = dict(metrics.get("files") or {})
    expected[WEIGHTS_NAME] = metrics.get("weights_sha256")
    exports = metrics.get("exports", {})
    for report in exports.values():
        expected[report["file"]] = report.get("sha256")
    problems: dict[str, list[str]] = {name: [] for name in (METRICS_NAME, *expected)}
    if not metrics.get("files"):
        problems[METRICS_NAME].append("records no sha256 of the other files (`files`); write the release again "
                                      "with `cifarkit release --force`")
    for name, sha in expected.items():
        path = folder / name
        if not path.is_file():
            problems[name].append("missing")
        elif (actual := file_digest(path, "sha256")) != sha:
            problems[name].append(f"changed: sha256 {actual}, recorded {sha}")
    for fmt, report in exports.items():
        if report.get("weights_sha256") != metrics.get("weights_sha256"):
            problems[report["file"]].append(f"was not made from these weights; write it again with "
                                            f"`cifarkit export {folder} --format {fmt}`")
    if (folder / WEIGHTS_NAME).is_file():
        _check_model_names(folder, metrics, problems)
    findings = [(name, "error" if found else "ok", "; ".join(found)) for name, found in sorted(problems.items())]
    for path in sorted(folder.iterdir()):
        if path.name not in problems and path.name not in UNRECORDED:
            findings.append((path.name, "warning", f"not recorded in {METRICS_NAME}"))
    return findings


def _check_model_names(folder: Path, metrics: dict, problems: dict[str, list[str]]) -> None:
    try:
        _, meta = weights.load_weights(folder / WEIGHTS_NAME)
    except CifarkitError as e:
        problems[WEIGHTS_NAME].append(str(e))
        return
    if metrics.get("model") != meta["model"]:
        problems[METRICS_NAME].append(f"names model {metrics.get('model')!r}, the weights hold {meta['model']!r}")
    config_path = folder / "config.yaml"
    if not config_path.is_file():
        problems.setdefault("config.yaml", ["missing"])  # already there when the manifest lists it
        return
    try:
        named = yaml.safe_load(config_path.read_text())["model"]["name"]
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError) as e:
        problems.setdefault("config.yaml", []).append(f"names no model ({type(e).__name__}: {e})")
        return
    if named != meta["model"]:
        problems.setdefault("config.yaml", []).append(f"names model {named!r}, the weights hold {meta['model']!r}")
