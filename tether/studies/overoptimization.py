"""`tether study overoptimization`: reward over-optimization measured against a known gold reward.

The experiment of Gao, Schulman & Hilton (2023), "Scaling laws for reward model
overoptimization", shrunk to a world where the truth is known (tether.tasks.preference_world):
    1. an SFT policy for the world (the "human writer" imitated by a tiny LM);
    2. N preference pairs sampled from it, labelled by Bradley–Terry draws from the gold reward;
    3. a proxy reward model trained on them (held-out accuracy vs the exact Bayes-optimal one);
    4. PPO against the proxy for several KL coefficients β, gold and proxy logged every step;
    5. best-of-n against the proxy for n = 1…256 (exact order-statistics average over 256 samples);
    6. gold and proxy gain plotted against d = √KL, with the fitted forms
       BoN: R(d) = d(α − βd),   RL: R(d) = d(α − β log d),   and their R².
Everything lands in runs/<name>/ (summary.json, report.md, plots/); `publish_dir` also copies the
figures and the report there (benchmarks/ in the repository).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tether.config import ConfigError, check_values
from tether.constraints import DirPath, NonNegative, Positive, PositiveInt, Seed
from tether.run import RunDir, read_jsonl
from tether.studies.lab import best_of_n_curve, fit_bon, fit_rl, plot_gold_proxy, prepare_world


@dataclass
class OveroptimizationConfig:
    name: str = "overoptimization"
    "run name: everything is written to <runs_dir>/<name>/"
    runs_dir: DirPath = "runs"
    "parent directory of run directories"
    seed: Seed = 0
    "seed of the world, the SFT policy, the pairs, the RM and PPO"
    label_temperature: Positive = 1.0
    "τ of the Bradley–Terry labels drawn from the gold reward"
    n_pairs: PositiveInt = 4000
    "preference pairs the proxy reward model is trained on"
    rm_epochs: Positive = 2.0
    "reward-model training epochs over the pairs"
    rm_lr: Positive = 1e-3
    "reward-model learning rate (tiny model: far above the 1e-5 used for real models)"
    betas: list[NonNegative] = field(default_factory=lambda: [0.001, 0.02, 0.05, 0.1, 0.5])
    "PPO KL coefficients to sweep (the first should be very low)"
    ppo_steps: PositiveInt = 60
    "PPO steps per β"
    ppo_batch_size: PositiveInt = 64
    "prompts per PPO step"
    ppo_lr: Positive = 1e-3
    "PPO learning rate (policy and value)"
    bon_max_n: PositiveInt = 256
    "largest n of best-of-n (samples drawn per held-out prompt)"
    publish_dir: str = ""
    "also copy the figures and report.md here (e.g. benchmarks/overoptimization)"
    progress: bool = False
    "progress bars of the inner trainers"

    def __post_init__(self):
        check_values(self)  # the ranges above, for Python callers too (the CLI checks them as it reads)
        if not self.betas:
            raise ConfigError("config key 'betas' must list at least one β")


def _smooth(x: np.ndarray, w: int = 5) -> np.ndarray:
    if len(x) < w:
        return x
    k = np.ones(w) / w
    pad = np.concatenate([np.full(w // 2, x[0]), x, np.full(w - 1 - w // 2, x[-1])])
    return np.convolve(pad, k, mode="valid")


def pair_accuracy(reward, rows: list[dict]) -> float:
    """Share of pairs the reward orders as labelled (ties count half)."""
    prompts = [r["prompt"] for r in rows]
    c = np.array(reward(prompts, [r["chosen"] for r in rows]))
    r = np.array(reward(prompts, [r["rejected"] for r in rows]))
    return float(((c > r) + 0.5 * (c == r)).mean())


def ppo_curve(run_path: Path, gold_key: str, proxy_key: str) -> dict:
    rows = read_jsonl(run_path / "metrics.jsonl")
    kl = np.array([max(r["objective/kl"], 0.0) for r in rows])
    gold = np.array([r[gold_key] for r in rows])
    proxy = np.array([r[proxy_key] for r in rows])
    d = np.sqrt(kl)
    gain_g, gain_p = gold - gold[0], proxy - proxy[0]
    sg, sp = _smooth(gain_g), _smooth(gain_p)
    peak = int(np.argmax(sg))
    return {"d": d.tolist(), "gold": gain_g.tolist(), "proxy": gain_p.tolist(),
            "gold_start": float(gold[0]), "proxy_start": float(proxy[0]),
            "gold_peak_gain": float(sg[peak]), "gold_peak_step": int(rows[peak]["step"]),
            "gold_peak_d": float(_smooth(d)[peak]), "gold_final_gain": float(sg[-1]),
            "proxy_final_gain": float(sp[-1]), "proxy_max_gain": float(sp.max()),
            "final_kl": float(_smooth(kl)[-1]), "fit": fit_rl(d, gain_g), "fit_proxy": fit_rl(d, gain_p)}


def train_proxy_rm(root: Path, policy, train_pairs, seed: int, epochs: float = 2.0, lr: float = 1e-3,
                   progress: bool = False) -> dict:
    """The study's proxy reward model (root/rm), trained on the labelled pairs; the rm summary.
    Held out two ways: 10 % of the pairs (prompts PPO trains on) here, pairs on unseen prompts by
    the caller. The frontier study trains the same one when it runs without this study."""
    from tether.trainers.rm import RMConfig, train_rm
    return train_rm(RMConfig(model=str(policy), data=str(train_pairs), eval_fraction=0.1,
                             name="rm", runs_dir=str(root), epochs=epochs, lr=lr,
                             batch_size=32, device="cpu", seed=seed, progress=progress, overwrite=True))


def run_overoptimization(cfg: OveroptimizationConfig) -> dict:
    from tether.models import load_model, load_tokenizer
    from tether.rewards.learned import LearnedReward
    from tether.studies.world import sample_completions
    from tether.tasks.preference_world import PreferenceWorld
    from tether.trainers.ppo import PPOConfig, train_ppo

    t0 = time.time()
    root = Path(cfg.runs_dir) / cfg.name
    # A study is regenerated from its seed: running it again replaces it, its sub-runs included
    # (overwrite=True below); its config has been validated by now.
    run = RunDir(root, overwrite=True)
    run.write_config(cfg)
    world = PreferenceWorld(seed=cfg.seed, temperature=cfg.label_temperature)
    timings = {}

    # 1-2. SFT policy and labelled pairs (train prompts); held-out pairs on test prompts
    lab = prepare_world(root, world, cfg.seed, cfg.n_pairs)
    policy, train_pairs, test_pairs, bayes = lab["policy"], lab["train_pairs"], lab["test_pairs"], lab["bayes"]
    held = read_jsonl(test_pairs)
    timings["world"] = time.time() - t0

    # 3. proxy reward model
    t = time.time()
    rm = train_proxy_rm(root, policy, train_pairs, cfg.seed, cfg.rm_epochs, cfg.rm_lr, cfg.progress)
    timings["rm"] = time.time() - t
    rm_dir = rm["checkpoint"]
    proxy = LearnedReward(rm_dir, device="cpu")
    unseen = pair_accuracy(proxy, held)

    # 4. PPO against the proxy, gold logged (never optimized)
    prompts = root / "data" / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in world.prompts(None, "train")))

    def gold_reward(prompts, completions, **kw):
        return world.gold_reward(prompts, completions)

    ppo = {}
    t = time.time()
    for beta in cfg.betas:
        name = f"ppo_beta{beta:g}"
        train_ppo(PPOConfig(model=str(policy), data=str(prompts), name=name, runs_dir=str(root),
                            batch_size=cfg.ppo_batch_size, max_new_tokens=world.max_new_tokens,
                            max_steps=cfg.ppo_steps, lr=cfg.ppo_lr, kl_coef=beta, ppo_epochs=2,
                            num_minibatches=2, vf_coef=0.5, device="cpu", seed=cfg.seed,
                            value_model=str(rm_dir), progress=cfg.progress,
                            save_every=max(1, cfg.ppo_steps // 4), keep_last=0, overwrite=True),
                  reward_funcs=[proxy], eval_reward_funcs=[gold_reward])
        ppo[f"{beta:g}"] = ppo_curve(root / name, "eval_rewards/gold_reward/mean", "objective/scores")
    timings["ppo"] = time.time() - t

    # 5. best-of-n on held-out prompts, selected by the proxy
    t = time.time()
    tok = load_tokenizer(str(policy))
    model = load_model(str(policy), dtype="fp32", device="cpu").eval()
    test_prompts = world.prompts(None, "test")
    K = cfg.bon_max_n
    texts = sample_completions(world, model, tok, test_prompts, n=K, seed=cfg.seed + 7)
    ps = [p for p in test_prompts for _ in range(K)]
    proxy_s = np.array(proxy(ps, texts)).reshape(len(test_prompts), K)
    gold_s = np.array(world.gold_reward(ps, texts)).reshape(len(test_prompts), K)
    ns = [n for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if n <= K]
    curve = best_of_n_curve(proxy_s, gold_s, ns)
    d = np.sqrt([curve[n]["kl"] for n in ns])
    gg = np.array([curve[n]["gold"] for n in ns]) - curve[1]["gold"]
    gp = np.array([curve[n]["proxy"] for n in ns]) - curve[1]["proxy"]
    bon = {"n": ns, "d": d.tolist(), "gold": gg.tolist(), "proxy": gp.tolist(),
           "gold_start": curve[1]["gold"], "proxy_start": curve[1]["proxy"],
           "fit_gold": fit_bon(d, gg), "fit_proxy": fit_bon(d, gp)}
    timings["bon"] = time.time() - t

    # 6. figures, report
    plots = root / "plots"
    for b, c in ppo.items():
        plot_gold_proxy(plots / f"ppo_beta{b}.png", {f"PPO β={b}": (c["d"], c["gold"], c["proxy"])},
                        f"PPO β={b}", {f"PPO β={b}": c["fit"]})
    plot_gold_proxy(plots / "ppo_all.png", {f"PPO β={b}": (c["d"], c["gold"], c["proxy"]) for b, c in ppo.items()},
                    "PPO vs proxy RM")
    plot_gold_proxy(plots / "bon.png", {"best-of-n": (bon["d"], bon["gold"], bon["proxy"])},
                    "best-of-n vs proxy RM", {"best-of-n": bon["fit_gold"]})
    summary = {"world": {k: getattr(world, k) for k in world.__dataclass_fields__},
               "rm": {"eval_accuracy": rm.get("eval/accuracy"),
                      "bayes_optimal_accuracy": rm.get("eval/bayes_accuracy"),
                      "unseen_prompts_accuracy": unseen, "unseen_prompts_bayes_optimal_accuracy": bayes,
                      "n_pairs": cfg.n_pairs, "eval_pairs": rm.get("eval_pairs"), "model": str(rm_dir)},
               "ppo": ppo, "bon": bon, "seconds": round(time.time() - t0, 1),
               "timings": {k: round(v, 1) for k, v in timings.items()}}
    run.write_summary(summary)
    report = _report(cfg, summary)
    (root / "report.md").write_text(report)
    if cfg.publish_dir:
        pub = Path(cfg.publish_dir)
        pub.mkdir(parents=True, exist_ok=True)
        for f in ("ppo_all.png", "bon.png", *[f"ppo_beta{b}.png" for b in ppo]):
            shutil.copy(plots / f, pub / f)
        (pub / "README.md").write_text(report)
        (pub / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    run.close()
    return summary


def _report(cfg: OveroptimizationConfig, s: dict) -> str:
    rm = s["rm"]
    lines = ["# Reward over-optimization against a known gold reward", "",
             "Regenerate: `tether study overoptimization publish_dir=benchmarks/overoptimization` "
             f"(seed {cfg.seed}; {s['seconds']:.0f} s on this machine).", "",
             f"Proxy RM on {rm['n_pairs']} pairs: accuracy on {rm['eval_pairs']} held-out pairs "
             f"{rm['eval_accuracy']:.3f} (Bayes-optimal {rm['bayes_optimal_accuracy']:.3f}); on 1000 pairs of unseen "
             f"prompts {rm['unseen_prompts_accuracy']:.3f} (Bayes-optimal {rm['unseen_prompts_bayes_optimal_accuracy']:.3f}).", "",
             "## PPO against the proxy (gain over the SFT policy; d = √KL)", "",
             "| β | gold peak gain | at d | gold final gain | proxy final gain | final KL | RL fit α | β_fit | R² |",
             "|---|---|---|---|---|---|---|---|---|"]
    for b, c in s["ppo"].items():
        f = c["fit"]
        lines.append(f"| {b} | {c['gold_peak_gain']:.2f} | {c['gold_peak_d']:.2f} | {c['gold_final_gain']:.2f} | "
                     f"{c['proxy_final_gain']:.2f} | {c['final_kl']:.2f} | {f['alpha']:.3f} | {f['beta']:.3f} | {f['r2']:.3f} |")
    bon = s["bon"]
    lines += ["", "## Best-of-n against the proxy (held-out prompts)", "",
              "| n | d = √(log n − (n−1)/n) | gold gain | proxy gain |", "|---|---|---|---|"]
    lines += [f"| {n} | {d:.3f} | {g:.3f} | {p:.3f} |" for n, d, g, p in zip(bon["n"], bon["d"], bon["gold"], bon["proxy"])]
    fg, fp = bon["fit_gold"], bon["fit_proxy"]
    lines += ["", f"Fit R(d) = d(α − βd): gold α={fg['alpha']:.3f} β={fg['beta']:.3f} R²={fg['r2']:.3f}; "
              f"proxy α={fp['alpha']:.3f} β={fp['beta']:.3f} R²={fp['r2']:.3f}.", "",
              "Figures: ppo_all.png, ppo_beta*.png, bon.png.", ""]
    return "\n".join(lines)
