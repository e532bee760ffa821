"""GRPO part of bench/parity.py: one shared rollout, fed as token ids to both trainers' losses.

Sampling RNGs differ between the libraries, so the completions are not drawn twice: tether's own
`train_grpo` runs unchanged (its Sampler draws the completions; they and the advantages it assigns
are recorded on the way), and TRL's GRPOTrainer receives exactly those token ids through its
`rollout_func` hook (prompt ids and completion ids per row; TRL then decodes, scores with the same
reward function, computes its advantages and its loss). Both start from the same fp32 weights and
take the same optimizer steps, so step k's rollout (drawn by tether's policy after k-1 updates) is
trained on by both at step k.

Compared per step: the rewards TRL computes vs tether's (one reward function, called by both),
the advantages per completion (max |difference|), and the TRL-named metrics `loss`, `reward`,
`reward_std`, `entropy`, `completions/mean_length`. GRPO settings on both sides: no std scaling
(Dr. GRPO advantages r - group mean; see SCALE), token-mean loss (TRL's `dapo`, tether's `token-mean`), beta 0, one update per batch,
epsilon 0.2, temperature 1.0.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

G = 4            # completions per prompt
PROMPTS = 2      # prompts per step
MAX_NEW = 48     # tokens per completion
# Dr. GRPO scaling (no division by the group std) on both sides: with "group" the advantages differ
# by the std convention (tether: population std + 1e-6; TRL: Bessel-corrected std + 1e-4), a
# documented difference (docs/parity.md), not a parity failure
SCALE = "none"


def digit_reward(prompts, completions, answer, **kw) -> list[float]:
    """One reward for both sides: 1 if the right number appears in the completion, plus distinct
    digits / 10 (so that groups have reward variance)."""
    out = []
    for c, a in zip(completions, answer):
        text = c[-1]["content"] if isinstance(c, list) else c
        out.append(float(str(a) in text) + len({ch for ch in text if ch.isdigit()}) / 10)
    return out


def arithmetic_rows(n: int, seed: int = 0) -> list[dict]:
    """Two-digit additions as chat prompts (short answers that end on EOS, of varying lengths)."""
    import random
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer in one short sentence."}],
                     "answer": a + b})
    return rows


# reward_std is not compared: TRL logs the Bessel-corrected std over the whole batch, tether the
# mean over groups of the population std (docs/parity.md)
GRPO_METRICS = {"loss": "loss", "reward": "reward", "entropy": "entropy",
                "completions/mean_length": "completions/mean_length", "advantages": "advantages"}


def run_grpo(model: str, work: Path, steps: int) -> dict:
    import parity_common as P  # bench/parity_common.py (bench/ is on sys.path: bench/parity.py puts it there)
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig as TRLGRPOConfig, GRPOTrainer

    import tether.trainers.grpo.loop as online
    import tether.trajectories.sampling as sampling
    from tether.trainers.grpo import GRPOConfig, train_grpo

    tok = AutoTokenizer.from_pretrained(model)
    rows = arithmetic_rows(steps * PROMPTS)
    path = P.write_jsonl(rows, work / "prompts.jsonl")

    # -- tether, observed: the rollouts it samples and the advantages it assigns ------------------
    rollouts, advantages = [], []
    Base = sampling.Sampler

    class Recording(Base):
        def sample(self, *a, **k):
            ro = super().sample(*a, **k)
            if k.get("n", 1) == G:
                rollouts.append(ro)
            return ro
    real_assign = online.assign_advantages

    def assign(t, batch, grpo, greedy):
        real_assign(t, batch, grpo, greedy)
        # per completion: the advantage (constant over its tokens for GRPO)
        a = batch.advantages.detach().float().cpu()
        m = batch.mask.detach().cpu().bool()
        advantages.append(torch.stack([row[mm][0] if mm.any() else torch.tensor(0.0) for row, mm in zip(a, m)]))
    cfgd = P.tether_common(model, path, str(work / "runs"), steps, "grpo")
    cfgd["optim"]["max_grad_norm"] = 1.0
    cfgd["data"] = {"path": path, "batch_size": PROMPTS, "max_prompt_length": 512}
    cfgd["rollout"] = {"num_generations": G, "max_new_tokens": MAX_NEW, "temperature": 1.0}
    cfgd["grpo"] = {"advantage": "grpo", "scale_rewards": SCALE, "loss_agg": "token-mean", "beta": 0.0,
                    "num_iterations": 1, "clip_low": 0.2,
                    # every row through the forward, as TRL does: otherwise tether's logged entropy
                    # covers only the rows it trains on (those with a non-zero advantage)
                    "skip_zero_advantage": False}
    cfg = P.make_cfg(GRPOConfig, cfgd)
    sampling.Sampler, online.assign_advantages = Recording, assign
    try:
        t0 = time.perf_counter()
        train_grpo(cfg, reward_funcs=[digit_reward])
        ours_time = time.perf_counter() - t0
    finally:
        sampling.Sampler, online.assign_advantages = Base, real_assign
    ours = P.tether_metrics(str(work / "runs"), "grpo")

    # the rows of each step, in tether's order
    order = P.tether_order(len(rows), steps, PROMPTS, P.COMMON["seed"])

    # -- identical tokens: TRL's own tokenization of each prompt vs the prompt ids tether sampled from
    def trl_prompt_ids(prompt):
        ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    ours_tok, theirs_tok = [], []
    for k, ro in enumerate(rollouts):
        for g in range(PROMPTS):
            p_ours = list(ro.prompt_ids[g * G])
            p_trl = trl_prompt_ids(rows[order[k * PROMPTS + g]]["prompt"])
            ours_tok.append({"seqs": {"prompt": p_ours}, "masks": {"prompt": [0] * len(p_ours)}})
            theirs_tok.append({"seqs": {"prompt": p_trl}, "masks": {"prompt": [0] * len(p_trl)}})
    tokens = P.compare_tokens("grpo", ours_tok, theirs_tok)

    # -- TRL, fed the recorded rollouts ----------------------------------------------------------
    calls = {"n": 0}
    trl_adv = []

    def rollout_func(prompts, trainer):
        ro = rollouts[calls["n"]]
        calls["n"] += 1
        comp = []
        for i in range(len(prompts)):
            ids = ro.completion_ids[i][ro.completion_mask[i].bool()].tolist()
            comp.append(ids)
        return {"prompt_ids": [list(p) for p in ro.prompt_ids], "completion_ids": comp, "logprobs": None}

    class Shared(GRPOTrainer):
        def _get_train_sampler(self, *a, **k):
            return [i for i in order for _ in range(G)]

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            trl_adv.append(out["advantages"].detach().float().cpu().reshape(-1))
            return out

    rec = P._Recorder()
    torch.manual_seed(P.COMMON["seed"])
    args = TRLGRPOConfig(
        output_dir=str(work / "trl_grpo"), per_device_train_batch_size=PROMPTS * G, gradient_accumulation_steps=1,
        num_generations=G, steps_per_generation=1, num_iterations=1, max_completion_length=MAX_NEW,
        temperature=1.0, beta=0.0, loss_type="dapo", scale_rewards=SCALE, epsilon=0.2,
        learning_rate=P.COMMON["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, optim="adamw_torch", max_steps=steps, logging_steps=1, save_strategy="no",
        report_to="none", seed=P.COMMON["seed"], use_cpu=True, bf16=False, disable_tqdm=True,
        log_completions=False, shuffle_dataset=False)
    trainer = Shared(model=P.load_fp32(model), processing_class=tok, reward_funcs=[digit_reward],
                     train_dataset=Dataset.from_list(rows), args=args, rollout_func=rollout_func,
                     callbacks=[rec.cb])
    t0 = time.perf_counter()
    trainer.train()
    trl_time = time.perf_counter() - t0

    # advantages: one number per step, the max |difference| over the step's completions (as a
    # metric whose TRL value is 0 and tether value the difference, so rel is 1 unless both are 0;
    # the table's abs column is the one to read)
    theirs = rec.rows
    for k, (r, t) in enumerate(zip(ours, theirs)):
        if k < len(advantages) and k < len(trl_adv):
            d = float((advantages[k] - trl_adv[k]).abs().max())
            scale = float(trl_adv[k].abs().max())
            r["advantages"] = scale + d
            t["advantages"] = scale
    return {"tokens": tokens, "tether": ours, "trl": theirs, "metrics": GRPO_METRICS,
            "seconds": {"tether": ours_time, "trl": trl_time},
            "notes": ["one shared rollout per step (sampled by tether's sampler, fed to TRL through rollout_func); "
                      "`advantages` row: max |adv| over the step's completions (TRL) vs the same plus the max "
                      "per-completion |difference| (tether), so its rel column bounds the per-completion difference",
                      "completion lengths per step: " + json.dumps([ro.completion_mask.sum(1).tolist() for ro in rollouts])]}
