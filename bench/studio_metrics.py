"""How long the studio takes to load a big run: a metrics.jsonl of N lines (default 100,000) with
the ~30 metrics a GRPO step logs, through the Runs API (cold: first read parses the whole file;
warm: the incremental reader has it; append: one more line) and, with --browser, in Chromium from
the click on the run to the reward curve drawn.

    OMP_NUM_THREADS=1 .venv/bin/python bench/studio_metrics.py [--lines 100000] [--browser]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from studio_support import client, make_app  # noqa: E402

METRICS = ["reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
           "completions/max_length", "completions/clipped_ratio", "kl", "pg_loss", "clip_ratio/low_mean",
           "clip_ratio/high_mean", "clip_ratio/region_mean", "approx_kl", "ratio/mean", "loss", "grad_norm", "lr",
           "entropy", "step_time", "tokens_per_second", "rollout/tokens_per_second", "rollout/seconds",
           "rewards/verifier/mean", "rewards/format/mean", "epoch", "num_sampling_rounds", "frac_skipped",
           "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max", "skipped_steps"]


def write_run(root: Path, n: int) -> Path:
    d = root / "big"
    d.mkdir(parents=True)
    rng = np.random.default_rng(0)
    vals = rng.normal(size=(n, len(METRICS)))
    with open(d / "metrics.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"step": i + 1, "time": i * 0.1, **dict(zip(METRICS, vals[i].tolist()))}) + "\n")
    return d


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--browser", action="store_true")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp()) / "runs"
    d = write_run(root, args.lines)
    print(f"metrics.jsonl: {args.lines} lines, {(d / 'metrics.jsonl').stat().st_size / 1e6:.1f} MB")
    app = make_app(root)
    c = client(app)
    c.get("/api/pages")
    t = time.perf_counter()
    r = c.get("/api/runs/metrics", params={"run": "big"})
    first = time.perf_counter() - t
    preview = r.json()
    while r.json().get("loading"):  # answered at once; the whole file is read in the background
        time.sleep(0.05)
        r = c.get("/api/runs/metrics", params={"run": "big"})
    cold = time.perf_counter() - t
    t = time.perf_counter()
    r2 = c.get("/api/runs/metrics", params={"run": "big", "smooth": 0.9})
    warm = time.perf_counter() - t
    with open(d / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": args.lines + 1, "reward": 1.0}) + "\n")
    t = time.perf_counter()
    c.get("/api/runs/metrics", params={"run": "big", "names": "reward"})
    append = time.perf_counter() - t
    t = time.perf_counter()
    c.get("/api/runs/list")
    listing = time.perf_counter() - t
    print(f"API first answer ('loading', with a preview of {len(preview['metrics'])} curves of "
          f"{len(preview['metrics']['reward']['x']) if preview.get('metrics') else 0} rows spread over the file): {first:.3f} s")
    print(f"API all {len(r.json()['metrics'])} metrics, cold (parse whole file): {cold:.3f} s, "
          f"{len(r.content) / 1e3:.0f} kB sent ({len(r.json()['metrics']['reward']['x'])} points per curve)")
    print(f"API warm, smoothing 0.9: {warm:.3f} s ({len(r2.content) / 1e3:.0f} kB); one line appended, "
          f"reward only: {append:.3f} s; runs list: {listing:.3f} s")
    if args.browser:
        from playwright.sync_api import sync_playwright

        from studio_support import CHROMIUM, CHROMIUM_FLAGS, serve
        app = make_app(root)  # cold again: a fresh app has read nothing
        with serve(app) as url, sync_playwright() as p:
            b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
            page = b.new_page()
            page.goto(url + "/runs")
            page.wait_for_selector("tr[data-id='big']")
            t = time.perf_counter()  # at once: the page says it is reading, then draws
            page.click("tr[data-id='big'] td[data-key=id]")
            page.wait_for_selector(".chart-box[data-metric=reward] path.series", timeout=300_000)
            print(f"browser, cold: click -> curves drawn (the preview while the file is read): {time.perf_counter() - t:.3f} s")
            page.wait_for_selector("#loading", state="detached", timeout=300_000)
            print(f"browser, cold: click -> the whole file's curves (its first read included): {time.perf_counter() - t:.3f} s")
            page.reload()
            page.wait_for_selector("tr[data-id='big']")
            t = time.perf_counter()
            page.click("tr[data-id='big'] td[data-key=id]")
            page.wait_for_selector(".chart-box[data-metric=reward] path.series")
            print(f"browser, warm (page reloaded): click -> reward, kl, loss, lr, grad_norm, entropy curves drawn: "
                  f"{time.perf_counter() - t:.3f} s")
            b.close()


if __name__ == "__main__":
    main()
