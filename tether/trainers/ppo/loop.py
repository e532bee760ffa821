"""PPO-RLHF: policy + frozen reference + frozen reward model(s) / reward functions + value model.

The loop, top to bottom (docs/ppo.md; Ziegler et al. 2019, Stiennon et al. 2020, InstructGPT):
    load policy (+ LoRA), a frozen reference (the initial policy; under LoRA the base with the
    adapters disabled), the value model (from the reward model or the policy: `value_model`,
    critic.py), reward functions (a learned RM is `rm:<dir>`)
    -> for each step: draw `batch_size` prompts, sample completions (tether.rollout)
    -> score: R = Σ_f w_f r_f(x, y) − length_penalty·|y|   (a sequence-level scalar)
    -> storage, no-grad forwards: log π_old (the policy as sampled), log π_ref, V_old
    -> per-token reward  r̃_t = 1[t = last]·R − β·(log π_old,t − log π_ref,t)   (k1 in the reward)
    -> GAE(γ, λ) → advantages A_t and returns R_t = A_t + V_old,t; A whitened over the batch
    -> `ppo_epochs` passes over shuffled minibatches (update.py):
           loss = clipped surrogate(A) + vf_coef · clipped value loss(R) − ent_coef · entropy
    -> β update (fixed, or adaptive toward `kl_target`), KL-budget early stop, log, checkpoint;
       at eval points greedy pass@1 / rewards of held-out prompts (`data.eval_data`, core/held_out.py).

Why the value is read one position early: log π at input position t is the probability of token t
given tokens < t, so the state that chooses token t is the hidden state at t − 1. V is taken
there too (as TRL/OpenRLHF do), so V_t and log π_t describe the same decision.

Under torchrun (many processes, one run) each rank samples and trains on its part of every batch
while whitening, minibatch losses and the logged numbers stay the global batch's: update.py.

With an environment (`env=`, docs/environments.md) each completion is a multi-turn episode
(tether.envs.rollouts.sample_episodes): the model's turns with the environment's replies between
them, in one sequence. R is the environment's reward first, then reward_funcs (which get the
transcript). The environment's tokens are attended to and are neither actions nor states of the
MDP the critic learns: the mask every piece above takes is the model's tokens alone
(`completion_mask`), so the KL is summed over the model's tokens, R sits on the model's last
token, GAE's recursion runs over each sequence's model tokens in order with the observation
positions skipped (objectives.gae: masked-out positions are transparent — the advantages and
returns are those of the sequence with the observations cut out, tests/test_env_ppo.py), the
whitening and the policy, value and entropy terms are over the model's tokens. V of a model
token after a reply is read at the reply's last token: the state that chooses it includes what
the environment said.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tether import distributed
from tether.envs import load_env
from tether.envs.rollouts import env_reward, episode_columns, episode_metrics_over_ranks, sample_episodes
from tether.errors import UserError
from tether.models.logprobs import completion_token_logps
from tether.objectives import gae, kl_penalized_rewards
from tether.rewards.learned import LearnedReward
from tether.rewards.scoring import fn_name, resolve_reward_funcs
from tether.rewards.scoring import score as score_completions
from tether.rollout import Sampler, logprob_mismatch
from tether.rollout.types import SEQ_MULTIPLE
from tether.trainers.core.common import lend_gradients
from tether.trainers.core.held_out import HeldOut, check_keep_best, generation_metrics
from tether.trainers.core.setup import load_prompt_data, releases_process_state, report_summary, setup_training
from tether.trainers.core.sharding import shard_model
from tether.trainers.ppo.config import PPOConfig
from tether.trainers.ppo.critic import build_policy_and_critic, kl_controller, save_ppo_state
from tether.trainers.ppo.process import dense_process_rewards, process_reward_index
from tether.trainers.ppo.update import Shares, ppo_epochs
from tether.trainers.ppo.update import values_of as _values
from tether.trainers.ppo.update import whiten as globally_whitened
from tether.trajectories.episodes import EpisodeEval, episode_sample
from tether.trajectories.sampling import Scoring


@dataclass
class Rewards:
    """The trained reward functions with their weights, and the ones only logged (e.g. gold)."""
    funcs: list
    weights: list[float]
    evals: list

    @classmethod
    def resolve(cls, cfg: PPOConfig, funcs=None, weights=None, evals=None) -> "Rewards":
        """Callables given to train_ppo override the config's specs. With an environment its own
        reward comes first (weight 1) and reward_funcs add to it."""
        funcs = resolve_reward_funcs(funcs if funcs is not None else cfg.reward.reward_funcs)
        env = bool(cfg.environment.env)
        if not funcs and not env:
            raise UserError("ppo: at least one reward is required (reward_funcs=rm:<dir> or a function)")
        weights = list(weights if weights is not None else cfg.reward.reward_weights) or [1.0] * len(funcs)
        if len(weights) != len(funcs):
            raise UserError(f"ppo: {len(weights)} reward_weights for {len(funcs)} reward functions")
        if env:
            funcs, weights = [env_reward, *funcs], [1.0, *weights]
        return cls(funcs, weights, resolve_reward_funcs(evals if evals is not None else cfg.reward.eval_reward_funcs))

    def score(self, rows: list[dict], rollout, length_penalty: float) -> dict:
        """R per completion ([N], CPU; no score from any function = 0, counted) and the
        per-function rewards behind it. Multi-turn: each function also gets the episode's
        transcript (`messages`) and the environment's reward (`env_reward`)."""
        if rollout.episodes is not None:
            rows = [{**row, **episode_columns(ep)} for row, ep in zip(rows, rollout.episodes)]
        completion_ids = rollout.completion_lists()
        try:
            per_function, scores = score_completions(self.funcs, self.weights, rows, rollout.texts, completion_ids)
            evals = score_completions(self.evals, [1.0] * len(self.evals), rows, rollout.texts,
                                      completion_ids)[0] if self.evals else None
        except UserError as e:  # under torchrun: about this rank's completions, the others may not fail
            raise distributed.rank_local(e)
        unscored = scores.isnan()
        scores = torch.nan_to_num(scores) - length_penalty * rollout.lengths.float().cpu()
        return {"scores": scores, "per_function": per_function, "unscored": unscored, "evals": evals}

    def held_out(self) -> tuple[list, list[float]]:
        """(functions, weights) scoring held-out prompts: the eval rewards (each weight 1.0), else
        the trained ones (length_penalty is shaping, not part of the score)."""
        return (self.evals, [1.0] * len(self.evals)) if self.evals else (self.funcs, self.weights)

    def process_rewards(self, scored: dict, prm_at: Optional[int], rows: list[dict], rollout, width: int,
                        tokenizer) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(scores [N], dense [N, width] or None): with a PRM at `prm_at` (ppo.process_reward) its
        reward moves from the last token to every step's end (process.py); else R as scored."""
        if prm_at is None:
            return scored["scores"], None
        w = self.weights[prm_at]
        scores = scored["scores"] - w * torch.nan_to_num(scored["per_function"][:, prm_at])
        return scores, dense_process_rewards(self.funcs[prm_at], w, rows, rollout, width, tokenizer)

    def shard(self, cfg: PPOConfig) -> None:
        """Under torchrun, FSDP2 over the learned reward models: each rank scores its own
        completions, every rank with as many forwards (equal shares, equal chunks)."""
        learned = [fn for fn in self.funcs + self.evals if isinstance(fn, LearnedReward)]
        for model in [m for fn in learned for m in fn.models] if distributed.active() else []:
            shard_model(model, cfg)


# -- the algorithm -------------------------------------------------------------------------------

def ppo_advantages(scores, old_logps, ref_logps, old_values, mask, beta: float, estimator: str = "k1",
                   gamma: float = 1.0, lam: float = 0.95, whiten: bool = True, dense=None):
    """Scores → per-token rewards with the KL inside → GAE → (whitened) advantages, returns.

    r̃_t = 1[t = last]·R − β·KL_t  (Ziegler et al. 2019 eq. 2, per token as Stiennon et al. 2020);
    (A, R_t) = GAE_{γ,λ}(r̃, V_old)  (Schulman et al. 2016 eq. 16);  A ← whiten(A) (returns are
    not whitened: the critic regresses the real return). All [B, T] aligned with input_ids. GAE is
    per sequence; the whitening statistics are the global batch's under torchrun. `dense` [B, T]:
    per-token rewards added to r̃ (a PRM's step scores, process.py). `mask`: the tokens that are
    actions (the model's); anything else — prompt, padding, an environment's reply inside a
    multi-turn completion — is skipped by the KL, the score's position, GAE and the whitening.
    """
    token_rewards = kl_penalized_rewards(scores, old_logps, ref_logps, mask, beta, estimator)
    if dense is not None:
        token_rewards = token_rewards + torch.where(mask.bool(), dense.to(token_rewards), 0.0)
    advantages, returns = gae(token_rewards, old_values, mask, gamma, lam)
    if whiten:
        advantages = globally_whitened(advantages, mask)
    return token_rewards, advantages, returns


def step_metrics(t, seen: dict, rewards: Rewards, mismatch: dict, beta: float, updates: dict,
                 started: float, sampling_seconds: float) -> dict:
    """One step's log row, with TRL's PPO names where they exist. `seen`: the global batch's
    per-sequence values (Shares.gather); `updates`: each update's global numbers."""
    scores, sequence_kl, step_seconds = seen["scores"], seen["sequence_kl"], time.perf_counter() - started
    non_score, reasons = float(-(beta * sequence_kl).mean()), seen["finish_reasons"]
    metrics = {"objective/kl": float(sequence_kl.mean()), "objective/kl_coef": beta,
               "objective/entropy": float(-seen["logp_sums"].mean()),
               "objective/scores": float(scores.mean()), "objective/non_score_reward": non_score,
               "objective/rlhf_reward": float(scores.mean()) + non_score,
               **{k: sum(v) / len(v) for k, v in updates.items()},
               **{f"rewards/{fn_name(f)}/mean": float(seen["per_function"][:, j].nanmean())
                  for j, f in enumerate(rewards.funcs)},
               "frac_unscored": float(seen["unscored"].float().mean()),
               **mismatch,
               "val/num_eos_tokens": sum(f == "eos" for f in reasons),
               "completions/mean_length": float(seen["lengths"].float().mean()),
               "completions/clipped_ratio": sum(f == "length" for f in reasons) / len(reasons),
               "lr": t.lr, "skipped_steps": t.skipped, "episode": t.step * len(reasons),
               "step_time": step_seconds, "rollout/seconds": sampling_seconds,
               "tokens_per_second": float(seen["lengths"].sum()) / step_seconds}
    if "evals" in seen:
        metrics.update({f"eval_rewards/{fn_name(f)}/mean": float(seen["evals"][:, j].nanmean())
                        for j, f in enumerate(rewards.evals)})
    return metrics


def sequence_values(scored: dict, rollout, rows: list[dict], mask, old_logps, sequence_kl) -> dict:
    """A step's per-sequence numbers, as Shares.gather joins them over the ranks for the log row."""
    return {"scores": scored["scores"], "per_function": scored["per_function"], "unscored": scored["unscored"],
            "sequence_kl": sequence_kl, "logp_sums": torch.where(mask, old_logps, 0.0).sum(1),
            "lengths": rollout.lengths, "finish_reasons": rollout.finish_reasons, "texts": rollout.texts,
            "prompts": [row["prompt"] for row in rows],
            **({"evals": scored["evals"]} if scored["evals"] is not None else {}),
            **({"episodes": [episode_sample(rollout, i) for i in range(len(rollout))]}
               if rollout.episodes is not None else {})}


def ppo_summary(t, final_eval: dict, last: dict, stopped_early: Optional[int], kl_control,
                rewards: Rewards) -> dict:
    """summary.json's PPO entries (Training.finish adds steps, skipped steps and the checkpoint)."""
    return {**final_eval, "prompts": len(t.data.train), "stopped_early_at": stopped_early,
            "final_kl": last.get("objective/kl"), "final_scores": last.get("objective/scores"),
            "final_rlhf_reward": last.get("objective/rlhf_reward"), "final_kl_coef": kl_control.value,
            "final_eval_rewards": {fn_name(f): last.get(f"eval_rewards/{fn_name(f)}/mean") for f in rewards.evals},
            "data": report_summary(t.data.report)}


def sample_rollouts(t, sampler, prompts: list[dict], shares: Shares, cfg: PPOConfig, factory):
    """Step t.step's rollouts of this rank's share of `prompts` (the seed a function of (seed,
    step): a resumed run draws the same ones), sampled from the refreshed replica whose memory is
    then lent to training; with an environment its episodes, a prompt whose reset raised leaving
    the batch (env/reset_errors, on every rank alike: Shares.keep). -> (rollout, shares)."""
    generations, env = cfg.rollout.num_generations, cfg.environment
    seed = cfg.run.seed * 1_000_003 + t.step
    with t.replica_turn(sampler):
        if factory is None:
            return sampler.sample([row["prompt_ids"] for row in prompts], n=generations, seed=seed,
                                  only=shares.prompts), shares
        rollout, kept = sample_episodes(sampler, t.tokenizer, factory, prompts, generations, env,
                                        seed=seed, only=shares.prompts)
    return rollout, shares.keep(kept, generations)


def held_out_eval(cfg: PPOConfig, t, rewards, eval_funcs, eval_weights, factory):
    """What an eval point runs: the held-out prompts greedily (HeldOut), or an environment's
    held-out episodes scored as in training (EpisodeEval)."""
    if factory is None:
        return HeldOut.of_prompts(cfg, t.data.eval, eval_funcs, eval_weights)
    return EpisodeEval(t.data.eval, factory, cfg.environment,
                       Scoring(rewards.funcs, rewards.weights, cfg.rollout.max_new_tokens))


@releases_process_state
def train_ppo(cfg: PPOConfig, reward_funcs: Optional[Sequence] = None,
              reward_weights: Optional[Sequence[float]] = None,
              eval_reward_funcs: Optional[Sequence] = None) -> dict:
    """Run PPO-RLHF per `cfg`; returns the summary dict (also written to summary.json).

    `reward_funcs` / `eval_reward_funcs`: callables with TRL's reward signature, overriding the
    config's lists (how the over-optimization study passes the world's gold reward). A step reads
    as CleanRL's ppo.py: rollouts into storage -> GAE -> `ppo_epochs` passes of minibatch updates."""
    distributed.init()  # under torchrun, before the reward models load: each rank on its own device
    rewards, spec = Rewards.resolve(cfg, reward_funcs, reward_weights, eval_reward_funcs), cfg.ppo
    eval_funcs, eval_weights = rewards.held_out()  # held-out prompts (core/held_out.py)
    check_keep_best(cfg, generation_metrics(eval_funcs), held_out=bool(cfg.data.eval_data))
    t = setup_training(cfg, lambda tokenizer: load_prompt_data(cfg, tokenizer), build=build_policy_and_critic,
                       reference=True, updates_per_step=spec.ppo_epochs * spec.num_minibatches,
                       rollout_replica=True)
    rewards.shard(cfg)
    prm_at = process_reward_index(rewards.funcs) if spec.process_reward else None
    policy, critic, amp = t.model, t.trainable["value"], t.amp
    env = cfg.environment.env  # multi-turn episodes of an environment ('' = one completion a prompt)
    factory = load_env(env) if env else None
    generations, sequences = cfg.rollout.num_generations, cfg.data.batch_size * cfg.rollout.num_generations
    sampler = Sampler(t.rollout_model(), t.tokenizer, cfg.rollout.sampling())
    # The KV cache lives in the (policy + critic) gradient buffer, idle while sampling, when it fits
    # (common.flat_grad_buffer); zeroed before the updates.
    gradient_buffer = lend_gradients(sampler, t.trainable, sequences, cfg.rollout.max_new_tokens +
                                     max(len(row["prompt_ids"]) for row in t.data.train))
    kl_control = kl_controller(spec, t.ckpt)
    t.save_extra = lambda path: save_ppo_state(path, critic, kl_control)
    # held-out prompts played greedily ({} without eval_data); an environment's: episodes scored as in training
    held_out = held_out_eval(cfg, t, rewards, eval_funcs, eval_weights, factory)
    last, stopped_early = {}, None
    while t.step < t.total_steps:
        started, gathered = time.perf_counter(), t.gather_seconds
        # 1. rollouts; the seed is a function of (seed, step) so a resumed run draws the same ones.
        # Every rank knows the whole global batch (its sampling keys and logged numbers span it)
        # and samples its own part of it (update.Shares)
        prompts = [t.data.train[i] for i in t.order.global_batch_at(t.order.position)]
        shares = Shares.of(t.order, len(prompts), generations)
        t.order.next()
        rollout, shares = sample_rollouts(t, sampler, prompts, shares, cfg, factory)
        sampling_seconds = time.perf_counter() - started
        rows = [prompts[shares.prompts[i // generations]] for i in range(len(rollout))]
        scored = rewards.score(rows, rollout, spec.length_penalty)
        batch = {k: v.to(t.device) for k, v in rollout.training_batch(SEQ_MULTIPLE).items()}
        mask, temperature = batch["completion_mask"], rollout.logprob_temperature
        scores, dense = rewards.process_rewards(scored, prm_at, rows, rollout, mask.shape[1], t.tokenizer)

        # 2. storage: log π_old, log π_ref, V_old (no grad), then GAE
        with torch.no_grad():
            policy.eval()  # dropout off: π_old must be the policy that sampled
            old_logps = completion_token_logps(policy, batch, temperature, amp)[0].float()
            policy.train()
            ref_logps = t.reference_logps(batch, temperature).float()
            old_values = _values(critic, batch, amp)
            beta = kl_control.value
            _, advantages, returns = ppo_advantages(
                scores.to(t.device), old_logps, ref_logps, old_values, mask, beta,
                spec.kl_estimator, spec.gamma, spec.lam, spec.whiten_advantages, dense)
            sequence_kl = torch.where(mask, old_logps - ref_logps, 0.0).sum(1)  # k1 per sequence
        # the global batch's per-sequence numbers, in its order, on every rank
        seen = shares.gather(sequence_values(scored, rollout, rows, mask, old_logps, sequence_kl))
        token_mask, sampled_logps, trained_logps = shares.tokens(mask, batch["logprobs"], old_logps)
        mismatch = logprob_mismatch(sampled_logps, trained_logps, token_mask)

        # 3. `ppo_epochs` passes over shuffled minibatches (the gradient buffer held the KV cache until now)
        if gradient_buffer is not None:
            gradient_buffer.zero_()
        updates = ppo_epochs(t, spec, critic, batch, old_logps, old_values, advantages, returns,
                             temperature, shares, seen["lengths"], keep_grads=gradient_buffer is not None)
        t.step += 1
        mean_kl = float(seen["sequence_kl"].mean())
        kl_control.update(mean_kl, sequences)

        # 4. log, samples, KL budget, checkpoint (gather_time: the seconds spent refreshing the replica)
        last = {**step_metrics(t, seen, rewards, mismatch, beta, updates, started, sampling_seconds),
                **(episode_metrics_over_ranks(rollout) if env else {}), **t.gather_time(gathered)}
        if t.log_due():
            t.log(last)
            t.add_samples([{"prompt": prompt, "completion": text, "score": float(value), **episode}
                           for prompt, text, value, episode in zip(seen["prompts"], seen["texts"], seen["scores"],
                                                                   seen.get("episodes", [{}] * len(seen["texts"])))])
        t.bar.update({"score": last["objective/scores"], "kl": mean_kl, **t.eval_shown})
        if spec.kl_budget > 0 and mean_kl > spec.kl_budget:
            stopped_early = t.step  # the policy left the region the reward model can be trusted in
            if t.step % cfg.run.log_every:
                t.log(last)
            break
        if t.due(cfg.run.eval_every):
            t.log_eval(held_out(t, sampler))
        if t.due(cfg.run.save_every):
            t.checkpoint()
    final_eval = held_out(t, sampler)
    t.log_eval(final_eval)
    return t.finish(ppo_summary(t, final_eval, last, stopped_early, kl_control, rewards))
