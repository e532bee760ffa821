"""Dense per-step rewards for PPO from a process reward model (`ppo.process_reward=true`).

With a `prm:<run>` reward and process_reward on, the PRM's part of the reward is not one score at
the completion's last token but one per step, at the step's last token (Wang et al. 2024,
Math-Shepherd §3.3, "step-by-step PPO"; Lightman et al. 2023 use the PRM for selection only):

    r̃_t = w·Σ_i 1[t = t_i]·p_i + 1[t = last]·R_other − β·KL_t

p_i = P(step i correct) from the PRM (tether.rewards.process), t_i = the completion token that
completes step i's text (its separator; the last step: the last token), w = the PRM's weight,
R_other = the weighted score of the other reward functions. GAE then carries each step's reward
back over the tokens that wrote it.
"""

from __future__ import annotations

import torch

from tether.errors import UserError
from tether.rewards.process import ProcessReward


def process_reward_index(funcs) -> int:
    """The position of the one PRM among the reward functions (refused otherwise)."""
    found = [j for j, f in enumerate(funcs) if isinstance(f, ProcessReward)]
    if len(found) != 1:
        raise UserError(f"ppo: process_reward=true needs exactly one 'prm:<run>' reward; found {len(found)}")
    return found[0]


def step_end_tokens(tokenizer, ids: list[int], steps: list[str], separator: str) -> list[int]:
    """For each step, the index of the completion token whose text completes the step and its
    separator (the decoded text's length reaches the step's end); the last step, and any step
    ending past the text (the appended separator), get the last token."""
    lengths, total = [], 0
    for token in ids:  # per-token decoding: exact for character and most BPE vocabularies
        total += len(tokenizer.decode([token], skip_special_tokens=True))
        lengths.append(total)
    out, end = [], 0
    for step in steps:
        end += len(step) + len(separator)
        out.append(next((t for t, n in enumerate(lengths) if n >= end), len(ids) - 1))
    out[-1] = len(ids) - 1
    return out


def dense_process_rewards(prm: ProcessReward, weight: float, rows: list[dict], rollout, width: int,
                          tokenizer) -> torch.Tensor:
    """[N, width] per-token PRM rewards aligned with rollout.training_batch(multiple)'s input_ids:
    the rollout's `prompt_width` prompt columns (left-padded prompts), its T completion columns,
    then the right padding up to `width`. `tokenizer`: the policy's, which wrote the completion ids."""
    from tether.data.steps import split_steps

    probs = prm.step_probabilities([r["prompt"] for r in rows], rollout.texts)
    ids, mask = rollout.completion_ids.cpu(), rollout.completion_mask.cpu()
    dense = torch.zeros(len(rows), ids.shape[1])
    for b, (text, p) in enumerate(zip(rollout.texts, probs)):
        own = ids[b][mask[b]].tolist()
        if not own:
            continue
        ends = step_end_tokens(tokenizer, own, split_steps(text, prm.separator)[:len(p)], prm.separator)
        for t, value in zip(ends, p.tolist()):
            dense[b, t] += weight * value
    P = rollout.prompt_width
    return torch.cat([torch.zeros(len(rows), P), dense, torch.zeros(len(rows), width - P - ids.shape[1])], 1)
