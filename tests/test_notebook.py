"""notebooks/quickstart.ipynb, executed top to bottom by a real Jupyter kernel (nbclient) on the fixture data."""

import nbformat
import pytest
import yaml
from nbclient import NotebookClient

from cifarkit.artifacts.releases import SHIPPED
from conftest import ROOT

pytestmark = pytest.mark.e2e

NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"


def test_the_committed_notebook_has_no_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.outputs == [] and cell.execution_count is None for cell in code)


def test_the_notebook_runs_and_shows_its_pictures(cifar_home, tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel inherits this process's environment: CIFARKIT_HOME is the fixture sample's home (cifar_home).
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    held = yaml.safe_load((SHIPPED / "version_A" / "config.yaml").read_text())["model"]["name"]
    assert "test accuracy" in text and f"release A: {held}" in text
    pictures = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(pictures) == 2  # the curves and the example pictures with their predictions
