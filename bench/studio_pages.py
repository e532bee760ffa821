"""Time the studio's pages 2, 4, 5, 6 through their API on a runs directory holding a full
`tether quickstart` (runs/quickstart) and `tether study overoptimization` (runs/overoptimization):

    OMP_NUM_THREADS=1 .venv/bin/python bench/studio_pages.py runs

Prints seconds per request (a job's from its POST to its result), and the numbers it answered."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from studio_support import client, make_app  # noqa: E402


def main(runs: str) -> None:
    c = client(make_app(runs))

    def wait(url):
        while True:
            j = c.get(url).json()
            if j["state"] in ("done", "error"):
                return j
            time.sleep(0.02)

    q = c.get("/api/stages/sources").json()["quickstarts"][0]
    body = {"checkpoints": [s["checkpoint"] for s in q["stages"]], "labels": [s["stage"] for s in q["stages"]],
            "run": q["run"], "count": 20}
    for label in ("first", "cached"):
        t = time.time()
        j = wait("/api/stages/job/" + c.post("/api/stages/answer", json=body).json()["id"])
        print(f"stages: {len(body['checkpoints'])} stages x 20 problems ({label}) {time.time() - t:.2f} s",
              [(p["stage"], p["accuracy"]) for p in j["partial"]])
    sft = next(s["checkpoint"] for s in q["stages"] if s["stage"] == "sft")
    for label in ("first", "again"):
        t = time.time()
        j = wait("/api/grpo/job/" + c.post("/api/grpo/sample", json={
            "checkpoint": sft, "prompt": "What is 49 + 1?", "answer": "50", "n": 8}).json()["id"])
        print(f"grpo: live group of 8 ({label}) {time.time() - t:.2f} s, rewards {j['result']['rewards']}")
    t = time.time()
    for _ in range(20):
        c.post("/api/grpo/advantages", json={"rewards": [1, 0] * 16})
    print(f"grpo: advantages of a group of 32 {(time.time() - t) / 20 * 1000:.1f} ms")
    t = time.time()
    for _ in range(5):
        c.post("/api/algorithms/explore", json={"size": "70B", "algo": "ppo", "gpus": 8})
    print(f"algorithms: estimate + bars + cards {(time.time() - t) / 5 * 1000:.1f} ms")
    for what, url in (("study", "/api/hacking/study"), ("samples", "/api/hacking/samples")):
        t = time.time()
        c.get(url, params={"run": "overoptimization"})
        print(f"hacking: {what} {(time.time() - t) * 1000:.1f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="?", default="runs", help="the runs directory (default: runs)")
    main(ap.parse_args().runs)
