"""lab/measure_cpu_kernels.py on a batch of 8: each pool of a fastnet training step, timed both ways."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("measure_cpu_kernels", ROOT / "lab" / "measure_cpu_kernels.py")
measure_cpu_kernels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(measure_cpu_kernels)


def test_every_pool_of_a_step_is_timed_both_ways(tmp_path, monkeypatch):
    monkeypatch.setenv("CIFARKIT_HOME", str(tmp_path / "home"))
    out = tmp_path / "kernels.json"
    assert measure_cpu_kernels.main(["--batch-size", "8", "--rounds", "1", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    rows = written["rows"]
    assert written["source"]["commit"]  # the index names the commit it measured
    assert [row["shape"][:2] for row in rows] == [[8, 64], [8, 256], [8, 256]]
    assert all(row["torch_ms"] > 0 and row["cifarkit_ms"] > 0 for row in rows)
