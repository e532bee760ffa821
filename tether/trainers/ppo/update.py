"""PPO's update passes and step statistics over the global rollout batch: in one process, or in
many under torchrun, where each rank holds a share of every batch.

A rank's prompts are its part of the global batch (EpochSampler.part: every W-th position), each
with its num_generations sequences; it samples them with the whole batch's random-stream keys
(Sampler.sample(only=...)), so it draws what one process draws for them.
What spans ranks (tether/distributed.py: ranks are micro-batches):
- advantage whitening: mean and variance over every rank's completion tokens (`whiten`);
- the minibatches: the one-process run's shuffled minibatches of the global batch, each rank
  taking its own rows of each. Every loss term is a token mean; a rank backpropagates its tokens'
  part of it (its mean × its tokens / the minibatch's global tokens) and FSDP2 sums the gradients:
  the one-process gradient. A rank with no row in a minibatch still runs the forward and backward
  (both collective), on a row that weighs 0;
- the logged numbers: per-sequence values gathered in global order (`Shares.gather`) and reduced
  as one process reduces them; per-update token means summed over ranks; an environment's env/*
  metrics weighted by each rank's episodes (`tether.envs.rollouts.episode_metrics_over_ranks`);
- with an environment, the prompts whose reset raised leave the global batch on every rank
  alike (`Shares.keep`): the minibatches are those one process draws over the prompts it keeps.
In one process every piece is the plain computation, bit for bit: the same float32 operations, and
a token mean v passed through v·n/n in float64 comes back exactly v.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tether import distributed
from tether.models.logprobs import completion_token_logps
from tether.objectives import as_bool, masked_sum, policy_loss, value_loss


def values_of(value_model, batch: dict, amp) -> Tensor:
    """V aligned with input_ids: position t holds V(state before token t) = head at t − 1."""
    with amp:
        v = value_model(batch["input_ids"], batch["attention_mask"], batch["position_ids"]).float()
    return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], 1)


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """objectives.masked_whiten over the global batch: (x − μ) / (σ + eps) with μ and the
    population σ over every rank's masked positions (their sums all-reduced); padding 0. A
    per-rank μ, σ would give each rank's tokens another scale than one process gives them."""
    m = as_bool(mask)
    like = dict(dtype=x.dtype, device=x.device)
    total, count = distributed.sum_floats([masked_sum(x, m), m.sum()])
    count = torch.tensor(count, **like).clamp(min=1)
    mean = torch.tensor(total, **like) / count
    squares, = distributed.sum_floats([masked_sum((x - mean) ** 2, m)])
    std = (torch.tensor(squares, **like) / count).sqrt()
    out = (x - mean) / (std + eps)
    return torch.where(m, out, torch.zeros((), **like))


@dataclass
class Shares:
    """Where this rank's sequences sit in the global rollout batch (prompt-major)."""
    prompts: list[int]
    "global batch position of each of this rank's prompts"
    positions: list[int]
    "global index of each of this rank's sequences"
    total: int
    "sequences in the global batch"

    @classmethod
    def of(cls, order, batch: int, generations: int) -> "Shares":
        """This rank's part (EpochSampler.part) of a global batch of `batch` prompts, each with
        its `generations` consecutive sequences."""
        prompts = order.part(list(range(batch)), distributed.rank())
        return cls(prompts, [g * generations + k for g in prompts for k in range(generations)],
                   batch * generations)

    def keep(self, kept: list[int], generations: int) -> "Shares":
        """The shares once the prompts whose environment could not start (its reset raised) leave
        the batch: `kept` (this rank's prompts that were sampled, in order, as sample_episodes
        returns them) from every rank, the global batch renumbered over them alone. `self` when
        every prompt was kept (collective under torchrun: every rank calls)."""
        everyone = sorted(p for part in distributed.all_gather_object(list(kept)) for p in part)
        if len(everyone) * generations == self.total:
            return self
        index = {p: i for i, p in enumerate(everyone)}
        return Shares(list(kept), [index[p] * generations + k for p in kept for k in range(generations)],
                      len(everyone) * generations)

    def gather(self, values: dict) -> dict:
        """Every rank's per-sequence `values` (tensors along dim 0, or lists) joined in global
        order, on every rank (CPU); `values` itself in one process."""
        if not distributed.active():
            return values
        local = {k: v.cpu() if torch.is_tensor(v) else list(v) for k, v in values.items()}
        parts = distributed.all_gather_object((self.positions, local))
        where = [pos for positions, _ in parts for pos in positions]
        order = sorted(range(len(where)), key=where.__getitem__)
        out = {}
        for k, v in local.items():
            rows = [row for _, part in parts for row in part[k]]
            rows = [rows[i] for i in order]
            out[k] = torch.stack(rows) if torch.is_tensor(v) else rows
        return out

    def tokens(self, mask: Tensor, *per_token: Tensor) -> tuple[Tensor, ...]:
        """(mask, *per_token) of the global batch, rows in global order: [N, L] right-padded
        where ranks' widths differ; the arguments themselves in one process. For statistics over
        all completion tokens (a p99 is no sum of per-rank parts)."""
        if not distributed.active():
            return (mask, *per_token)
        m = as_bool(mask)
        rows = self.gather({str(i): [t[j][m[j]].cpu() for j in range(len(t))]
                            for i, t in enumerate(per_token)})
        lengths = [len(r) for r in rows["0"]]
        width = max(lengths, default=0)
        full = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        padded = [torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows[str(i)]])
                  for i in range(len(per_token))]
        return (full, *padded)


def token_means(policy_term, policy_stats: dict, value_term, value_stats: dict, entropy) -> dict[str, float]:
    """One update's token means (TRL's names); the step's log row holds their means over updates."""
    stats = {"policy/approxkl_avg": policy_stats["approx_kl"],
             "policy/clipfrac_avg": policy_stats["clip_ratio/region_mean"],
             "loss/policy_avg": policy_term, "loss/value_avg": value_term,
             "val/clipfrac_avg": value_stats["clipfrac"], "policy/entropy_avg": entropy,
             "val/ratio": policy_stats["ratio/mean"]}
    return {k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in stats.items()}


def ppo_epochs(t, spec, critic, batch: dict, old_logps, old_values, advantages, returns,
               temperature: float, shares: Shares, lengths: Tensor, keep_grads: bool) -> dict[str, list[float]]:
    """`spec.ppo_epochs` passes over the global batch's shuffled minibatches, one optimizer update
    each (this rank's rows of each; see the module doc). `lengths`: completion tokens of every
    global sequence, in global order (each minibatch's global token count). Returns each logged
    number's value per update."""
    policy, amp, mask = t.model, t.amp, batch["completion_mask"]
    local_of = {g: i for i, g in enumerate(shares.positions)}
    generator = torch.Generator().manual_seed(t.cfg.run.seed * 7_919 + t.step)
    updates: dict[str, list[float]] = {}
    for _ in range(spec.ppo_epochs):
        for indices in torch.randperm(shares.total, generator=generator).chunk(spec.num_minibatches):
            mine = [local_of[g] for g in indices.tolist() if g in local_of]
            # no row here: a turn on row 0 that weighs nothing (the forward and backward are collective)
            rows = torch.tensor(mine or [0], dtype=torch.long, device=t.device)
            minibatch = {k: v[rows] for k, v in batch.items()}
            n_local = int(mask[rows].sum()) if mine else 0
            n_global = int(lengths[indices].sum())
            logps, entropy = completion_token_logps(policy, minibatch, temperature, amp, True,
                                                    entropy_grad=True)
            policy_term, policy_stats = policy_loss(logps, old_logps[rows], advantages[rows],
                                                    mask[rows], clip_low=spec.cliprange)
            value_term, value_stats = value_loss(values_of(critic, minibatch, amp), old_values[rows],
                                                 returns[rows], mask[rows], clip=spec.cliprange_value)
            # each term is a mean over this rank's tokens: weighted by its share of the minibatch's
            # tokens, the ranks' gradients (summed by FSDP2) are the gradient of the global mean
            share = n_local / max(n_global, 1)
            loss = (policy_term + spec.vf_coef * value_term - spec.ent_coef * entropy) * share
            loss.backward()
            means = token_means(policy_term, policy_stats, value_term, value_stats, entropy)
            summed = t.sum_over_ranks({"loss": float(loss.detach()), **{k: v * n_local for k, v in means.items()}})
            grad_norm = t.optimizer_step(summed.pop("loss"), keep_grads=keep_grads)
            for k, v in summed.items():
                updates.setdefault(k, []).append(v / max(n_global, 1))
            updates.setdefault("grad_norm", []).append(grad_norm)
    return updates
