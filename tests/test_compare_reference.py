"""scripts/compare_reference.py's parts that need no reference: the order of the rounds, the ratios' interval, the
check of the user's airbench94_muon.py, and the README block rendered from a JSON the script wrote (a real run on
2,000 images, tests/fixtures/compare-reference-subset.json). The references themselves are not run here: airbench94_muon
is not in the repository, and a full comparison takes hours on this CPU."""
from __future__ import annotations

import json

import pytest
from scipy import stats

from conftest import ROOT, load_script

pytestmark = pytest.mark.unit

compare = load_script(ROOT / "scripts" / "compare_reference.py")
render = load_script(ROOT / "scripts" / "render_readme.py")


def test_rounds_alternate_abba():
    assert compare.round_orders(["cifarkit", "muon"], 4) == [["cifarkit", "muon"], ["muon", "cifarkit"],
                                                              ["cifarkit", "muon"], ["muon", "cifarkit"]]
    assert compare.round_orders(["a", "b", "c"], 2) == [["a", "b", "c"], ["c", "b", "a"]]


def test_ratio_interval_is_the_t_interval_of_the_per_round_ratios():
    ratios = [1.2, 1.4, 1.3]
    result = compare.ratio_statistics(ratios)
    half = stats.t.ppf(0.975, 2) * 0.1 / 3 ** 0.5
    assert result["mean"] == pytest.approx(1.3)
    assert result["ci95"] == pytest.approx([1.3 - half, 1.3 + half])
    assert compare.ratio_statistics([1.25])["ci95"] is None


def test_muon_file_is_required_and_checked(tmp_path):
    with pytest.raises(SystemExit, match="curl -LO https://raw.githubusercontent.com/KellerJordan"):
        compare.check_muon_file(None)
    with pytest.raises(SystemExit, match="no such file"):
        compare.check_muon_file(str(tmp_path / "airbench94_muon.py"))
    wrong = tmp_path / "other.py"
    wrong.write_text("class CifarNet:\n    pass\n")
    with pytest.raises(SystemExit, match="does not look like airbench94_muon.py .*Muon, main"):
        compare.check_muon_file(str(wrong))


def test_readme_block_renders_a_real_result(tmp_path, monkeypatch):
    result = json.loads((ROOT / "tests" / "fixtures" / "compare-reference-subset.json").read_text())
    (tmp_path / "compare-reference-subset.json").write_text(json.dumps(result))
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    block = render.reference_block()
    muon = result["references"]["airbench94_muon"]
    assert "not a comparison" in block
    row = next(line for line in block.splitlines() if line.startswith("| airbench94_muon"))
    assert f"{muon['speedup']['whole_process']['mean']:.2f}x" in row
    assert f"{100 * muon['accuracy']['mean']:.2f}%" in row
    assert f"{100 * result['cifarkit']['accuracy_6_views']['mean']:.2f}%" in block
    assert "airbench94_muon: float32, Newton-Schulz float32, tcmalloc, 2 threads" in block
