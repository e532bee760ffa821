"""Runs the studio's pages 2, 4, 6 need (training stages, GRPO explorer, reward hacking), built
once per test session and shared by the API and browser tests through the session's base
temporary directory.

* a quickstart shrunk to ~10 s (level 1, a 64-wide 2-layer model, 150 + 100 + 4 steps): real
  pretrain / sft / rl run directories and checkpoints, SFT answering a few problems right;
* an over-optimization study shrunk to ~15 s: its world's SFT policy is pre-placed untrained at
  <study>/world/policy (build_sft_policy reuses a policy that is there), 100 pairs, β ∈ {0.001,
  0.5}, 4 PPO steps each, best-of-4.

TETHER_STUDIO_PAGES_RUNS=<dir> uses the runs under <dir> instead (a real `tether quickstart`
and `tether study overoptimization`: how the README's screenshots were made; the tests assert
the same things on them).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

QUICKSTART_ARGS = dict(level=1, n_train=2000, n_test=30, hidden_size=64, num_layers=2, pretrain_steps=150,
                       sft_steps=100, sft_eval_every=0, rl_steps=4, rl_prompts=50, batch_size=16, progress=False)
STUDY_ARGS = dict(n_pairs=100, betas=[0.001, 0.5], ppo_steps=4, ppo_batch_size=8, bon_max_n=4, rm_epochs=1)


def _once(base: Path, name: str, build) -> Path:
    """base/name built by build(path) once per session (a lock: xdist workers or two modules)."""
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = base / f".{name}.done"
        if not done.exists():
            shutil.rmtree(base / name, ignore_errors=True)
            build(base / name)
            done.write_text("ok")
    return base / name


def quickstart_runs(tmp_path_factory) -> Path:
    """A runs directory holding `quickstart/` (the tiny quickstart, or the real one)."""
    if os.environ.get("TETHER_STUDIO_PAGES_RUNS"):
        return Path(os.environ["TETHER_STUDIO_PAGES_RUNS"])

    def build(runs: Path):
        from tether.quickstart import QuickstartConfig, run_quickstart
        run_quickstart(QuickstartConfig(runs_dir=str(runs), **QUICKSTART_ARGS))

    return _once(tmp_path_factory.getbasetemp() / "studio-pages", "quickstart-runs", build)


def study_runs(tmp_path_factory) -> Path:
    """A runs directory holding `overoptimization/` (the tiny study, or the real one)."""
    if os.environ.get("TETHER_STUDIO_PAGES_RUNS"):
        return Path(os.environ["TETHER_STUDIO_PAGES_RUNS"])

    def build(runs: Path):
        import torch
        from transformers import AutoModelForCausalLM

        from tether.models.tiny import tiny_config
        from tether.studies.overoptimization import OveroptimizationConfig, run_overoptimization
        from tether.tasks.preference_world import PreferenceWorld

        tok = PreferenceWorld(seed=0).tokenizer()
        cfg = tiny_config(len(tok), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                          max_position_embeddings=64, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg)
        for k in ("pad_token_id", "eos_token_id", "bos_token_id"):
            setattr(model.generation_config, k, getattr(tok, k))
        policy = runs / "overoptimization" / "world" / "policy"
        model.save_pretrained(policy)
        tok.save_pretrained(policy)
        run_overoptimization(OveroptimizationConfig(name="overoptimization", runs_dir=str(runs), **STUDY_ARGS))

    return _once(tmp_path_factory.getbasetemp() / "studio-pages", "study-runs", build)


def copy_study_unfinished(study: Path, dest: Path, keep_steps: int) -> Path:
    """A copy of a finished study as it looked mid-run: no summary.json, and the last β's PPO
    metrics cut to its first `keep_steps` rows (the progress a page must show)."""
    shutil.copytree(study, dest, ignore=shutil.ignore_patterns("checkpoints", ".lock"))
    (dest / "summary.json").unlink()
    betas = json.loads((study / "summary.json").read_text())["ppo"]
    last = dest / f"ppo_beta{list(betas)[-1]}" / "metrics.jsonl"
    last.write_text("".join(last.read_text().splitlines(keepends=True)[:keep_steps]))
    return dest
