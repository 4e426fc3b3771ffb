"""The speed-up at equal accuracy: `fast` trained at two or more budgets (epochs) in the same rounds as a reference,
its time interpolated to the budget at which its mean accuracy equals the reference's, and the reference's time over
that time, with a bootstrap interval over the rounds. Also the time each side takes to a mean accuracy (94%).

A speed ratio at a lower accuracy says little: a recipe trained for fewer epochs is faster and less accurate. Between
two budgets that bracket the reference's accuracy, both accuracy and time change about linearly with the epochs, so
the point where the accuracies are equal is read off the line between them. Outside the bracket the line is extended
and the figure is marked as extrapolated.

The rounds are resampled whole (each round holds a run of every side, made one after the other), so the interval
carries both the accuracy's run-to-run spread, which moves the interpolated budget, and the machine's speed drift.
"""
from __future__ import annotations

import statistics

import numpy as np

RESAMPLES = 10_000  # bootstrap resamples of the rounds: the interval's ends move by well under 0.01x beyond this
TIMERS = {"whole_process": "wall_time_s", "training": "train_time_s"}


def ratio_text(ratio: float, interval: list[float] | None) -> str:
    """A speed ratio with its 95% interval where there is one, as the tables write it: 1.24x (1.20-1.25)."""
    return f"{ratio:.2f}x" + (f" ({interval[0]:.2f}-{interval[1]:.2f})" if interval else "")


def _means(rounds: list[dict], side: str) -> dict:
    runs = [r["runs"][side] for r in rounds]
    return {"accuracy": statistics.fmean(r["test_acc_6_views"] for r in runs),
            **{key: statistics.fmean(r[key] for r in runs) for key in TIMERS.values()}}


def at_accuracy(points: list[tuple[float, dict]], target: float) -> dict | None:
    """`fast`'s budget and times at mean accuracy `target`, on the line through the two budgets around it (or the
    nearest two, extended): `points` are (epochs, means) pairs. None where the accuracy does not grow with the
    epochs between them, where no line can be read."""
    points = sorted(points, key=lambda point: point[0])
    pairs = list(zip(points, points[1:]))
    below = [pair for pair in pairs if pair[0][1]["accuracy"] <= target <= pair[1][1]["accuracy"]]
    if below:
        low, high = below[0]
    else:
        low, high = pairs[0] if target < points[0][1]["accuracy"] else pairs[-1]
    (low_epochs, low_means), (high_epochs, high_means) = low, high
    gain = high_means["accuracy"] - low_means["accuracy"]
    if gain <= 0:
        return None
    fraction = (target - low_means["accuracy"]) / gain
    return {"epochs": low_epochs + fraction * (high_epochs - low_epochs), "extrapolated": not below,
            **{key: low_means[key] + fraction * (high_means[key] - low_means[key]) for key in TIMERS.values()}}


def _speedups(rounds: list[dict], budgets: dict[str, float], reference: str) -> dict | None:
    theirs = _means(rounds, reference)
    ours = at_accuracy([(epochs, _means(rounds, side)) for side, epochs in budgets.items()], theirs["accuracy"])
    if ours is None:
        return None
    return {"point": ours, "target": theirs["accuracy"],
            **{timer: theirs[key] / ours[key] for timer, key in TIMERS.items()}}


def speedup(rounds: list[dict], budgets: dict[str, float], reference: str, resamples: int = RESAMPLES) -> dict:
    """The reference's time over `fast`'s at the reference's mean accuracy (6 views on every side), each timer with
    its 95% bootstrap interval over the rounds. `budgets`: `fast`'s side of each budget in the rounds -> its epochs."""
    found = _speedups(rounds, budgets, reference)
    result = {"reference_accuracy": _means(rounds, reference)["accuracy"], "rounds": len(rounds), "budgets": budgets}
    if found is None:
        return {**result, "defined": False,
                "why": "the mean accuracy does not grow with the epochs between the budgets: more rounds, or "
                       "budgets further apart"}
    result.update(defined=True, epochs=found["point"]["epochs"], extrapolated=found["point"]["extrapolated"],
                  cifarkit_times={key: found["point"][key] for key in TIMERS.values()})
    samples = {timer: [] for timer in TIMERS}
    undefined = 0
    if len(rounds) > 1:
        draws = np.random.default_rng(0).integers(0, len(rounds), size=(resamples, len(rounds)))
        for draw in draws:
            again = _speedups([rounds[i] for i in draw], budgets, reference)
            if again is None:
                undefined += 1
                continue
            for timer in TIMERS:
                samples[timer].append(again[timer])
    for timer in TIMERS:
        interval = [float(x) for x in np.percentile(samples[timer], [2.5, 97.5])] if samples[timer] else None
        result[timer] = {"ratio": found[timer], "ci95": interval}
    # Resamples in which the accuracy did not grow with the epochs have no figure: many of them say the budgets'
    # accuracies overlap, and the interval is then too narrow.
    result["undefined_resamples"] = undefined
    result["resamples"] = resamples if len(rounds) > 1 else 0
    return result


def time_to(rounds: list[dict], budgets: dict[str, float], references: list[str], target: float) -> dict:
    """Each side's time to a mean accuracy of `target` (6 views): `fast`'s interpolated between its budgets (only
    within them), a reference's its own run's where its mean reaches `target` (its one budget: an upper bound).
    None for a side that does not reach it."""
    ours = at_accuracy([(epochs, _means(rounds, side)) for side, epochs in budgets.items()], target)
    found = {"target": target,
             "cifarkit": None if ours is None or ours["extrapolated"] else {
                 "epochs": ours["epochs"], **{key: ours[key] for key in TIMERS.values()}}}
    for name in references:
        theirs = _means(rounds, name)
        found[name] = ({key: theirs[key] for key in TIMERS.values()} if theirs["accuracy"] >= target else None)
    return found
