"""Evaluation from forward passes alone: preference accuracy of a reward model or of a DPO policy's
implicit reward, and perplexity of SFT-format data.

    dpo_pair_rewards(policy, ref, pairs, beta, ...)   -> (r_chosen [N], r_rejected [N])
    reward_model_pairs(reward, rows)                  -> (chosen scores, rejected scores)
    token_nll(model, examples, ...)                   -> (Σ NLL, target tokens)

Pairs are `tether.data.encode_preference` examples, batched as the offline trainers batch them
([chosen rows; rejected rows] in one right-padded forward, data.pad_preference_batch); log-probs come
from the trainers' own forward (`models.logprobs.completion_token_logps`), so a held-out number here
is the number training computes on the same rows.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from tether.data.collate import pad_batch, pad_preference_batch
from tether.models.logprobs import completion_token_logps


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def sequence_logps(model, batch: dict, amp=None) -> torch.Tensor:
    """Σ_t log π(y_t | x, y_<t) over each row's completion tokens [R] (float32, on the CPU)."""
    device = _device(model)
    on = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "completion_mask")}
    logps, _ = completion_token_logps(model, on, 1.0, amp or contextlib.nullcontext())
    return logps.sum(-1).float().cpu()


@torch.no_grad()
def pair_logps(model, pairs: list[dict], batch_size: int, pad_id: int, amp=None):
    """(chosen, rejected) summed completion log-probs [N] of every pair, in eval mode."""
    was = model.training
    model.eval()
    chosen, rejected = [], []
    try:
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i:i + batch_size]
            lp = sequence_logps(model, pad_preference_batch(chunk, pad_id), amp)
            chosen.append(lp[:len(chunk)]), rejected.append(lp[len(chunk):])
    finally:
        model.train(was)
    return torch.cat(chosen), torch.cat(rejected)


def dpo_pair_rewards(policy, reference, pairs: list[dict], beta: float, batch_size: int, pad_id: int,
                     amp=None) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's implicit rewards of both sides of every pair (Rafailov et al. 2023, "Direct Preference
    Optimization", eq. 5 without its prompt-only term β·log Z(x), which cancels in every comparison
    of two completions of one prompt):

        r(x, y) = β · (log π(y | x) − log π_ref(y | x)),   log π(y | x) = Σ_t log π(y_t | x, y_<t)

    Both models see the same batches (same rows, padding and shapes), so policy == reference gives
    r = 0 exactly, not rounding noise."""
    pc, pr = pair_logps(policy, pairs, batch_size, pad_id, amp)
    rc, rr = pair_logps(reference, pairs, batch_size, pad_id, amp)
    return beta * (pc - rc), beta * (pr - rr)


def reward_model_pairs(reward, rows: Sequence[dict]) -> tuple[list[float], list[float]]:
    """A reward function's scores of the chosen and of the rejected completion of each text pair.
    For `rm:` specs (tether.rewards.learned.LearnedReward) the text is tokenised exactly as
    `tether rm` tokenised its training pairs, and an ensemble is aggregated as in training."""
    prompts = [r["prompt"] for r in rows]
    chosen = reward(prompts=prompts, completions=[r["chosen"] for r in rows])
    rejected = reward(prompts=prompts, completions=[r["rejected"] for r in rows])
    return [float(x) for x in chosen], [float(x) for x in rejected]


@torch.no_grad()
def token_nll(model, examples: list[dict], batch_size: int, pad_id: int, amp=None) -> tuple[float, int]:
    """(Σ −log p over target tokens, their count) of `tether.data.encode_sft` examples: the targets
    are the tokens after the first whose `completion_mask` is 1 (what the SFT loss trains on; the
    first token of a sequence has no prediction)."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for i in range(0, len(examples), batch_size):
            batch = pad_batch(examples[i:i + batch_size], pad_id)
            total -= float(sequence_logps(model, batch, amp).double().sum())
            count += int(batch["completion_mask"][:, 1:].sum())
    finally:
        model.train(was)
    return total, count
