"""Diagnostic: where partial rollouts' sampling time goes (not a benchmark: no RESULTS row by itself).

Session 21 on an H200 (SmolLM2, 16 prompts × 16, 384 new tokens): a partial round of at most 96
new tokens took 1.0–1.3 s of sampling, while a whole synchronous rollout took 0.785 s early and
0.28 s late in the run. This replays both with constant weights (no training) on the same prompts
and prints, per step and per sampler call, what the sampler's own stats say: rows, the widest
context, prefill / decode / graph-capture seconds and decode steps.

    python bench/partial_profile.py --model /tmp/smollm2 --data /tmp/arith --device cuda --json OUT.json
    python bench/partial_profile.py --tiny --steps 4          # this CPU: does it run

Modes (each on a fresh Sampler, the same prompt order): `sync` (one call, n=G, as the loop samples)
and `partial` (tether.trainers.online_partial.PartialRollouts at --partial-tokens a round: a call
for the new rows and one for the carried rows). The last step of each is printed as a table; the
JSON holds every call.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tether.config import load_config  # noqa: E402
from tether.models import load_model, load_tokenizer, make_tiny_model  # noqa: E402
from tether.rollout import Sampler  # noqa: E402
from tether.trainers.online import GRPOConfig  # noqa: E402
from tether.trainers.online_partial import PartialRollouts  # noqa: E402
from tether.trainers.setup import load_prompt_data  # noqa: E402

KEYS = ("prefill_s", "decode_s", "capture_s", "total_s", "decode_steps", "tokens")


class Recorder:
    """Wraps Sampler.sample: each call's rows, widest prompt (context) and stats, under a label."""

    def __init__(self, sampler):
        self.sampler, self.calls, self.step = sampler, [], None
        real = sampler.sample

        def sample(prompts, n=1, **kw):
            t0 = time.perf_counter()
            ro = real(prompts, n=n, **kw)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.calls.append({"step": self.step, "rows": len(prompts) * n,
                               "context": max(len(p) for p in prompts), "wall_s": time.perf_counter() - t0,
                               **{k: ro.stats.get(k, 0) for k in KEYS}})
            return ro
        sampler.sample = sample


def tiny_setup(work: Path):
    """A tiny random model and arithmetic-like prompts (CPU smoke run)."""
    make_tiny_model(work / "model")
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(work / "model"), str(work / "train.jsonl")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a causal LM directory (the runs' /tmp/smollm2)")
    ap.add_argument("--data", help="bench/real_model_data.py's folder (its train.jsonl)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model on this CPU instead")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=16, help="prompts a step (data.batch_size)")
    ap.add_argument("--generations", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--partial-tokens", type=int, default=96)
    ap.add_argument("--set", action="append", default=[], help="more GRPO config overrides, key=value")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="partial-profile-"))
    model_path, data_path = tiny_setup(work) if a.tiny else (a.model, f"{a.data}/train.jsonl")
    if a.tiny:
        a.max_new_tokens, a.partial_tokens, a.batch, a.generations = min(a.max_new_tokens, 24), \
            min(a.partial_tokens, 8), min(a.batch, 4), min(a.generations, 4)
    cfg = load_config(GRPOConfig, overrides=[
        f"model.path={model_path}", f"data.path={data_path}", f"data.batch_size={a.batch}",
        f"rollout.num_generations={a.generations}", f"rollout.max_new_tokens={a.max_new_tokens}",
        "queue.partial=true", f"queue.partial_tokens={a.partial_tokens}", f"model.device={a.device}", *a.set])
    tok = load_tokenizer(model_path)
    dtype = "bf16" if a.device == "cuda" else "fp32"  # as the bf16 sampling copy
    model = load_model(model_path, dtype=dtype, device=a.device).eval()
    rows = load_prompt_data(cfg, tok).train
    out = {}
    for mode in ("sync", "partial"):
        order = iter(rows[i % len(rows)] for i in range(10 ** 9))
        next_prompts = lambda: ([next(order) for _ in range(a.batch)], None)  # noqa: E731
        rec = Recorder(Sampler(model, tok, cfg.rollout.sampling()))
        produce = PartialRollouts(next_prompts, lambda r, ro: (torch.zeros(len(ro), 1), torch.zeros(len(ro))),
                                  cfg, start=0) if mode == "partial" else None
        steps = []
        for step in range(a.steps):
            rec.step, t0 = step, time.perf_counter()
            if produce is None:
                batch, _ = next_prompts()
                ro = rec.sampler.sample([r["prompt_ids"] for r in batch], n=a.generations,
                                        seed=cfg.run.seed * 1_000_003 + step)
                trained = ro.completion_mask.sum(1)
                info = {}
            else:
                b = produce(step, rec.sampler)
                trained = b.rollout.completion_mask.sum(1)
                info = dict(b.metrics)
                info["in_flight"] = len(produce.pool)
            steps.append({"step": step, "seconds": time.perf_counter() - t0, "rows_trained": len(trained),
                          "mean_length": float(trained.float().mean()), "max_length": int(trained.max()), **info})
            calls = [c for c in rec.calls if c["step"] == step]
            print(f"{mode} step {step}: {steps[-1]['seconds']:.3f} s, {len(calls)} calls: " + "; ".join(
                f"{c['rows']} rows ctx {c['context']} prefill {c['prefill_s']:.3f} decode {c['decode_s']:.3f} "
                f"({c['decode_steps']} steps) capture {c['capture_s']:.3f}" for c in calls), flush=True)
        out[mode] = {"steps": steps, "calls": rec.calls}
        later = [s["seconds"] for s in steps[2:]] or [s["seconds"] for s in steps]
        print(f"== {mode}: median step {statistics.median(later):.3f} s (steps 2+)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), **out}, indent=1))


if __name__ == "__main__":
    main()
