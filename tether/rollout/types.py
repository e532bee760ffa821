"""What a sampling call returns, and the metric that compares its log-probs with a training forward."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor


# GRPO's and PPO's training batch width (prompt + completion) is rounded up to a multiple of this
# (Rollout.training_batch(SEQ_MULTIPLE)). Each step's longest completion differs, and on CUDA every
# new width costs the step once more (SmolLM2-135M on an H200, compiled layers: ~0.15 s on the
# first step of each new width — 0.27 s instead of 0.12 — on about half the steps): 16
# leaves a run a handful of widths for < 16 padded tokens a row.
SEQ_MULTIPLE = 16


@dataclass
class Rollout:
    """N = len(prompts) * n sequences, prompt-major (sequence i is sample i % n of prompt i // n).

    Completion tensors are right-padded to the longest completion; ``logprobs`` are 0 where
    ``completion_mask`` is 0. A completion includes its final EOS token (or the token that completed
    a stop string); ``texts`` decode exactly ``completion_ids[i][completion_mask[i]]`` with special
    tokens skipped, so rewards computed on the text belong to the tokens being trained.
    """

    prompt_ids: list[list[int]]
    "per sequence: the prompt's token ids (BOS included)"
    completion_ids: Tensor
    "[N, T] int64, right-padded with pad_token_id"
    completion_mask: Tensor
    "[N, T] bool, True on generated tokens"
    logprobs: Tensor
    "[N, T] float32: log softmax(z / logprob_temperature)[token] over the full vocabulary"
    texts: list[str]
    "decoded completions (empty strings when the sampler has no tokenizer)"
    finish_reasons: list[str]
    "'eos' (an end token), 'stop' (a stop string) or 'length' (max_new_tokens)"
    group: Tensor
    "[N] int64: index of each sequence's prompt"
    logprob_temperature: float
    "temperature of the distribution ``logprobs`` belong to (1.0 for greedy decoding)"
    pad_token_id: int = 0
    stats: dict = field(default_factory=dict)
    "timings: prefill_s, decode_s, capture_s, total_s, decode_steps, ms_per_step, tokens, tokens_per_s, ..."
    observation_mask: Optional[Tensor] = None
    "[N, T] bool, True on tokens an environment wrote between the model's turns (multi-turn episodes: Sampler.sample(episodes=...)); attended to, never trained on; None for single-turn rollouts"
    episodes: Optional[list] = None
    "multi-turn episodes: per sequence, what the episode loop recorded (messages, turns, tool calls, rewards)"
    versions: Optional[Tensor] = None
    "[N, T] int64: the policy version that sampled each token (-1 at padding); set by partial rollouts (trajectories/partial.py), whose completions may span weight updates"

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def completion_lists(self) -> list[list[int]]:
        """Each row's completion token ids (its mask's positions) as a list, from one copy to the
        CPU: indexing GPU rows one by one costs two device syncs each (~25 ms of a 256-row batch's
        scoring on an H100, on the sampler's critical path)."""
        ids, mask = self.completion_ids.cpu().tolist(), self.completion_mask.cpu().tolist()
        return [[t for t, keep in zip(row, m) if keep] for row, m in zip(ids, mask)]

    @property
    def prompt_width(self) -> int:
        """P: the columns training_batch gives the (left-padded) prompts; the completions follow."""
        return max(map(len, self.prompt_ids), default=0)

    @property
    def lengths(self) -> Tensor:
        """The model's tokens per sequence (multi-turn: every turn's, the environment's excluded)."""
        return self.completion_mask.sum(-1)

    @property
    def token_mask(self) -> Tensor:
        """[N, T] True on every real completion token: the model's and, in multi-turn episodes, the
        environment's (what a training forward attends to; the loss takes ``completion_mask``)."""
        if self.observation_mask is None:
            return self.completion_mask
        return self.completion_mask | self.observation_mask

    def training_batch(self, multiple: int = 1) -> dict[str, Tensor]:
        """Prompt + completion as one left-padded batch for the trainer's forward pass, its width
        P + T padded on the right up to a multiple of `multiple` (padding: masked everywhere).

        ``input_ids``, ``attention_mask``, ``position_ids`` [N, P + T]: pass all three to the model
        (HF derives positions from the mask only inside ``generate``; without ``position_ids`` a
        left-padded row is shifted and its log-probs no longer match the sampler's).
        ``completion_mask`` and ``logprobs`` are aligned with ``input_ids`` — the convention of
        ``tether.objectives.logprobs.token_logps`` — so
        ``token_logps(model(...).logits, input_ids, rollout.logprob_temperature)`` at the mask equals
        ``logprobs`` up to the training–inference mismatch.
        """
        N, T = self.completion_ids.shape
        P = self.prompt_width
        extra = -(P + T) % multiple  # right padding: no real position attends to it (causal)
        prompt = torch.full((N, P), self.pad_token_id, dtype=torch.long)
        pmask = torch.zeros((N, P), dtype=torch.bool)
        for i, ids in enumerate(self.prompt_ids):
            prompt[i, P - len(ids):] = torch.tensor(ids, dtype=torch.long)
            pmask[i, P - len(ids):] = True
        dev = self.completion_ids.device
        pad = torch.nn.functional.pad
        completion_ids = pad(self.completion_ids, (0, extra), value=self.pad_token_id)
        completion_mask, logprobs = pad(self.completion_mask, (0, extra)), pad(self.logprobs, (0, extra))
        input_ids = torch.cat([prompt.to(dev), completion_ids], 1)
        attention_mask = torch.cat([pmask.to(dev), pad(self.token_mask, (0, extra))], 1)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        zeros = torch.zeros((N, P), dtype=torch.bool, device=dev)
        return {"input_ids": input_ids, "attention_mask": attention_mask.long(),
                "position_ids": position_ids,
                "completion_mask": torch.cat([zeros, completion_mask], 1),
                "logprobs": torch.cat([zeros.float(), logprobs], 1)}


@torch.no_grad()
def logprob_mismatch(rollout_logps: Tensor, train_logps: Tensor, mask: Tensor) -> dict[str, float]:
    """Training–inference mismatch of per-token log-probs (log this every RL step).

    ``rollout_logps`` from the sampler, ``train_logps`` from the trainer's forward over the same
    tokens at the same temperature, ``mask`` selecting completion tokens (all three the same shape).
    Returns the mean / p99 / max of |Δ| and the importance ratio exp(train − rollout), under TRL's
    metric names (``sampling/sampling_logp_difference/*``, ``sampling/importance_sampling_ratio/*``).
    """
    m = mask.bool()
    d = (train_logps.detach().float() - rollout_logps.detach().float())[m]
    if d.numel() == 0:
        return {}
    a = d.abs()
    r = d.exp()
    k = max(1, math.ceil(0.99 * a.numel()))  # (torch.quantile refuses more than 2^24 elements)
    p99 = a.cpu().kthvalue(k).values.item()
    return {"sampling/sampling_logp_difference/mean": a.mean().item(),
            "sampling/sampling_logp_difference/p99": p99,
            "sampling/sampling_logp_difference/max": a.max().item(),
            "sampling/importance_sampling_ratio/min": r.min().item(),
            "sampling/importance_sampling_ratio/mean": r.mean().item(),
            "sampling/importance_sampling_ratio/max": r.max().item()}
