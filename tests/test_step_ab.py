"""`cifarkit profile --before COMMIT`: the step of a commit against the working tree's, whole profiles taking turns
in ABBA order from a git worktree, the ratio printed and recorded as step time alone."""
import json

import pytest

from cifarkit.cli import main

TINY = ["--recipe", "simplecnn", "--set", "train.batch_size=50", "--steps", "1"]


def test_a_commit_s_step_against_the_working_tree_s(cifar_home, tmp_path, capsys):
    out = tmp_path / "ab.json"
    assert main(["profile", "--before", "HEAD", *TINY, "--pairs", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["order"] == ["before", "after", "after", "before"]
    assert [len(result["runs"][side]) for side in ("before", "after")] == [2, 2]
    assert all(run["step_s"] > 0 and run["batch_size"] == 50 for side in result["runs"].values() for run in side)
    ratios = [b["step_s"] / a["step_s"] for b, a in zip(result["runs"]["before"], result["runs"]["after"])]
    assert result["speedup_per_pair"] == pytest.approx(ratios)
    assert result["after"].startswith(result["before"])  # HEAD on both sides, the after side maybe with changes
    # No ratio without its word on accuracy, in the output and the file alike.
    assert "speed only" in result["accuracy"] and "speed-up per step" in printed and "speed only" in printed
    assert result["command"].startswith("cifarkit profile --before HEAD") and result["measured"]


def test_an_unknown_commit_is_named_before_anything_runs(capsys):
    assert main(["profile", "--before", "no-such-commit-anywhere", *TINY]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "--before no-such-commit-anywhere: no such commit" in error
