"""Curves for the Runs page: metrics.jsonl rows as columns, smoothed and downsampled server-side,
so a 100k-line run sends the browser a few thousand points."""

from __future__ import annotations

import math

import numpy as np


def columns(rows: list[dict]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{metric: (steps, values)} over the rows that log it with a finite number (rows without a
    usable step are skipped; `time` is not a metric here). Steps keep file order."""
    out: dict[str, tuple[list, list]] = {}
    for r in rows:
        step = r.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            continue
        for k, v in r.items():
            if k in ("step", "time") or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if math.isfinite(v):
                xs, ys = out.setdefault(k, ([], []))
                xs.append(step)
                ys.append(v)
    return {k: (np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)) for k, (xs, ys) in out.items()}


def ema(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard's smoothing: the debiased exponential moving average
    s_t = w·s_{t−1} + (1 − w)·v_t,  s_0 = 0,  shown as s_t / (1 − w^{t+1}),
    so the first points are not dragged towards 0. weight 0 = the raw values."""
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out = np.empty(len(values), dtype=np.float64)
    s, debias = 0.0, 1.0
    for i, v in enumerate(values):
        s = weight * s + (1 - weight) * v
        debias *= weight
        out[i] = s / (1 - debias)
    return out


def downsample(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """At most `max_points` of the points (x, y), chosen so the drawn line keeps its envelope:
    the points split into max_points // 2 consecutive buckets and each bucket keeps its minimum and
    its maximum (in their order). The first and last points are always kept; every point returned
    is an input point; a series of at most max_points points is returned unchanged."""
    n = len(x)
    if max_points < 4:
        raise ValueError(f"max_points must be >= 4, got {max_points}")
    if n <= max_points:
        return x, y
    buckets = (max_points - 2) // 2
    inner = np.arange(1, n - 1)
    keep = [0]
    for chunk in np.array_split(inner, buckets):
        seg = y[chunk]
        lo, hi = chunk[int(np.argmin(seg))], chunk[int(np.argmax(seg))]
        keep += [lo, hi] if lo < hi else ([hi, lo] if hi < lo else [lo])
    keep.append(n - 1)
    idx = np.asarray(keep)
    return x[idx], y[idx]
