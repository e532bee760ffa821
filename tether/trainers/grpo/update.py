"""The GRPO family's update (loop.py): the off-policy correction of the batch's advantages, then μ
optimizer updates on it with the clipped surrogate, in micro-batches, leaving out the rows whose
gradient is exactly 0.

Micro-batches are weighted so that the accumulated gradient is the whole batch's loss for every
`loss_agg` (token-mean: by their share of the tokens; the seq-means: by their share of the rows),
whatever `micro_batch_size` is and whichever rows are left out.

Under torchrun a rank's rows are micro-batches of the one batch (tether/distributed.py): the
shares are of every rank's tokens / rows, the loss and the metrics are summed over the ranks, and
every rank takes as many forward/backward turns as the busiest (Training.turns). Metrics are
then token-weighted means over the trained rows, the one-process values whenever those do not
depend on how the batch is cut (the token-mean loss, or micro_batch_size=0); with a seq-mean
aggregation and micro-batches one process weighs each micro-batch's token means by its rows.
"""

from __future__ import annotations

import torch

from tether import distributed
from tether.models.logprobs import completion_token_logps
from tether.objectives import importance_weights, is_metrics, policy_loss
from tether.rollout import logprob_mismatch


def micro_slices(n: int, size: int) -> list[slice]:
    """Consecutive slices of `size` rows covering n rows (size 0: one slice of all of them)."""
    size = size if size > 0 else max(n, 1)  # n == 0: no slices
    return [slice(i, min(n, i + size)) for i in range(0, n, size)]


def correct_off_policy(batch, grpo) -> dict:
    """Weight `batch.advantages` by the IS correction of π_old (batch.old_logps, the trainer's)
    against the sampler's log-probs μ, the behaviour policy (grpo.is_correction = tis | mis:
    objectives.importance_weights(π_old / μ)), which corrects both a stale batch's staleness and the
    sampler–trainer numeric mismatch; returns the weights' metrics over every rank's tokens."""
    if grpo.is_correction == "none":
        return {}
    mask = batch.mask
    c = importance_weights(grpo.is_correction, batch.old_logps, batch.tensors["logprobs"], mask,
                           grpo.is_level, grpo.is_cap)
    batch.advantages = batch.advantages * c.weights
    if not distributed.active():
        return {k: float(v) for k, v in is_metrics(grpo.is_correction, c, mask).items()}
    m = mask.bool()
    tokens, total, capped = distributed.sum_floats([m.sum(), c.weights[m].sum(), c.capped[m].sum()])
    top = distributed.max_float(float(c.weights[m].max()) if m.any() else float("-inf"))
    name = [k for k in is_metrics(grpo.is_correction, c, mask) if k.startswith("is_weight/frac")][0]
    return {"is_weight/mean": total / max(tokens, 1), "is_weight/max": top, name: capped / max(tokens, 1)}


def _agg_weight(mask: torch.Tensor, rows, agg: str, n_tok: int, n_rows: int) -> float:
    """Share of the whole batch's loss carried by the micro-batch of `rows` (a slice or indices), so
    that accumulated gradients equal the full-batch loss's whatever micro_batch_size is. `n_tok`,
    `n_rows`: the whole batch's tokens and rows (every rank's, under torchrun)."""
    if agg == "token-mean":
        return float(mask[rows].sum()) / max(n_tok, 1)
    return mask[rows].shape[0] / n_rows


def _trained_rows(adv: torch.Tensor, mask: torch.Tensor, skip_zero: bool, quantum: int = 1) -> torch.Tensor:
    """Indices of the rows the update trains on. A row whose advantage is 0 at every token it
    has contributes −min(r·0, clip(r)·0) = 0 to the surrogate and so exactly 0 to the gradient:
    with `skip_zero` (never with a KL term in the loss, which pulls on every row) it is left out of
    the forward and backward. In GRPO that is every group whose rewards all agree (a third to two
    thirds of the batch in the quickstart's RL stage) and any completion scored exactly its group's
    mean. The loss weights still count it. The count is rounded up to a multiple of `quantum` with
    skipped rows (compiled layers: whole micro-batches keep the shapes few; a new batch size cost
    +0.2-0.3 s a step on an H100, as a new sequence width did on an H200 — rollout.types.SEQ_MULTIPLE)."""
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
    """`grpo.num_iterations` optimizer updates of `training`'s model on `batch` (loop.Batch);
    returns the step's update metrics: those of the last update, and the entropy and the sampler–
    trainer log-prob mismatch measured in the first (before any update moved the weights)."""
    model, rollout = training.model, batch.collected.rollout
    n = len(rollout)
    kl_in_loss = grpo.beta > 0 and grpo.kl_in == "loss"
    rows = _trained_rows(batch.advantages, batch.mask, grpo.skip_zero_advantage and not kl_in_loss,
                         quantum=(grpo.micro_batch_size or n) if training.cfg.model.compile else 1)
    skipping = len(rows) < n  # else slices: views instead of gathered copies
    trained = rows if skipping else slice(None)  # the rows the metrics are over
    parts = [rows[s] for s in micro_slices(len(rows), grpo.micro_batch_size)] if skipping \
        else micro_slices(n, grpo.micro_batch_size)
    n_tok = int(batch.mask.sum())
    ranks = distributed.active()
    n_rows, n_trained = n, len(rows)
    if ranks:  # the batch is every rank's rows: its loss is a token (or row) mean over all of them
        n_rows, n_tok, n_trained = (int(x) for x in distributed.sum_floats([n, n_tok, len(rows)]))
    stats: dict[str, float] = {"frac_zero_advantage_skipped": 1.0 - n_trained / n_rows}
    cmask = batch.tensors["completion_mask"]
    for iteration in range(grpo.num_iterations):
        sums: dict[str, float] = {}
        loss_value, share, new_logps, entropies, entropy_share = 0.0, 0.0, [], [], 0.0
        steps = training.turns(parts)
        # each micro-batch's logged numbers stay on the device until the loop ends and are read in
        # one transfer (a float() per number stalled the CPU, and so the next launches, ~8 times a
        # micro-batch; the loss weight and the forward's token selection still read one or two each)
        pending: list[tuple[float, list[str], bool, torch.Tensor]] = []
        for part in distributed.accumulation(model, steps):
            if part is None:  # another rank's turn: this one takes it on nothing
                training.idle_turn(batch.filler, rollout.logprob_temperature, backward=True)
                continue
            micro = {k: v[part] for k, v in batch.tensors.items()}
            logps, entropy = completion_token_logps(model, micro, rollout.logprob_temperature, training.amp,
                                                    want_entropy=grpo.log_entropy and iteration == 0)
            old = logps.detach() if batch.on_policy else batch.old_logps[part]  # loop.prepare_batch
            loss, metrics = policy_loss(logps, old, batch.advantages[part], batch.mask[part],
                                        clip_low=grpo.clip_low, clip_high=grpo.clip_high, agg=grpo.loss_agg,
                                        ref_logps=None if batch.ref_logps is None else batch.ref_logps[part],
                                        beta=grpo.beta if grpo.kl_in == "loss" else 0.0,
                                        importance_level=grpo.importance_level, norm_length=norm_length)
            weight = _agg_weight(batch.mask, part, grpo.loss_agg, n_tok, n_rows)
            (loss * weight).backward()
            numbers = [loss, batch.mask[part].sum(), cmask[part].sum(),
                       entropy if entropy is not None else loss.new_zeros(()), *metrics.values()]
            pending.append((weight, list(metrics), entropy is not None,
                            torch.stack([_f64(v, loss.device) for v in numbers])))
            if iteration == 0:
                new_logps.append(logps.detach())
        table = torch.stack([p[3] for p in pending]).tolist() if pending else []
        for (weight, names, has_entropy, _), (loss_v, tokens, c_tokens, entropy_v, *values) in zip(pending, table):
            loss_value += loss_v * weight
            # Metrics (token means) are weighed by the loss's weight in one process; across ranks
            # by their tokens, so that they do not depend on which rank holds which rows.
            mweight = tokens if ranks else weight
            share += mweight
            for k, v in zip(names, values):
                sums[k] = sums.get(k, 0.0) + v * (weight if k == "pg_loss" else mweight)
            if has_entropy:  # a mean over the micro-batch's completion tokens (first iteration only)
                eweight = c_tokens if ranks else weight
                entropies.append(entropy_v * eweight)
                entropy_share += eweight
        if not steps:  # nothing to train on: the zero gradient still moves AdamW's moments,
            for param in training.trainable.parameters():  # as the full batch's backward would have
                if param.requires_grad and param.grad is None:
                    param.grad = torch.zeros_like(param)
        entropy_sum = sum(entropies)
        if ranks:  # (every rank's in rank order: a rank with no trained row has no metric keys)
            total = training.sum_in_rank_order({"loss": loss_value, "share": share, "sums": sums,
                                                "entropy": entropy_sum, "entropy_share": entropy_share})
            loss_value, share, sums, entropy_sum, entropy_share = (
                total[k] for k in ("loss", "share", "sums", "entropy", "entropy_share"))
        grad_norm = training.optimizer_step(loss_value, keep_grads=keep_grads)
        # Metrics are means over the trained rows (weights renormalized by their share of the
        # batch); pg_loss, like loss, is the full batch's (skipped rows add exactly 0 to both).
        sums = {k: v if k == "pg_loss" else v / share for k, v in sums.items()} if share else sums
        if iteration == 0:
            stats.update(_mismatch(training, batch, trained, new_logps, ranks) if ranks or parts else {})
            if entropy_share:
                stats["entropy"] = entropy_sum / entropy_share
        stats.update({**sums, "loss": loss_value, "grad_norm": grad_norm})
    return stats


def _f64(v, device) -> torch.Tensor:
    """A number (0-d tensor or float) as a float64 0-d tensor on `device`, its value unchanged."""
    if isinstance(v, torch.Tensor):
        return v.detach().to(device, torch.float64).reshape(())
    return torch.tensor(float(v), dtype=torch.float64, device=device)


def _mismatch(training, batch, trained, new_logps: list, ranks: bool) -> dict[str, float]:
    """logprob_mismatch of the sampler's and the first update's log-probs over the trained rows
    (of every rank: its p99 and extremes need all the tokens)."""
    rollout_logps, mask = batch.tensors["logprobs"][trained], batch.mask[trained]
    if not ranks:
        return logprob_mismatch(rollout_logps, torch.cat(new_logps), mask)
    train_logps = torch.cat(new_logps)[mask] if new_logps else rollout_logps[mask][:0]
    a, b = training.gather_rows(rollout_logps[mask].float()), training.gather_rows(train_logps.float())
    return logprob_mismatch(a, b, torch.ones_like(a, dtype=torch.bool))
