"""`tether study frontier`: the reward–KL frontier of the offline preference family vs PPO.

The DPO paper's Figure 2 analogue, measured against a *known* gold reward
(tether.tasks.preference_world): from the same SFT policy and the same labelled pairs,
DPO, cDPO, rDPO, IPO, hinge, KTO (the pairs split into unpaired rows), SimPO and ORPO are trained
over a β sweep; each trained policy is sampled on held-out prompts and scored with the gold reward,
its KL to the SFT policy estimated on its own samples, and its gold win-rate against SFT samples
measured. PPO's points are the over-optimization study's PPO checkpoints (every quarter of each β
run), evaluated the same way; the study runs that first when its summary is missing (or, with
`ppo_points`, they are read from an earlier frontier summary). The online family (`tether odpo`)
samples its own pairs from the policy as it trains: online DPO (reference fixed, one DPO step per
round of fresh pairs) and iterative DPO (reference reset to the policy each round, several epochs
per round), each labelled by the gold reward and by the proxy RM PPO optimizes.
Outputs: runs/<name>/summary.json, report.md (the table), plots/frontier.png.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from tether.config import ConfigError, check_values
from tether.constraints import DirPath, Positive, PositiveInt, Seed
from tether.run import RunDir
from tether.studies.lab import evaluate_policy, prepare_world

# method label -> OfflineConfig fields (β comes from the sweep)
METHODS: dict[str, dict] = {
    "DPO": {"method": "dpo", "loss": "sigmoid"},
    "cDPO": {"method": "dpo", "loss": "sigmoid", "label_smoothing": 0.1},
    "rDPO": {"method": "dpo", "loss": "robust", "label_smoothing": 0.1},
    "IPO": {"method": "dpo", "loss": "ipo"},
    "hinge": {"method": "dpo", "loss": "hinge"},
    "KTO": {"method": "kto"},
    "SimPO": {"method": "simpo"},
    "ORPO": {"method": "orpo"},
}
# online method label -> ODPOConfig fields: the same 4000 sampled pairs as the offline runs' 4000
# labelled ones (k = online_k completions per prompt, the best vs the worst: one pair per prompt)
ONLINE: dict[str, dict] = {
    "online-DPO": {"reference": "fixed", "dpo_epochs": 1, "batch_size": 32, "max_steps": 125},
    "iterative-DPO": {"reference": "reset", "dpo_epochs": 2, "batch_size": 1000, "pairs_per_step": 32,
                      "max_steps": 4},
}
LABELLERS = ("gold", "proxy")


@dataclass
class FrontierConfig:
    name: str = "frontier"
    "run name: everything is written to <runs_dir>/<name>/"
    runs_dir: DirPath = "runs"
    "parent directory of run directories"
    overoptimization: str = "overoptimization"
    "run name of the over-optimization study whose world, pairs and PPO checkpoints are reused"
    seed: Seed = 0
    "seed of the world and of every training run"
    n_pairs: PositiveInt = 4000
    "preference pairs (the same as the over-optimization study's, so the data are shared)"
    methods: list[Literal[tuple(METHODS)]] = field(default_factory=lambda: list(METHODS))
    "methods to train (DPO, cDPO, rDPO, IPO, hinge, KTO, SimPO, ORPO)"
    betas: list[Positive] = field(default_factory=lambda: [0.1, 0.3, 1.0])
    "β sweep for the reference-based methods (DPO family, KTO)"
    simpo_betas: list[Positive] = field(default_factory=lambda: [2.5, 5.0, 10.0])
    "β sweep for SimPO (its reward scale; γ = 0.5 β)"
    orpo_lambdas: list[Positive] = field(default_factory=lambda: [0.1, 0.5, 2.0])
    "λ sweep for ORPO (weight of the odds-ratio term)"
    online: list[Literal[tuple(ONLINE)]] = field(default_factory=lambda: list(ONLINE))
    "online methods (tether odpo): online-DPO (reference fixed, 125 rounds of 32 prompts, one step each), iterative-DPO (reference reset, 4 rounds of 1000 prompts, 2 epochs)"
    labellers: list[Literal[LABELLERS]] = field(default_factory=lambda: list(LABELLERS))
    "who ranks the online methods' samples: the gold reward, the proxy RM (the over-optimization study's, rm:...)"
    online_betas: list[Positive] = field(default_factory=lambda: [0.1, 0.3])
    "β sweep of the online methods"
    online_k: PositiveInt = 4
    "completions per prompt the online methods sample (a pair = the best and the worst)"
    ppo_points: str = ""
    "an earlier frontier summary.json (e.g. benchmarks/frontier/summary.json) whose PPO points are reused instead of evaluating the over-optimization study's checkpoints; the hour-long study is then not run (its world, pairs and proxy RM are still built)"
    epochs: Positive = 1.0
    "passes over the pairs per run"
    batch_size: PositiveInt = 32
    "pairs per step"
    lr: Positive = 1e-4
    "learning rate of every offline run (tiny model: above the 1e-6 used for real models; 1e-3 diverges)"
    eval_samples: PositiveInt = 16
    "completions sampled per held-out prompt to measure gold reward and KL"
    publish_dir: str = ""
    "also copy the figure and report here (e.g. benchmarks/frontier)"
    progress: bool = False
    "progress bars of the inner trainers"

    def __post_init__(self):
        # Checked here, before the over-optimization study (an hour on CPU) runs as a prerequisite.
        check_values(self)
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ConfigError(f"config key 'methods': unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
        if self.online and not (self.labellers and self.online_betas):
            raise ConfigError("config keys 'labellers' and 'online_betas' must be non-empty when 'online' names a method")
        if self.online_k < 2:
            raise ConfigError("config key 'online_k' must be >= 2: a pair is the best and the worst of k")
        if not self.methods:
            raise ConfigError("config key 'methods' must name at least one method")
        for label in self.methods:
            key = {"SimPO": "simpo_betas", "ORPO": "orpo_lambdas"}.get(label, "betas")
            if not getattr(self, key):
                raise ConfigError(f"config key '{key}' is empty, but method {label} sweeps it")


def _sweep(cfg: FrontierConfig, label: str) -> list[float]:
    return cfg.simpo_betas if label == "SimPO" else cfg.orpo_lambdas if label == "ORPO" else cfg.betas


def _ppo_points(cfg: FrontierConfig, over_root: Path, world, policy, prompts) -> list[dict]:
    if cfg.ppo_points:  # measured by an earlier run of this study on the same world (same seed)
        return [p for p in json.loads(Path(cfg.ppo_points).read_text())["points"] if p["method"] == "PPO"]
    pts = []
    for run in sorted(over_root.glob("ppo_beta*")):
        for ck in sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:])):
            ev = evaluate_policy(ck, policy, world, prompts, n=cfg.eval_samples, seed=cfg.seed + 11)
            pts.append({"method": "PPO", "beta": float(run.name[len("ppo_beta"):]), "step": int(ck.name[5:]),
                        **{k: v for k, v in ev.items() if k != "samples"}})
    return pts


def _proxy_rm(cfg: FrontierConfig, over_root: Path, lab: dict) -> str:
    """The proxy RM PPO optimized (the over-optimization study's), trained here as that study
    trains it when the study has not run (ppo_points)."""
    from tether.studies.overoptimization import train_proxy_rm
    if (over_root / "summary.json").exists():
        return json.loads((over_root / "summary.json").read_text())["rm"]["model"]
    if (over_root / "rm" / "summary.json").exists():
        return json.loads((over_root / "rm" / "summary.json").read_text())["checkpoint"]
    return train_proxy_rm(over_root, lab["policy"], lab["train_pairs"], cfg.seed, progress=cfg.progress)["checkpoint"]


def _online_points(cfg: FrontierConfig, root: Path, over_root: Path, lab: dict, world, prompts) -> list[dict]:
    """`tether odpo` from the SFT policy per online method × labeller × β, evaluated as every point."""
    from tether.trainers.preference.online import ODPOConfig, train_odpo
    if not cfg.online:
        return []
    data = root / "data" / "prompts.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in world.prompts(None, "train")))
    specs = {"gold": "tether.tasks.preference_world:gold_reward"}
    if "proxy" in cfg.labellers:
        specs["proxy"] = f"rm:{_proxy_rm(cfg, over_root, lab)}"
    pts = []
    for label in cfg.online:
        for labeller in cfg.labellers:
            for beta in cfg.online_betas:
                started = time.time()
                out = train_odpo(ODPOConfig(
                    **ONLINE[label], beta=beta, model=str(lab["policy"]), data=str(data),
                    reward_funcs=[specs[labeller]], num_generations=cfg.online_k,
                    max_new_tokens=world.max_new_tokens, name=f"{label}_{labeller}_b{beta:g}", runs_dir=str(root),
                    lr=cfg.lr, device="cpu", seed=cfg.seed, log_every=max(1, ONLINE[label]["max_steps"] // 25),
                    progress=cfg.progress, overwrite=True))
                ev = evaluate_policy(out["model"], lab["policy"], world, prompts, n=cfg.eval_samples,
                                     seed=cfg.seed + 11)
                pts.append({"method": f"{label} ({labeller})", "beta": beta,
                            "seconds": round(time.time() - started, 1),
                            **{k: v for k, v in ev.items() if k != "samples"}})
    return pts


def upper_envelope(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The frontier: points (kl, gold) not dominated (lower or equal KL with higher gold), by KL."""
    out, best = [], -np.inf
    for kl, g in sorted(points):
        if g > best:
            out.append((kl, g))
            best = g
    return out


def frontier_gold_at(env: list[tuple[float, float]], kl: float) -> float:
    """PPO's gold at this KL: linear interpolation along the upper envelope (which starts at the
    SFT policy, KL 0). The true curve is concave between measured points, so this slightly
    *under*-states PPO there; beyond the last point the envelope stays flat (nan before the first)."""
    if not env or kl < env[0][0]:
        return float("nan")
    for (k0, g0), (k1, g1) in zip(env, env[1:]):
        if k0 <= kl <= k1:
            return g0 + (g1 - g0) * (kl - k0) / (k1 - k0) if k1 > k0 else max(g0, g1)
    return env[-1][1]


def run_frontier(cfg: FrontierConfig) -> dict:
    from tether.studies.overoptimization import OveroptimizationConfig, run_overoptimization
    from tether.tasks.preference_world import PreferenceWorld
    from tether.trainers.preference.offline import OfflineConfig, train_offline

    t0 = time.time()
    root = Path(cfg.runs_dir) / cfg.name
    over_root = Path(cfg.runs_dir) / cfg.overoptimization
    if not cfg.ppo_points and not (over_root / "summary.json").exists():
        run_overoptimization(OveroptimizationConfig(name=cfg.overoptimization, runs_dir=cfg.runs_dir,
                                                    seed=cfg.seed, n_pairs=cfg.n_pairs, progress=cfg.progress))
    run = RunDir(root, overwrite=True)  # regenerated from its seed, sub-runs too (as overoptimization)
    run.write_config(cfg)
    world = PreferenceWorld(seed=cfg.seed)
    lab = prepare_world(over_root, world, cfg.seed, cfg.n_pairs)
    policy = lab["policy"]
    prompts = world.prompts(None, "test")

    sft = evaluate_policy(policy, policy, world, prompts, n=cfg.eval_samples, seed=cfg.seed + 11)
    points = [{"method": "SFT", "beta": None, **{k: v for k, v in sft.items() if k != "samples"}}]
    for label in cfg.methods:  # names checked by FrontierConfig, before anything ran
        for beta in _sweep(cfg, label):
            name = f"{label}_b{beta:g}"
            out = train_offline(OfflineConfig(
                **METHODS[label], beta=beta, model=str(policy), data=str(lab["train_pairs"]),
                eval_data=str(lab["test_pairs"]), name=name, runs_dir=str(root), max_length=64,
                batch_size=cfg.batch_size, epochs=cfg.epochs, lr=cfg.lr, warmup_ratio=0.1,
                device="cpu", seed=cfg.seed, log_every=20, progress=cfg.progress, overwrite=True))
            ev = evaluate_policy(out["model"], policy, world, prompts, n=cfg.eval_samples, seed=cfg.seed + 11)
            points.append({"method": label, "beta": beta,
                           "implicit_accuracy": out.get("eval/rewards/accuracies"),
                           **{k: v for k, v in ev.items() if k != "samples"}})
    points += _online_points(cfg, root, over_root, lab, world, prompts)
    points += _ppo_points(cfg, over_root, world, policy, prompts)

    # Frontier comparison at matched KL: each method's best gold vs the best PPO gold within
    # the same KL (a method "matches PPO" when its envelope is at least PPO's at its own KLs).
    ppo_env = upper_envelope([(0.0, sft["gold"])] + [(p["kl"], p["gold"]) for p in points if p["method"] == "PPO"])
    by_method = {}
    for label in [*cfg.methods, *[f"{m} ({lab_})" for m in cfg.online for lab_ in cfg.labellers], "PPO"]:
        mine = [p for p in points if p["method"] == label]
        if not mine:
            continue
        best = max(mine, key=lambda p: p["gold"])
        by_method[label] = {
            "best_gold": best["gold"], "best_beta": best["beta"], "kl_at_best": best["kl"],
            "win_rate_at_best": best["win_rate"], "gold_gain_over_sft": best["gold"] - sft["gold"],
            "ppo_gold_at_same_kl": frontier_gold_at(ppo_env, best["kl"]),
            # at least one of the method's points on or above PPO's frontier at its own KL
            "matches_ppo_at_matched_kl": any(p["gold"] >= frontier_gold_at(ppo_env, p["kl"]) for p in mine),
            "implicit_accuracy": [p.get("implicit_accuracy") for p in mine],
            **({"seconds": sum(p["seconds"] for p in mine)} if all("seconds" in p for p in mine) else {}),
            "raises_gold_every_beta": all(p["gold"] > sft["gold"] for p in mine)}
    summary = {"sft": {k: v for k, v in sft.items() if k != "samples"}, "points": points,
               "methods": by_method, "seconds": round(time.time() - t0, 1)}
    run.write_summary(summary)
    _plot(root / "plots" / "frontier.png", points, sft)
    report = _report(cfg, summary)
    (root / "report.md").write_text(report)
    if cfg.publish_dir:
        pub = Path(cfg.publish_dir)
        pub.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / "plots" / "frontier.png", pub / "frontier.png")
        (pub / "README.md").write_text(report)
        (pub / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    run.close()
    return summary


def _plot(path: Path, points: list[dict], sft: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    labels = [m for m in dict.fromkeys(p["method"] for p in points) if m != "SFT"]
    markers = "osD^v<>Xp*"
    for k, label in enumerate(labels):
        pts = sorted((p["kl"], p["gold"]) for p in points if p["method"] == label)
        if label == "PPO":  # checkpoints of several β runs: points, and their upper envelope
            ax.plot(*zip(*pts), "kx", ms=5, label="PPO checkpoints")
            env = upper_envelope([(0.0, sft["gold"])] + pts)
            ax.plot(*zip(*env), "k--", lw=1, label="PPO frontier")
        else:
            online = "(" in label  # the online family: bigger, bolder, colours of their own
            ax.plot(*zip(*pts), markers[k % len(markers)] + "-", ms=8 if online else 5, lw=1.6 if online else 0.8,
                    label=label, alpha=0.85, color=plt.cm.tab20(k % 20))
    # Zoom on the region the offline methods reach; very-low-β PPO runs far beyond it (listed in the table).
    offline_kl = [p["kl"] for p in points if p["method"] not in ("PPO", "SFT")]
    if offline_kl:
        right = max(6.0, 1.5 * max(offline_kl))
        ax.set_xlim(-0.2, right)
        shown = [p["gold"] for p in points if p["kl"] <= right]
        ax.set_ylim(min(shown) - 0.3, max(shown) + 0.3)
    ax.scatter([sft["kl"]], [sft["gold"]], marker="*", s=120, color="grey", label="SFT", zorder=5)
    ax.set(xlabel="KL(π ‖ π_SFT) per completion (nats)", ylabel="gold reward (held-out prompts)",
           title="Reward–KL frontier on the gold-reward world")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _report(cfg: FrontierConfig, s: dict) -> str:
    sft = s["sft"]
    lines = ["# Reward–KL frontier: offline and online preference methods vs PPO (gold-reward world)", "",
             f"Regenerate: `tether study frontier publish_dir=benchmarks/frontier"
             f"{' ppo_points=' + cfg.ppo_points if cfg.ppo_points else ''}` (seed {cfg.seed}; "
             f"{s['seconds']:.0f} s on this machine, reusing the over-optimization study's world and PPO runs"
             + (f"; PPO points read from {cfg.ppo_points}" if cfg.ppo_points else "") + ").", "",
             "Online methods (`tether odpo`; labeller in parentheses; a pair = the best and the worst of "
             f"k={cfg.online_k} samples of a prompt): "
             + "; ".join(f"{m} = reference {o['reference']}, {o['max_steps']} rounds of {o['batch_size']} prompts, "
                         f"{o['dpo_epochs']} epoch(s) of {o.get('pairs_per_step') or 'all'}-pair steps per round"
                         for m, o in ONLINE.items() if m in cfg.online) + ".", "",
             f"SFT policy: gold {sft['gold']:.3f}, length {sft['length']:.1f} words.", "",
             "| method | best β | gold | gain over SFT | win-rate vs SFT | KL | PPO gold at same KL | "
             "a point on/above PPO's frontier | gold > SFT at every β | held-out implicit-reward accuracy (per β) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, m in s["methods"].items():
        acc = ", ".join("–" if a is None else f"{a:.3f}" for a in m["implicit_accuracy"])
        lines.append(f"| {label} | {m['best_beta']} | {m['best_gold']:.3f} | {m['gold_gain_over_sft']:+.3f} | "
                     f"{m['win_rate_at_best']:.3f} | {m['kl_at_best']:.2f} | {m['ppo_gold_at_same_kl']:.3f} | "
                     f"{'yes' if m['matches_ppo_at_matched_kl'] else 'no'} | "
                     f"{'yes' if m['raises_gold_every_beta'] else 'no'} | {acc} |")
    lines += ["", "All points (method, β, KL, gold, win-rate):", "",
              "| method | β | step | KL | gold | win-rate | length |", "|---|---|---|---|---|---|---|"]
    for p in s["points"]:
        lines.append(f"| {p['method']} | {p.get('beta')} | {p.get('step', '')} | {p['kl']:.2f} | {p['gold']:.3f} | "
                     f"{p['win_rate']:.3f} | {p['length']:.1f} |")
    lines += ["", "Figure: frontier.png.", ""]
    return "\n".join(lines)
