"""The online trainer under torchrun: each rank holds a part of the step's batch (whole prompt
groups: `EpochSampler` hands it every world_size-th prompt), and these helpers give it what needs
the whole batch (tether/distributed.py: ranks are micro-batches).

- **Turns** (`turns`, `idle_turn`): a sharded forward (and backward) is collective, so every rank
  runs as many as the rank with the most; a rank with fewer runs forwards on a filler row that
  count for nothing. Ranks differ when rows are left out (zero advantages, dynamic sampling).
- **Rows** (`gather_rows`): per-sequence values (rewards, lengths, group ids) of every rank, for
  metrics that are means, extremes or group statistics over the batch: computed by the same code
  on the same numbers as one process (in another order: equal up to float rounding).
- **Whole-batch advantages** (`gather_for_advantages`): estimators normalised over the batch
  (REINFORCE++'s whitening, GRPO's scale=batch) are computed on every rank's rows; group-relative
  ones need only the rank's own groups.

Off torchrun every function hands its input back unchanged: one process computes exactly what it
computed before these existed.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from tether import distributed
from tether.models.logprobs import completion_token_logps


def every_rank(flag: bool) -> bool:
    """`flag` holds on every rank (one all-reduce; `flag` itself in one process)."""
    if not distributed.active():
        return flag
    return distributed.sum_floats([0.0 if flag else 1.0])[0] == 0


def turns(parts: list) -> list:
    """`parts` padded with None to the most any rank has: a None is a turn that counts for nothing
    (`idle_turn`), taken so the ranks' collective forwards pair up."""
    if not distributed.active():
        return parts
    most = int(distributed.max_float(len(parts)))
    return parts + [None] * (most - len(parts))


def idle_turn(model, filler: dict, temperature: float, amp, backward: bool) -> None:
    """A forward (and backward) of `model` on the one-row `filler` that changes nothing: the
    gradient is the loss times 0. A real sampled row, so its activations are finite (0 × a NaN
    gradient would not be 0)."""
    with torch.set_grad_enabled(backward):
        logps, _ = completion_token_logps(model, filler, temperature, amp)
        if backward:
            (logps.sum() * 0.0).backward()


def _pad_width(x: torch.Tensor, width: int, value) -> torch.Tensor:
    if x.dim() < 2 or x.shape[1] >= width:
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def gather_rows(x: torch.Tensor, value=0) -> torch.Tensor:
    """Every rank's rows of `x` [n, ...] one after the other, on every rank (rank order; [n, T]
    tensors right-padded with `value` to the widest rank's T). `x` itself in one process."""
    if distributed.active() and x.dim() >= 2:
        x = _pad_width(x, int(distributed.max_float(x.shape[1])), value)
    return distributed.cat_ranks(x)


def unique_groups(groups: torch.Tensor) -> torch.Tensor:
    """Group ids made distinct across ranks (each rank numbers its own groups from 0)."""
    if not distributed.active():
        return groups
    return groups + (distributed.rank() << 32)


def gather_for_advantages(rewards: torch.Tensor, groups: Optional[torch.Tensor], mask: torch.Tensor,
                          options: dict) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, dict,
                                                  Callable[[torch.Tensor], torch.Tensor]]:
    """An estimator's inputs (rewards [n] or [n, T], group ids, mask [n, T], per-row options such
    as greedy_rewards) over every rank's rows, and the function that takes this rank's rows (and
    width) back out of the estimator's output over them all."""
    width = mask.shape[1]
    counts = [int(c) for c in distributed.sum_floats(
        [len(rewards) if r == distributed.rank() else 0 for r in range(distributed.world_size())])]
    start = sum(counts[:distributed.rank()])
    per_row = {k: gather_rows(v) if isinstance(v, torch.Tensor) else v for k, v in options.items()}
    all_groups = None if groups is None else gather_rows(unique_groups(groups))

    def mine(advantages: torch.Tensor) -> torch.Tensor:
        out = advantages[start:start + len(rewards)]
        return out[:, :width] if out.dim() == 2 else out
    return gather_rows(rewards, 0.0), all_groups, gather_rows(mask, False), per_row, mine
