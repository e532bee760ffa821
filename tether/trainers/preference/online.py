"""Online and iterative DPO: DPO on pairs the current policy samples and a reward ranks (docs/dpo.md).

The loop, top to bottom (one *round* = one step of the run, `optim.max_steps` rounds):
    setup_training: the policy (+ LoRA) + a frozen copy of the initial policy (the reference of
       reference=fixed, and what `kl` is measured against) + tokenizer + encoded prompt rows
    -> sample k = rollout.num_generations completions of each of data.batch_size prompts from the
       CURRENT policy: the GRPO family's producer (tether/trajectories/sampling.py: GroupSampler)
       behind the trajectory queue's source (trajectories.asynchronous.batch_source: synchronous
       at queue.max_staleness 0, a sampler thread ahead of the trainer otherwise)
    -> score them with the reward registry (functions, `rm:<run>`, ...) or `self`, the policy as its
       own judge (SelfJudge below; Yuan et al. 2024)
    -> pairs: per prompt the best vs the worst of its scored completions (build_pairs); a prompt whose
       best and worst tie carries no preference and is dropped (counted: frac_ties)
    -> the reference log-probs of the fresh pairs: the initial policy's (fixed: online DPO, Guo et
       al. 2024) or the policy's own at the round's start (reset: iterative DPO, Xu et al. 2023;
       Yuan et al. 2024), computed in the very batches the first epoch trains on, so under reset the
       round's first loss is exactly ln 2 (sigmoid loss; policy = reference)
    -> odpo.dpo_epochs passes over the pairs, odpo.pairs_per_step pairs per optimizer step, each
       step the offline trainer's (offline.py's train_step: the same DPO-family losses, metrics, guard)
    -> log (TRL's names; the round's means) / held-out greedy eval / checkpoint.

One process (torchrun is refused). A step of the run is a round, so `resume` restarts at a round boundary.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import torch

from tether.config import ConfigError, flat_init
from tether.constraints import NonNegativeInt, PositiveInt
from tether.data.tokenize import bos_ids
from tether.errors import NonFiniteLossError, UserError
from tether.feedback.lm import answer_contexts, answer_logprobs, chat_text
from tether.models.lora import adapters_off
from tether.objectives import group_stats
from tether.rewards.registry import load_reward
from tether.rewards.scoring import fn_name
from tether.trainers.core.held_out import HeldOut, check_eval, check_keep_best, eval_rewards, generation_metrics
from tether.trainers.core.sections import (ModelSection, OptimSection, PromptSection, RewardSection,
                                           RolloutSection, RunSection)
from tether.trainers.core.setup import load_prompt_data, releases_process_state, report_summary, setup_training
from tether.trainers.preference.objective import PAIR_OBJECTIVES, REFERENCE_FREE
from tether.trainers.preference.offline import PreferenceSection, train_step
from tether.trainers.preference.reference import reference_logps
from tether.trajectories.asynchronous import batch_source
from tether.trajectories.sampling import GroupSampler, PromptStream, Scoring, StepBatch
from tether.trajectories.source import QueueSection

SELF = "self"  # the reward spec that makes the policy its own judge


@dataclass
class ODPOSection:
    reference: Literal["fixed", "reset"] = "fixed"
    "fixed: the initial policy is the reference throughout (online DPO, Guo et al. 2024); reset: the policy at each round's start becomes the reference (iterative DPO, Xu et al. 2023; Yuan et al. 2024)"
    dpo_epochs: PositiveInt = 1
    "passes of DPO over each round's fresh pairs (iterative DPO trains several; online DPO one)"
    pairs_per_step: NonNegativeInt = 0
    "pairs per optimizer step (0 = all of the round's pairs in one step)"
    micro_batch_size: NonNegativeInt = 0
    "pairs per forward/backward within a step (0 = the whole step at once)"
    judge_template: str = "{prompt}{completion}\n\nIs this a good response? Answer (Yes or No): "
    "reward_funcs=self: the text the policy judges ({prompt}, {completion}); rendered as a user turn with the chat template when the tokenizer has one"
    judge_answers: list[str] = field(default_factory=lambda: ["Yes", "No"])
    "reward_funcs=self: the positive and the negative answer (their first tokens must differ; a BPE's ' Yes' after the template's space is found); the reward is log p(positive) − log p(negative) after the judge text"


@dataclass
class ODPODataSection(PromptSection):
    """Prompt-only rows; batch_size prompts per round, each sampled k = num_generations times."""
    packing: bool = False
    "padding-free DPO forwards (as the offline trainer's data.packing)"


def _rollout() -> RolloutSection:
    return RolloutSection(num_generations=4, max_new_tokens=128)


@flat_init
@dataclass
class ODPOConfig:
    model: ModelSection = field(default_factory=ModelSection)
    "the policy to train (its initial weights are the fixed reference and the KL's anchor)"
    data: ODPODataSection = field(default_factory=ODPODataSection)
    "prompt-only rows; batch_size prompts per round"
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1e-6, schedule="constant", max_steps=20))
    "optimizer, schedule (counts optimizer updates), max_steps = rounds"
    run: RunSection = field(default_factory=lambda: RunSection(name="odpo", log_every=1, num_samples=2))
    "run directory, seed (prompt order and sampling), logging, checkpoints (at round ends)"
    rollout: RolloutSection = field(default_factory=_rollout)
    "sampling; num_generations = k completions per prompt (>= 2: a pair is the best and the worst)"
    reward: RewardSection = field(default_factory=RewardSection)
    "the labeller: reward functions (functions, rm:<run>, or self) and weights"
    preference: PreferenceSection = field(default_factory=PreferenceSection)
    "the pairwise DPO-family objective (method dpo with any loss, simpo, orpo; not kto)"
    odpo: ODPOSection = field(default_factory=ODPOSection)
    "reference (fixed | reset), DPO epochs and batch per round, the self-judge's prompt"
    queue: QueueSection = field(default_factory=QueueSection)
    "where sampling runs: synchronous (max_staleness 0) or a sampler thread up to max_staleness rounds ahead"

    UNUSED = {"preference.sample_max_new_tokens": "samples come from the rounds (rollout.max_new_tokens)",
              "rollout.sampler_copy": "the rounds sample from the policy itself",
              "rollout.release_replica": "the rounds sample from the policy itself",
              "preference.ref_model": "the reference is the initial policy (fixed) or the round's (reset)"}

    def __post_init__(self):
        check_eval(self)
        if self.rollout.num_generations < 2:
            raise ConfigError("config key 'rollout.num_generations' must be >= 2 for odpo: a pair is the best "
                              "and the worst of a prompt's k completions")
        if self.preference.method not in PAIR_OBJECTIVES or self.preference.method == "kto":
            raise ConfigError(f"config key 'preference.method': odpo trains pairs (dpo, simpo, orpo), "
                              f"not {self.preference.method!r}")
        if not self.reward.reward_funcs:
            raise ConfigError("config key 'reward.reward_funcs' must name at least one reward "
                              "(a function, rm:<run>, or self)")
        if len(self.odpo.judge_answers) != 2:
            raise ConfigError("config key 'odpo.judge_answers' must be two strings: positive, negative")
        if self.queue.placement == "disaggregated":
            raise ConfigError("config key 'queue.placement': odpo runs in one process (auto or interleaved)")
        if self.queue.partial:  # (batch_source refuses it too, but only once the model has loaded)
            raise ConfigError("config key 'queue.partial': odpo does not sample partial rollouts")
        if SELF in self.reward.reward_funcs and self.data.eval_data and not self.reward.eval_reward_funcs:
            raise ConfigError("config key 'reward.eval_reward_funcs' is needed with reward_funcs=self and "
                              "data.eval_data: held-out prompts are scored by a reward, not the judge")


# ---- labelling: the self-judge and the pairs --------------------------------------------------------

class SelfJudge:
    """The policy as its own judge (self-rewarding LMs, Yuan et al. 2024), read as probabilities:

        r(x, y) = log π(a⁺ | J(x, y)) − log π(a⁻ | J(x, y))

    J = odpo.judge_template with the prompt and the completion filled in (a user turn of the chat
    template when there is one), a⁺ / a⁻ the first tokens of the positive / negative answer. Yuan et
    al. let the model write a 5-point score and parse it; the log-odds of one answer token is the
    same judgment without sampling noise or unparseable outputs (the answer-token probability the
    AI-feedback judges read, docs/ai-feedback.md), and it orders k completions as finely as floats."""
    __name__ = "self"

    def __init__(self, model, tokenizer, template: str, answers: list[str]):
        self.model, self.tokenizer, self.template, self.answers = model, tokenizer, template, tuple(answers)

    def __call__(self, prompts, completions, completion_ids=None, **_) -> list[float]:
        texts = [self.template.format(prompt=_text(p), completion=_text(c)) for p, c in zip(prompts, completions)]
        chat = bool(getattr(self.tokenizer, "chat_template", None))
        if chat:
            texts = [chat_text(self.tokenizer, [{"role": "user", "content": s}]) for s in texts]
        contexts, ids = answer_contexts(self.tokenizer, texts, self.answers)
        # plain text starts with BOS where the tokenizer's own encoding does (as the prompts did)
        contexts = contexts if chat else [bos_ids(self.tokenizer) + c for c in contexts]
        lp = answer_logprobs(self.model, contexts, ids, pad_id=self.tokenizer.pad_token_id or 0)
        return (lp[:, 0] - lp[:, 1]).tolist()


@dataclass
class JudgedScoring(Scoring):
    """The round's rewards, where a None among `funcs` is `self`: bound per sampler to a SelfJudge
    over the policy that sampled (under a sampler thread, its copy of the weights)."""
    tokenizer: object = None
    template: str = ""
    answers: Sequence[str] = ()

    def for_sampler(self, sampler) -> Scoring:
        judge = SelfJudge(sampler.model, self.tokenizer, self.template, list(self.answers))
        return Scoring([judge if f is None else f for f in self.funcs], self.weights, self.max_new_tokens)


def _text(value) -> str:
    return value if isinstance(value, str) else "\n".join(str(m.get("content", "")) for m in value)


def build_pairs(rewards: torch.Tensor, k: int) -> tuple[list[tuple[int, int]], dict]:
    """Rewards [P·k] of k completions per prompt (prompt-major; NaN = unscored) -> (best, worst)
    row indices per prompt, and counts. A prompt with fewer than 2 scored completions gives no
    pair (`unscored`); one whose best and worst rewards are equal is a tie, dropped (`ties`): it
    says nothing about which completion is better. The first best and the first worst win."""
    pairs, ties, unscored = [], 0, 0
    for g in range(len(rewards) // k):
        r = rewards[g * k:(g + 1) * k]
        scored = (~r.isnan()).nonzero().flatten()
        if len(scored) < 2:
            unscored += 1
            continue
        vals = r[scored]
        best, worst = int(scored[int(vals.argmax())]), int(scored[int(vals.argmin())])
        if r[best] == r[worst]:
            ties += 1
            continue
        pairs.append((g * k + best, g * k + worst))
    ranked = len(pairs) + ties
    return pairs, {"pairs": len(pairs), "ties": ties, "unscored_prompts": unscored,
                   "frac_ties": ties / ranked if ranked else float("nan")}


def pair_rows(collected: StepBatch, pairs: list[tuple[int, int]]) -> list[dict]:
    """The pairs as the offline trainer's examples: token ids (a completion with its EOS) + `idx`."""
    ro = collected.rollout
    ids = ro.completion_lists()  # (one copy to the CPU, not two device syncs per row)
    return [{"prompt_ids": list(ro.prompt_ids[w]), "chosen_ids": ids[w], "rejected_ids": ids[l], "idx": j}
            for j, (w, l) in enumerate(pairs)]


# ---- one round's DPO ------------------------------------------------------------------------------

def round_batches(n: int, cfg: ODPOConfig, generator: torch.Generator) -> list[list[list[int]]]:
    """One epoch's optimizer steps over n pairs in a seeded random order, each cut into micro-batches."""
    order = torch.randperm(n, generator=generator).tolist()
    per_step = cfg.odpo.pairs_per_step or n
    micro = cfg.odpo.micro_batch_size or per_step
    steps = [order[i:i + per_step] for i in range(0, n, per_step)]
    return [[s[i:i + micro] for i in range(0, len(s), micro)] for s in steps]


def round_reference(t, cfg: ODPOConfig, rows: list[dict], forwards: list[list[int]]) -> Optional[dict]:
    """{'train.chosen', 'train.rejected'}: the reference's summed log-probs of every pair, in the
    batches `forwards` (the first epoch's micro-batches: the same tensors the policy sees there)."""
    if cfg.preference.method in REFERENCE_FREE:
        return None
    args = ({"train": rows}, {"train": True}, cfg, t.tokenizer.pad_token_id, t.device, t.amp, {"train": forwards})
    if cfg.odpo.reference == "reset":  # the policy as it is at the round's start
        return reference_logps(t.model, *args)
    if t.reference is not None:
        return reference_logps(t.reference, *args)
    with adapters_off(t.model):  # LoRA: the base under the adapters is the initial policy
        return reference_logps(t.model, *args)


def dpo_round(t, cfg: ODPOConfig, rows: list[dict]) -> dict:
    """odpo.dpo_epochs of DPO-family steps on the round's pairs; the round's mean metrics, plus
    `loss/round_start`: the loss of its first update, before the round changed the policy."""
    g = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + t.step)
    epochs = [round_batches(len(rows), cfg, g) for _ in range(cfg.odpo.dpo_epochs)]
    reference = round_reference(t, cfg, rows, [m for step in epochs[0] for m in step])
    sums, n, first = {}, 0, None
    for step in (s for epoch in epochs for s in epoch):
        micro = [[rows[i] for i in m] for m in step]
        try:
            out = train_step(cfg, t.model, t.optimizer, t.scheduler, micro, True, reference,
                             t.tokenizer.pad_token_id, t.device, t.amp, step=t.guarded_step)
        except NonFiniteLossError:  # refused and counted by guarded_step: nothing reached the weights
            continue
        first = out["loss"] if first is None else first
        for key, v in out.items():
            sums[key] = sums.get(key, 0.0) + v
        n += 1
    means = {key: v / n for key, v in sums.items()}
    return {**means, "loss/round_start": first if first is not None else math.nan, "updates": n}


# ---- the run --------------------------------------------------------------------------------------

@torch.no_grad()
def pool_kl(t, collected: StepBatch, temperature: float) -> float:
    """k1 estimate of KL(π_θ ‖ π_init) per completion on the round's samples (drawn from π_θ):
    mean over them of Σ_t log π_θ − log π_init, the sampler's log-probs against the initial policy's."""
    batch = {key: v.to(t.device) for key, v in collected.rollout.training_batch().items()}
    ref = t.reference_logps(batch, temperature).float()
    mask = batch["completion_mask"]
    return float(torch.where(mask, batch["logprobs"].float() - ref, 0.0).sum(1).mean())


@releases_process_state
def train_odpo(cfg: ODPOConfig) -> dict:
    """Run online / iterative DPO per `cfg`; returns the summary (also written to summary.json)."""
    # WORLD_SIZE, not distributed.active(): the process group is joined only inside setup_training
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError(f"{cfg.run.name}: odpo runs in one process (no torchrun yet)")
    rollout_cfg, k = cfg.rollout, cfg.rollout.num_generations
    # Every reward but `self` is resolved now: an unknown one fails before any model loads.
    resolved = [None if s == SELF else load_reward(s) for s in cfg.reward.reward_funcs]
    weights = list(cfg.reward.reward_weights) or [1.0] * len(resolved)
    if len(weights) != len(resolved):
        raise ConfigError(f"config key 'reward.reward_weights': {len(weights)} weights for {len(resolved)} "
                          f"reward functions")
    plain = [f for f in resolved if f is not None]
    plain_weights = [w for f, w in zip(resolved, weights) if f is not None]  # held-out = training reward
    eval_funcs, eval_weights = eval_rewards(cfg.reward.eval_reward_funcs, plain, plain_weights)
    check_keep_best(cfg, generation_metrics(eval_funcs), held_out=bool(cfg.data.eval_data))

    per_round = math.ceil(cfg.data.batch_size / (cfg.odpo.pairs_per_step or cfg.data.batch_size))
    t = setup_training(cfg, lambda tokenizer: load_prompt_data(cfg, tokenizer), reference=True, rows_per_step=cfg.data.batch_size,
                       updates_per_step=per_round * cfg.odpo.dpo_epochs)
    names = [SELF if f is None else fn_name(f) for f in resolved]
    # 1-2. the producer (tether/trajectories/sampling.py): the data order's next prompts, k
    #    completions each, sampled with a seed of (seed, round), scored (`self`: the sampling policy)
    scoring = JudgedScoring(resolved, weights, rollout_cfg.max_new_tokens, tokenizer=t.tokenizer,
                            template=cfg.odpo.judge_template, answers=cfg.odpo.judge_answers)
    producer = GroupSampler(PromptStream(t.data.train, t.order), scoring, rollout_cfg, t.tokenizer, cfg.run.seed,
                            per_rank=cfg.data.batch_size)
    sampler = producer.make_sampler(t.model)
    source = batch_source(cfg, t, producer, sampler)  # (rounds sampled ahead: in each checkpoint)
    held_out = HeldOut.of_prompts(cfg, t.data.eval, eval_funcs, eval_weights)
    history = t.history.setdefault("reward", [])
    last: dict = {}
    try:
        while t.step < t.total_steps:
            started = time.perf_counter()
            collected, queue_stats = source.get(t.step)  # 1-2. k completions per prompt, scored
            pairs, counts = build_pairs(collected.rewards, k)  # 3. best vs worst, ties dropped
            with source.trainer_turn():  # (the GPU work; the waits for the source stay outside)
                kl = pool_kl(t, collected, rollout_cfg.temperature)
            source.before_update(t.step)
            with source.trainer_turn():
                update = dpo_round(t, cfg, pair_rows(collected, pairs)) if pairs else {"updates": 0}  # 4.
                t.step += 1
                source.after_update(t.step)
            last = {**update, **_pool_metrics(collected, names), **counts, "kl": kl, **queue_stats,
                    "lr": t.lr, "skipped_steps": t.skipped, "epoch": collected.epoch,
                    "step_time": time.perf_counter() - started}
            history.append(last["reward"])
            if t.log_due():
                t.log(last)
                t.add_samples(_samples(collected, pairs, cfg.run.num_samples))
            if t.due(cfg.run.eval_every):
                with source.alone(sampler):  # (interleaved: the sampler thread paused meanwhile)
                    t.log_eval(held_out(t, sampler))
            if t.due(cfg.run.save_every):
                t.checkpoint()
            t.bar.update({"reward": last["reward"], "pairs": counts["pairs"], "kl": kl, **t.eval_shown})
    finally:
        source.close()
    final_eval = held_out(t, sampler)
    t.log_eval(final_eval)
    return t.finish({**final_eval, "prompts": len(t.data.train), "reference": cfg.odpo.reference,
                     "final_reward": last.get("reward"), "final_kl": last.get("kl"), "reward_history": history,
                     "model": str(t.run.checkpoint_dir(t.step)), "data": report_summary(t.data.report)})


def _pool_metrics(collected: StepBatch, names: list[str]) -> dict:
    """The sampled pool: its mean reward (the policy's score), per-function means, the spread
    within prompts, lengths."""
    r, scored = collected.rewards, ~collected.rewards.isnan()
    k = len(r) // max(len(collected.prompt_rows), 1)
    groups = torch.arange(len(r)) // k
    stats = group_stats(r[scored], groups[scored]) if scored.any() else None
    lengths = collected.rollout.lengths.float()
    return {"reward": float(r[scored].mean()) if scored.any() else math.nan,
            "reward_std": float(stats["std"].mean()) if stats else math.nan,
            **{f"rewards/{n}/mean": float(collected.per_fn[:, j].nanmean()) for j, n in enumerate(names)},
            "completions/mean_length": float(lengths.mean()),
            "completions/clipped_ratio": sum(f == "length" for f in collected.rollout.finish_reasons) / len(r)}


def _samples(collected: StepBatch, pairs: list[tuple[int, int]], count: int) -> list[dict]:
    """The round's first pairs for samples.jsonl: prompt, chosen, rejected and their rewards."""
    texts, rows, r = collected.rollout.texts, collected.seq_rows, collected.rewards
    return [{"prompt": rows[w]["prompt"], "completion": texts[w], "rejected": texts[l],
             "reward": float(r[w]), "reward_rejected": float(r[l])} for w, l in pairs[:count]]
