"""Online RL, the critic-free family: GRPO, Dr.GRPO, RLOO, ReMax, REINFORCE++ (+ GSPO, GMPO, clip-higher).

The loop, top to bottom (docs/grpo.md):
    setup_training: model (+ LoRA adapters) + the reference when beta > 0 (a frozen copy; under LoRA
       the same model with its adapters disabled) + tokenizer + encoded prompt rows
    -> for each step: draw `batch_size` prompts, sample `num_generations` completions of each
       (tether.rollout: exact per-token log-probs come with the tokens)
    -> score every completion with the reward functions (weighted sum; None = skipped), + DAPO's
       overlong shaping; with dynamic sampling drop zero-variance groups and refill — the
       producer (tether/trajectories/sampling.py: GroupSampler), behind the trajectory queue's
       source (tether/trajectories: sampled here, by a thread ahead, or by another process)
    -> advantages from the registry (tether.objectives.ADVANTAGE_ESTIMATORS), within each group,
       of the score, or of score − β·Σ k1 when the KL goes in the reward (kl_in=reward)
    -> `num_iterations` (μ) optimizer updates on that batch with the clipped surrogate
       (objectives.policy_loss; update.py), + β·k3 KL to the reference in the loss (kl_in=loss)
    -> log (TRL's metric names) / samples / checkpoint (exactly resumable).

Old log-probs: with μ = 1 (and no is_correction) π_old is the update's own forward, detached (the
ratio is 1; the sampler's log-probs differ from it by the training–inference mismatch and, under
the trajectory queue, the staleness: both logged, corrected only on request, prepare_batch); with
μ > 1 or is_correction one no-grad forward before the first update recomputes them, so later
updates are importance-weighted against exactly what the trainer computed.

Under torchrun (tether/distributed.py: ranks are micro-batches) each rank draws its share of the
step's prompts and samples them from a whole copy of the policy (`Training.rollout_model`,
gathered from the shards after each update; its time is logged as gather_time), scores them,
computes its groups' advantages and trains on its rows; the per-sequence sampling streams make
its completions the ones one process draws for those prompts. The loss's denominators, the
whole-batch advantage statistics and every metric are over all ranks (Training's rank methods,
core/ranks.py), so the run logs and learns what one process does with the same config (up to
float rounding), except with dynamic sampling over more than one round
(tether/trajectories/sampling.py).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from tether import distributed
from tether.errors import UserError
from tether.models.logprobs import completion_token_logps
from tether.objectives import ADVANTAGE_ESTIMATORS, compute_advantages, group_stats
from tether.objectives.policy import kl_penalized_rewards
from tether.rewards.scoring import fn_name, resolve_reward_funcs
from tether.rollout.types import SEQ_MULTIPLE
from tether.trainers.core.common import lend_gradients
from tether.trainers.core.held_out import HeldOut, check_keep_best, eval_rewards, generation_metrics
from tether.trainers.core.setup import load_prompt_data, releases_process_state, report_summary, setup_training
from tether.trainers.grpo.config import GRPOConfig, GRPOSection
from tether.trainers.grpo.update import correct_off_policy, micro_slices, update_policy
from tether.trajectories.asynchronous import batch_source
from tether.trajectories.disaggregated import finish_sampler, sampler_config, serve, split_world
from tether.trajectories.partial import PartialRollouts, partial_metrics
from tether.envs.rollouts import env_reward, episode_metrics
from tether.trajectories.episodes import EpisodeEval, episode_sample
from tether.trajectories.sampling import GroupSampler, PromptStream, Scoring, StepBatch

@dataclass
class Batch:
    """One step's training batch: the kept rollouts with their rewards, the masks, the log-probs the
    ratio and the KL are taken against, and the advantages (filled in that order)."""
    collected: StepBatch
    "rollouts and rewards (+ everything sampled this step, dropped groups included)"
    tensors: dict
    "rollout.training_batch() on the model's device (input ids, masks, the sampler's log-probs)"
    valid: torch.Tensor
    "[N] bool (CPU): scored by at least one reward function (else out of its group and the loss)"
    mask: torch.Tensor
    "[N, T] the completion tokens trained on"
    truncated: torch.Tensor
    "[N] bool (CPU): cut at max_new_tokens"
    old_logps: torch.Tensor
    "[N, T] the ratio's denominator"
    ref_logps: Optional[torch.Tensor] = None
    "[N, T] the frozen reference's (beta > 0)"
    advantages: Optional[torch.Tensor] = None
    "[N, T]"
    kl_penalty: Optional[torch.Tensor] = None
    "[N] −β·Σ_t k1 added to the reward (kl_in=reward)"
    filler: Optional[dict] = None
    "one sampled row (training_batch form): the input of the forwards that count for nothing (torchrun)"
    on_policy: bool = False
    "μ = 1 and no IS correction (whatever the staleness): the ratio's π_old is the update's own forward, detached"


def reward_functions(cfg: GRPOConfig, funcs: Optional[Sequence], weights: Optional[Sequence[float]]):
    """(functions, weights, metric names): the callables given, else cfg.reward's, resolved; with
    an environment its own reward comes first (weight 1) and reward_funcs add to it."""
    funcs = resolve_reward_funcs(funcs if funcs is not None else cfg.reward.reward_funcs)
    env = bool(cfg.environment.env)
    if not funcs and not env:
        raise UserError(f"{cfg.run.name}: at least one reward function is required (reward_funcs=module:function)")
    weights = list(weights if weights is not None else cfg.reward.reward_weights) or [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise UserError(f"{cfg.run.name}: {len(weights)} reward_weights for {len(funcs)} reward functions")
    if env:
        funcs, weights = [env_reward, *funcs], [1.0, *weights]
    return funcs, weights, [fn_name(f) for f in funcs] + (["overlong_penalty"] if cfg.grpo.overlong_buffer else [])


def prepare_batch(t, collected: StepBatch, cfg: GRPOConfig) -> Batch:
    """Masks, and the old / reference log-probs (no grad), for a step's collected rollouts."""
    grpo, rollout, device = cfg.grpo, collected.rollout, t.device
    valid = ~collected.rewards.isnan()  # None from every function = skipped
    # Under torchrun a rank may keep no rows (dynamic sampling) and still takes every forward turn
    # (sharded forwards are collective): idle turns run on one sampled row, the filler.
    source = rollout if len(rollout) else collected.filler
    full = {k: v.to(device) for k, v in source.training_batch(SEQ_MULTIPLE).items()}
    tensors = full if len(rollout) else {k: v[:0] for k, v in full.items()}
    filler = {k: v[:1] for k, v in full.items()}
    mask = tensors["completion_mask"] & valid.to(device).unsqueeze(1)
    truncated = torch.tensor([f == "length" for f in rollout.finish_reasons], dtype=torch.bool)
    if grpo.mask_truncated_completions:
        mask &= ~truncated.to(device).unsqueeze(1)
    micro_batches = [{k: v[part] for k, v in tensors.items()}
                     for part in micro_slices(len(rollout), grpo.micro_batch_size)]

    def forwards(fn) -> torch.Tensor:  # fn's outputs on the micro-batches, concatenated
        out = []
        for micro in t.turns(micro_batches):
            result = fn(filler if micro is None else micro)
            if micro is not None:
                out.append(result)
        return torch.cat(out) if out else tensors["logprobs"]
    with torch.no_grad():
        old = tensors["logprobs"]
        # π_old: the trainer's own for μ > 1, for the IS correction, and for the KL in the reward
        # (k1 = log π_old − log π_ref: both sides from the trainer's forward, so the penalty is the
        # KL to the reference alone, not plus the sampler–trainer mismatch, as PPO's)
        if grpo.num_iterations > 1 or grpo.is_correction != "none" or (grpo.beta > 0 and grpo.kl_in == "reward"):
            old = forwards(lambda micro: completion_token_logps(t.model, micro, rollout.logprob_temperature,
                                                                t.amp)[0].float())
        ref = forwards(lambda micro: t.reference_logps(micro, cfg.rollout.temperature).float()) \
            if grpo.beta > 0 else None
    # On-policy (one update on samples of the current weights, no IS correction) π_old is π_θ itself:
    # the loss takes the update's own log-probs, detached (ratio ≡ 1; TRL does the same). Not the
    # sampler's: on CUDA they differ by the training–inference mismatch (bf16 autocast vs the
    # sampler's kernels), and a ratio against them reweighs every token by exp(mismatch) — on
    # SmolLM2-135M (fp32 master weights, bf16 autocast) that feeds back into the policy and
    # collapses it within 50 steps (mismatch max 0.3 -> 16 nats, clip fraction 0.28), where TRL's
    # identical recipe learns. The mismatch stays logged (sampling/*); grpo.is_correction corrects
    # for it. The same holds for a stale batch (queue.max_staleness > 0, partial rollouts): a ratio
    # against the sampler's log-probs mixes the staleness with the mismatch, and collapses SmolLM2
    # just so under the disaggregated placement on 2 H200s (staleness 1: clipped on 25 % of tokens,
    # held-out pass@1 0.42 -> 0.00 in 100 steps, 2 of 3 seeds). So with one update and no
    # correction the ratio is 1 whatever the staleness (it goes uncorrected, as in the synchronous
    # loop's mismatch); is_correction = tis | mis weights by π_old / μ for both (decoupled PPO).
    on_policy = grpo.num_iterations == 1 and grpo.is_correction == "none"
    return Batch(collected, tensors, valid, mask, truncated, old, ref, filler=filler, on_policy=on_policy)


def assign_advantages(t, batch: Batch, grpo: GRPOSection, greedy_scores: Callable) -> None:
    """Advantages within each prompt's group over the scored completions, as the estimator's
    registry entry asks. KL in the reward: r_t = −β·(log π_old − log π_ref)_t + [t = last]·R (k1, as
    PPO/REINFORCE++); estimators of sequence rewards take its sum R − β·Σ_t k1_t, those of token
    rewards the per-token rewards. `greedy_scores(prompt_rows)` -> [prompts]: ReMax's baseline."""
    estimator, rollout, valid = ADVANTAGE_ESTIMATORS[grpo.advantage], batch.collected.rollout, batch.valid
    completion_mask, device = batch.tensors["completion_mask"], batch.mask.device
    rewards = batch.collected.rewards.to(device)
    if grpo.kl_in == "reward" and batch.ref_logps is not None:
        token_rewards = kl_penalized_rewards(torch.nan_to_num(rewards), batch.old_logps, batch.ref_logps,
                                             completion_mask, grpo.beta)
        batch.kl_penalty = torch.where(completion_mask, token_rewards, 0.0).sum(1) - torch.nan_to_num(rewards)
        rewards = token_rewards if estimator.token_rewards else rewards + batch.kl_penalty
    batch.advantages = torch.zeros(len(rollout), batch.mask.shape[1], device=device)
    options = {"scale": grpo.scale_rewards} if estimator.scaled else {}
    # Under torchrun a rank holds whole groups, so group statistics are its own; statistics over
    # the batch (REINFORCE++'s whitening, scale=batch) are taken over every rank's rows.
    whole = distributed.active() and (estimator.whitened or options.get("scale") == "batch")
    if not (valid.any() or whole):
        return
    on_device = valid.to(device)
    if estimator.needs_greedy:  # the scores come back on the CPU, the rollout's indices may not
        scores = torch.as_tensor(greedy_scores(batch.collected.prompt_rows)).to(device)
        options["greedy_rewards"] = scores[rollout.group.to(device)][on_device]
    groups = rollout.group[valid].to(device) if estimator.grouped else None
    inputs = (rewards[on_device], groups, batch.mask[on_device], options)
    if whole:
        *inputs, mine = gather_for_advantages(t, *inputs)
        if not len(inputs[0]):  # no rank has a scored row
            return
    advantages = compute_advantages(grpo.advantage, *inputs[:3], **inputs[3])
    if whole:
        advantages = mine(advantages)
    batch.advantages[on_device] = (advantages.unsqueeze(1) if advantages.dim() == 1 else advantages) \
        .expand(-1, batch.mask.shape[1]).float()


def gather_for_advantages(t, rewards: torch.Tensor, groups: Optional[torch.Tensor], mask: torch.Tensor,
                          options: dict) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, dict,
                                                  Callable[[torch.Tensor], torch.Tensor]]:
    """An estimator's inputs (rewards [n] or [n, T], group ids, mask [n, T], per-row options such
    as greedy_rewards) over every rank's rows, and the function that takes this rank's rows (and
    width) back out of the estimator's output over them all (estimators normalised over the batch:
    REINFORCE++'s whitening, GRPO's scale=batch; group-relative ones need only the rank's groups)."""
    width = mask.shape[1]
    counts = [int(c) for c in distributed.sum_floats(
        [len(rewards) if r == distributed.rank() else 0 for r in range(distributed.world_size())])]
    start = sum(counts[:distributed.rank()])
    per_row = {k: t.gather_rows(v) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    all_groups = None if groups is None else t.gather_rows(t.unique_groups(groups))

    def mine(advantages: torch.Tensor) -> torch.Tensor:
        out = advantages[start:start + len(rewards)]
        return out[:, :width] if out.dim() == 2 else out
    return t.gather_rows(rewards, 0.0), all_groups, t.gather_rows(mask, False), per_row, mine


def step_metrics(t, batch: Batch, update: dict, names: list[str], seconds: float) -> dict:
    """TRL's names. The reward statistics are over everything sampled this step (with dynamic
    sampling the kept groups are a biased subset); the rest over the trained batch."""
    collected, rollout = batch.collected, batch.collected.rollout
    # Under torchrun every rank's rows (gather_rows) and counts: the whole batch's statistics.
    sampled, per_fn = t.gather_rows(collected.sampled_rewards), t.gather_rows(collected.sampled_per_fn)
    valid, truncated, lengths = (t.gather_rows(x) for x in (batch.valid, batch.truncated, rollout.lengths))
    lengths, scored = lengths.float(), ~sampled.isnan()
    counts = dict(collected.metrics, tokens=collected.sampled_tokens)
    if distributed.active():  # kept / dropped groups, generated tokens (the rounds are every rank's)
        summed = t.sum_over_ranks(counts)
        counts = {k: v if k == "num_sampling_rounds" else int(summed[k]) for k, v in counts.items()}
    tokens = counts.pop("tokens")
    group_ids = t.gather_rows(t.unique_groups(collected.sampled_groups))
    groups = group_stats(torch.nan_to_num(sampled[scored]), group_ids[scored]) if scored.any() else None
    penalty = None if batch.kl_penalty is None else t.gather_rows(batch.kl_penalty)
    kl_penalty = {"rewards/kl_penalty/mean": float(penalty[valid.to(penalty.device)].mean())} \
        if penalty is not None and valid.any() else {}
    return {"reward": float(sampled[scored].mean()) if scored.any() else float("nan"),
            "reward_std": float(groups["std"].mean()) if groups else float("nan"),
            "frac_reward_zero_std": float(groups["constant"].float().mean()) if groups else float("nan"),
            **{f"rewards/{n}/mean": float(per_fn[:, j].nanmean()) for j, n in enumerate(names)},
            **kl_penalty, **counts, "frac_skipped": float((~valid).float().mean()),
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(truncated.float().mean()),
            **episode_metrics(rollout),
            **update, "lr": t.lr, "skipped_steps": t.skipped, "epoch": collected.epoch, "step_time": seconds,
            "tokens_per_second": tokens / seconds,
            "rollout/tokens_per_second": rollout.stats.get("tokens_per_s", 0.0),
            "rollout/seconds": rollout.stats.get("total_s", 0.0),
            # a sampler process: its wait for this batch's weights (the trainer's update and the
            # broadcast), kept out of rollout/seconds; its sampling + scoring of the batch; the
            # packing + storing of its previous batch — together its cycle (trajectories.disaggregated.serve);
            # 1 where the next version's weights arrived while this batch was produced (Incoming)
            **{f"queue/{k}_seconds": rollout.stats[f"{k}_s"] for k in ("weights_wait", "produce", "send")
               if f"{k}_s" in rollout.stats},
            **({"queue/weights_overlapped": rollout.stats["weights_overlapped"]}
               if "weights_overlapped" in rollout.stats else {})}


def samples(batch: Batch, count: int, names: Sequence[str] = ()) -> list[dict]:
    """The first `count` completions with their prompts, rewards (total and per function,
    `rewards/<name>`) and advantage (mean over the completion's tokens), for samples.jsonl."""
    collected = batch.collected
    rows, texts = collected.seq_rows, collected.rollout.texts
    n = min(count, len(texts))
    adv = None
    if batch.advantages is not None and n:
        m = batch.mask[:n].float()
        adv = ((batch.advantages[:n].float() * m).sum(1) / m.sum(1).clamp(min=1)).cpu()
    per_fn = collected.per_fn[:n].cpu()

    def num(v) -> float | None:
        v = float(v)
        return None if math.isnan(v) else v
    episodes = collected.rollout.episodes
    return [{"prompt": rows[i]["prompt"], "completion": texts[i],
             "reward": None if not batch.valid[i] else float(collected.rewards[i]),
             **{f"rewards/{name}": num(per_fn[i, j]) for j, name in enumerate(names)},
             **({} if adv is None or not batch.valid[i] else {"advantage": float(adv[i])}),
             **({} if episodes is None else episode_sample(collected.rollout, i))}
            for i in range(n)]


@releases_process_state
def train_grpo(cfg: GRPOConfig, reward_funcs: Optional[Sequence] = None,
               reward_weights: Optional[Sequence[float]] = None) -> dict:
    """Run GRPO-family RL per `cfg`; returns the summary dict (also written to summary.json).

    `reward_funcs`: callables `fn(prompts, completions, completion_ids, **columns) -> list[float |
    None]` (default: cfg.reward.reward_funcs imported). A completion no function scores is skipped:
    it takes no part in its group's statistics and gets no gradient.
    """
    grpo, rollout_cfg, prompts_per_step = cfg.grpo, cfg.rollout, cfg.data.batch_size
    funcs, weights, names = reward_functions(cfg, reward_funcs, reward_weights)
    # held-out scoring (core/held_out.py): eval_reward_funcs, else the training rewards
    eval_funcs, eval_weights = eval_rewards(cfg.reward.eval_reward_funcs, funcs, weights)
    check_keep_best(cfg, generation_metrics(eval_funcs), held_out=bool(cfg.data.eval_data))

    # placement=disaggregated: torchrun's processes split into trainers and samplers
    # (trajectories/disaggregated.py)
    link = split_world(cfg)
    # Under torchrun each rank samples, scores and trains its share of each step's prompts (whole
    # groups), sampling from a whole copy of the policy (rollout_model: gathered after each update)
    t = setup_training(sampler_config(cfg, link) if link and link.samples else cfg,
                       lambda tokenizer: load_prompt_data(cfg, tokenizer),
                       reference=grpo.beta > 0, rows_per_step=prompts_per_step,
                       updates_per_step=grpo.num_iterations, rollout_replica=True)
    # 1-2. the producer of step k's batch (trajectories/sampling.py): the data order's next prompts
    #    (this rank's share), G completions of each, sampled with a seed of (seed, k) so a resumed
    #    run draws the same ones, scored (+ overlong shaping); dynamic sampling drops groups with
    #    no reward variance and samples more prompts. Partial rollouts continue completions across
    #    weight updates (trajectories/partial.py).
    scoring = Scoring(funcs, weights, rollout_cfg.max_new_tokens, grpo.overlong_buffer, grpo.overlong_penalty)
    groups = GroupSampler(PromptStream(t.data.train, t.order), scoring, rollout_cfg, t.tokenizer, cfg.run.seed,
                          per_rank=prompts_per_step // distributed.world_size(), dynamic=grpo.dynamic_sampling,
                          max_rounds=grpo.max_sampling_rounds, every_rank=t.every_rank, refresh=t.rollout_model,
                          env=cfg.environment)
    sampler = groups.make_sampler(t.rollout_model())
    produce = PartialRollouts.of(groups, cfg, start=t.step) if cfg.queue.partial else groups
    if link is not None and link.samples:  # a sampler process: batches to the trainer until the last
        return finish_sampler(t, serve(t, link, produce, sampler, cfg.queue.max_staleness))
    # Where step k's batch comes from: sampled here and now (max_staleness 0), by a thread ahead of
    # the trainer (interleaved) or by another process (disaggregated); trajectories/asynchronous.py.
    source = batch_source(cfg, t, produce, sampler, link)  # (and its in-flight batches in each checkpoint)
    # Sampling and the update never overlap: the KV cache lives in the gradient buffer (one of the
    # two held, not both; common.flat_grad_buffer), which is zeroed after sampling. Only if it fits.
    grad_buffer = lend_gradients(sampler, t.model, prompts_per_step * rollout_cfg.num_generations,
                                 max(len(p["prompt_ids"]) for p in t.data.train) + rollout_cfg.max_new_tokens) \
        if source.lends_gradients else None
    greedy_scores = functools.partial(groups.greedy_scores, sampler)  # ReMax's baseline

    held_out = EpisodeEval(t.data.eval, groups.env_factory, cfg.environment, scoring) if groups.env else \
        HeldOut.of_prompts(cfg, t.data.eval, eval_funcs, eval_weights)  # {} without eval_data
    history = t.history.setdefault("reward", [])  # checkpointed: a resume keeps the earlier steps'
    last: dict = {}
    try:
        while t.step < t.total_steps:
            started, gathered = time.perf_counter(), t.gather_seconds
            collected, queue_stats = source.get(t.step)  # 1-2. step k's scored rollouts (produce)
            # rollout.release_replica: the copy's memory to the reference's forward and the update
            t.lend_rollout_memory(sampler)
            with source.trainer_turn():  # (the GPU work; the waits for the source stay outside)
                # 3. masks, old / reference log-probs (no grad);  4. advantages, as the estimator
                #    asks, weighted by the off-policy correction (is_correction)
                batch = prepare_batch(t, collected, cfg)
                assign_advantages(t, batch, grpo, greedy_scores)
                correction = correct_off_policy(batch, grpo)
                if grad_buffer is not None:  # (it held the sampler's KV cache until now)
                    grad_buffer.zero_()
            source.before_update(t.step)
            t.lend_rollout_memory(sampler)  # (again, if ReMax's baseline brought the copy back)
            with source.trainer_turn():
                # 5. μ updates on this batch
                update = update_policy(t, batch, grpo, norm_length=rollout_cfg.max_new_tokens,
                                       keep_grads=grad_buffer is not None)
                t.step += 1
                source.after_update(t.step)  # the samplers' weights: version t.step
                # 6. log / samples / checkpoint
                last = {**step_metrics(t, batch, update, names, time.perf_counter() - started), **correction,
                        **queue_stats, **partial_metrics(batch, t.step - 1)}
            if source.refreshes_replica:
                last.update(t.gather_time(gathered))
            history.append(last["reward"])
            if t.log_due():
                t.log(last)
                with source.trainer_turn():  # (its GPU reads)
                    t.add_samples(samples(batch, cfg.run.num_samples, names))
            if t.due(cfg.run.eval_every):
                with source.alone(sampler):  # (interleaved: the sampler thread paused meanwhile)
                    t.log_eval(held_out(t, sampler))
            if t.due(cfg.run.save_every):
                t.checkpoint()
            t.bar.update({"reward": last["reward"], "kl": last.get("kl", 0.0), **t.eval_shown})
    finally:
        source.close()

    final_eval = held_out(t, sampler)
    t.log_eval(final_eval)
    return t.finish({**final_eval, "prompts": len(t.data.train), "final_reward": last.get("reward"),
                     "reward_history": history, "data": report_summary(t.data.report)})
