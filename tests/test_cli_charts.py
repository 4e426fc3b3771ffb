"""Charts people read: files in the format their name says, and axes that do not mislead."""
import subprocess
import sys

import pytest

from cifarkit.cli import main
from cifarkit.training import plots

MAGIC = {".png": b"\x89PNG\r\n\x1a\n", ".jpg": b"\xff\xd8\xff", ".JPEG": b"\xff\xd8\xff", ".pdf": b"%PDF",
         ".svg": b"<?xml"}


@pytest.mark.unit
@pytest.mark.parametrize("suffix", MAGIC)
def test_data_show_writes_the_format_its_suffix_names(cifar_home, tmp_path, capsys, suffix):
    out = tmp_path / f"grid{suffix}"
    assert main(["data", "show", "--out", str(out), "--count", "8"]) == 0
    assert out.read_bytes().startswith(MAGIC[suffix])
    assert capsys.readouterr().out == f"wrote {out} (8 train images)\n"


@pytest.mark.unit
@pytest.mark.parametrize("name", ["grid.gif", "grid"])
def test_data_show_refuses_a_suffix_it_cannot_write_in_one_line(cifar_home, tmp_path, capsys, name):
    folder = tmp_path / "figures"
    folder.mkdir()
    out = folder / name
    assert main(["data", "show", "--out", str(out), "--count", "8"]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"cifarkit: error: cannot write a figure to {out}: name a file ending in "
                            f".png, .jpg, .jpeg, .pdf, .svg\n")
    assert list(folder.iterdir()) == []  # nothing written, not even a temporary file


def release(name: str, accuracy: float, speed: float) -> dict:
    return {"release": name, "model": "net", "test_acc": accuracy, "inference": {"images_per_s_batch256": speed}}


@pytest.mark.unit
def test_comparison_shows_a_one_point_gap_on_a_full_axis_with_values_on_the_bars(tmp_path):
    figure = plots.release_comparison([release("A", 0.9452, 430.0), release("B", 0.9353, 4537.0)],
                                      tmp_path / "compare.png")
    accuracy, speed = figure.axes
    assert accuracy.get_ylim()[0] == 0 and speed.get_ylim()[0] == 0
    assert [t.get_text() for t in accuracy.texts] == ["94.52%", "93.53%"]
    assert [t.get_text() for t in speed.texts] == ["430", "4,537"]


@pytest.mark.unit
def test_curves_tick_whole_epochs(tmp_path):
    records = [{"epoch": e, "train_loss": 2 - e / 3, "train_acc": e / 4, "test_loss": 2 - e / 4, "test_acc": e / 5}
               for e in (1, 2, 3)]
    figure = plots.curves(records, tmp_path / "curves.png")
    for ax in figure.axes:
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert len(ticks) >= 2 and all(t == int(t) for t in ticks)


def speedrun_runs() -> list[dict]:
    """Two seeds of three epochs: the last curve point is the final (TTA) evaluation, as train.py writes it."""
    return [{"seed": seed, "test_acc": 0.80 + seed / 100, "wall_time_s": 185.0 + seed,
             "curve": [{"epoch": e, "elapsed_s": 60.0 * e + seed, "test_acc": 0.6 + e / 15 + seed / 100}
                       for e in (1, 2, 3)]} for seed in (0, 1)]


@pytest.mark.parametrize("final_tta, final_label", [(True, "final score, with TTA (mirror + 1-pixel shifts)"),
                                                    (False, "final score (single view)")])
@pytest.mark.unit
def test_speedrun_chart_starts_at_zero_minutes_and_says_what_the_final_point_is(tmp_path, final_tta, final_label):
    figure = plots.accuracy_vs_time(speedrun_runs(), 0.75, tmp_path / "speedrun.png", "fast",
                                    overrides=("train.epochs=3", "optim.lr=0.2"), final_tta=final_tta)
    ax, = figure.axes
    assert ax.get_xlim()[0] == 0
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["seed 0", "seed 1", "target 75.0%", final_label]
    assert ax.get_title() == "fast\n--set train.epochs=3 optim.lr=0.2"
    # With TTA the last epoch's point is the final dot, not a point of the single-view line.
    seed_line = next(line for line in ax.get_lines() if line.get_label() == "seed 0")
    assert len(seed_line.get_xdata()) == (2 if final_tta else 3)


@pytest.mark.unit
def test_speedrun_chart_title_says_when_nothing_was_overridden(tmp_path):
    figure = plots.accuracy_vs_time(speedrun_runs(), 0.75, tmp_path / "speedrun.png", "fast")
    assert figure.axes[0].get_title() == "fast\nno overrides"


def test_writing_a_figure_leaves_the_users_matplotlib_backend_alone(tmp_path):
    # A notebook's inline backend, or a desktop's window, must survive `import cifarkit` and the charts it writes.
    code = ("import sys, matplotlib; matplotlib.use('svg'); from cifarkit.training import plots; "
            "plots.curves([{'epoch': 1, 'train_loss': 1.0, 'train_acc': 0.5}], sys.argv[1]); "
            "import matplotlib.pyplot; print(matplotlib.get_backend(), len(matplotlib.pyplot.get_fignums()))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c.png")], capture_output=True, text=True,
                          check=True)
    assert done.stdout.split() == ["svg", "0"]
    assert (tmp_path / "c.png").read_bytes().startswith(MAGIC[".png"])
