"""The update pass of the online trainer (tether.trainers.online): μ optimizer updates on one scored
batch with the clipped surrogate, in micro-batches, leaving out the rows whose gradient is exactly 0.

Micro-batches are weighted so that the accumulated gradient is the whole batch's loss for every
`loss_agg` (token-mean: by their share of the tokens; the seq-means: by their share of the rows),
whatever `micro_batch_size` is and whichever rows are left out.
"""

from __future__ import annotations

import torch

from tether.models.logprobs import completion_token_logps
from tether.objectives import policy_loss
from tether.rollout import logprob_mismatch


def _slices(n: int, size: int) -> list[slice]:
    size = size if size > 0 else max(n, 1)  # n == 0: no slices
    return [slice(i, min(n, i + size)) for i in range(0, n, size)]


def _agg_weight(mask: torch.Tensor, rows, agg: str, n_tok: int) -> float:
    """Share of the whole batch's loss carried by the micro-batch of `rows` (a slice or indices), so
    that accumulated gradients equal the full-batch loss's whatever micro_batch_size is."""
    if agg == "token-mean":
        return float(mask[rows].sum()) / max(n_tok, 1)
    return mask[rows].shape[0] / mask.shape[0]


def _trained_rows(adv: torch.Tensor, mask: torch.Tensor, skip_zero: bool, quantum: int = 1) -> torch.Tensor:
    """Indices of the rows the update trains on. A row whose advantage is 0 at every token it
    has contributes −min(r·0, clip(r)·0) = 0 to the surrogate and so exactly 0 to the gradient:
    with `skip_zero` (never with a KL term in the loss, which pulls on every row) it is left out of
    the forward and backward. In GRPO that is every group whose rewards all agree (a third to two
    thirds of the batch in the quickstart's RL stage) and any completion scored exactly its group's
    mean. The loss weights still count it. The count is rounded up to a multiple of `quantum` with
    skipped rows (compiled layers: whole micro-batches keep shapes static; a new batch size would
    recompile, measured +0.2-0.3 s a step on an H100)."""
    n = mask.shape[0]
    if not skip_zero:
        return torch.arange(n, device=mask.device)
    # on the batch's device: a CPU index into CUDA tensors is a synchronous copy per tensor indexed
    active = ((adv != 0) & mask).any(1)
    k = int(active.sum())
    fill = min(n, -(-k // quantum) * quantum) - k
    if fill > 0:
        active[(~active).nonzero().squeeze(1)[:fill]] = True
    return active.nonzero().squeeze(1)


def update_policy(training, batch, grpo, norm_length: int, keep_grads: bool) -> dict[str, float]:
    """`grpo.num_iterations` optimizer updates of `training`'s model on `batch` (online.Batch);
    returns the step's update metrics: those of the last update, and the entropy and the sampler–
    trainer log-prob mismatch measured in the first (before any update moved the weights)."""
    model, rollout = training.model, batch.collected.rollout
    n = len(rollout)
    kl_in_loss = grpo.beta > 0 and grpo.kl_in == "loss"
    rows = _trained_rows(batch.advantages, batch.mask, grpo.skip_zero_advantage and not kl_in_loss,
                         quantum=(grpo.micro_batch_size or n) if training.cfg.model.compile else 1)
    skipping = len(rows) < n  # else slices: views instead of gathered copies
    trained = rows if skipping else slice(None)  # the rows the metrics are over
    parts = [rows[s] for s in _slices(len(rows), grpo.micro_batch_size)] if skipping \
        else _slices(n, grpo.micro_batch_size)
    n_tok = int(batch.mask.sum())
    stats: dict[str, float] = {"frac_zero_advantage_skipped": 1.0 - len(rows) / n}
    for iteration in range(grpo.num_iterations):
        sums: dict[str, float] = {}
        loss_value, share, new_logps, entropies = 0.0, 0.0, [], []
        for part in parts:
            micro = {k: v[part] for k, v in batch.tensors.items()}
            logps, entropy = completion_token_logps(model, micro, rollout.logprob_temperature, training.amp,
                                                    want_entropy=grpo.log_entropy and iteration == 0)
            loss, metrics = policy_loss(logps, batch.old_logps[part], batch.advantages[part], batch.mask[part],
                                        clip_low=grpo.clip_low, clip_high=grpo.clip_high, agg=grpo.loss_agg,
                                        ref_logps=None if batch.ref_logps is None else batch.ref_logps[part],
                                        beta=grpo.beta if grpo.kl_in == "loss" else 0.0,
                                        importance_level=grpo.importance_level, norm_length=norm_length)
            weight = _agg_weight(batch.mask, part, grpo.loss_agg, n_tok)
            (loss * weight).backward()
            loss_value += float(loss.detach()) * weight
            share += weight
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * weight
            if iteration == 0:
                new_logps.append(logps.detach())
                if entropy is not None:
                    entropies.append(float(entropy) * weight)
        if not parts:  # nothing to train on: the zero gradient still moves AdamW's moments,
            for param in training.trainable.parameters():  # as the full batch's backward would have
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
        grad_norm = training.optimizer_step(loss_value, keep_grads=keep_grads)
        # Metrics are means over the trained rows (weights renormalized by their share of the
        # batch); pg_loss, like loss, is the full batch's (skipped rows add exactly 0 to both).
        sums = {k: v if k == "pg_loss" else v / share for k, v in sums.items()} if share else sums
        if iteration == 0 and parts:
            stats.update(logprob_mismatch(batch.tensors["logprobs"][trained], torch.cat(new_logps),
                                          batch.mask[trained]))
            if entropies:
                stats["entropy"] = sum(entropies) / share
        stats.update({**sums, "loss": loss_value, "grad_norm": grad_norm})
    return stats
