"""Curves a person looks at, drawn from metrics.jsonl into plots/*.png."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tether.run import read_jsonl

# Bookkeeping series: plotted nowhere (they are in metrics.jsonl for scripts).
_SKIP = {"step", "time", "epoch"}
# Series read together, also drawn on one figure each (plots/panel_<name>.png), with a dashed line
# at `zero` where there is one: the offline trainers' log-probs, and the drift of the chosen
# completions' log-probs from the start, the number that falls when DPO trades likelihood for margin.
PANELS = {
    "logps": (("logps/chosen", "logps/rejected", "eval/logps/chosen", "eval/logps/rejected"), None),
    "chosen_drift": (("logps/chosen_drift", "eval/logps/chosen_drift"), 0.0),
    # a training number next to its held-out counterpart (eval points: held_out.py), where the
    # gap between them is the thing to read (overfitting, reward hacking)
    "loss_vs_eval": (("loss", "eval/loss"), None),
    "accuracy_vs_eval": (("rewards/accuracies", "eval/rewards/accuracies", "accuracy", "eval/accuracy"), None),
    "reward_vs_eval": (("reward", "eval/greedy/reward"), None),
}


def plot_metrics(run_path: str | Path, keys: list[str] | None = None) -> list[Path]:
    """One PNG per metric (x = step). Returns the files written."""
    try:
        import matplotlib
    except ImportError:  # a bare GPU image may lack it; metrics.jsonl still has every number
        import warnings
        warnings.warn("matplotlib is not installed: plots/ skipped", stacklevel=2)
        return []

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    run_path = Path(run_path)
    rows = read_jsonl(run_path / "metrics.jsonl")
    if not rows:
        return []
    names = keys or sorted({k for r in rows for k, v in r.items()
                            if k not in _SKIP and isinstance(v, (int, float))})
    out_dir = run_path / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    # One figure redrawn per metric: a new figure + tight_layout per PNG cost ~75 ms each (2.3 s
    # for the 31 curves of a GRPO run, ~1 % of the quickstart), reuse ~half of it.
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    fig.subplots_adjust(left=0.16, right=0.97, bottom=0.16, top=0.9)
    try:
        for name in names:
            pts = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), (int, float))]
            if not pts:
                continue
            ax.clear()
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="." if len(pts) < 30 else None, linewidth=1.2)
            ax.set_xlabel("step")
            ax.set_title(name)
            ax.grid(alpha=0.3)
            path = out_dir / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".png")
            _save(fig, path)
            written.append(path)
        if keys is None:
            written += _panels(rows, ax, fig, out_dir)
    finally:
        plt.close(fig)
    return written


def _panels(rows: list[dict], ax, fig, out_dir: Path) -> list[Path]:
    written = []
    for panel, (names, zero) in PANELS.items():
        series = {n: [(r["step"], r[n]) for r in rows if isinstance(r.get(n), (int, float))] for n in names}
        series = {n: pts for n, pts in series.items() if pts}
        if not series:
            continue
        ax.clear()
        for name, pts in series.items():
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="." if len(pts) < 30 else None, linewidth=1.2, label=name)
        if zero is not None:
            ax.axhline(zero, color="gray", linestyle="--", linewidth=0.8)
        ax.set_xlabel("step")
        ax.set_title(panel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        path = out_dir / f"panel_{panel}.png"
        _save(fig, path)
        written.append(path)
    return written


def _save(fig, path: Path) -> None:
    """`fig` as a PNG at `path`, whole or not at all (written to a temporary name and renamed): a
    full disk leaves the plot written before, never a cut-off image."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        fig.savefig(tmp, format="png")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
