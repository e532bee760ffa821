"""What a training loop asks of all its ranks together under torchrun, as methods of `Training`
(setup.py): ranks are micro-batches of one batch (tether/distributed.py), and these give a rank
what needs the whole batch.

- **Turns** (`turns`, `idle_turn`): a sharded forward (and backward) is collective, so every rank
  runs as many as the rank with the most; a rank with fewer runs forwards on a filler row that
  count for nothing. Ranks differ when rows are left out (zero advantages, dynamic sampling).
- **Rows** (`gather_rows`, `unique_groups`): per-sequence values (rewards, lengths, group ids) of
  every rank, for metrics that are means, extremes or group statistics over the batch: computed
  by the same code on the same numbers as one process (in another order: equal up to float
  rounding).
- **Sums** (`sum_over_ranks`, `sum_in_rank_order`, `every_rank`): counts and metric sums of every
  rank, and whether a condition holds on all of them.

Off torchrun every method hands its input back unchanged: one process computes exactly what it
computes without them.
"""

from __future__ import annotations

import torch

from tether import distributed
from tether.models.logprobs import completion_token_logps


def pad_width(x: torch.Tensor, width: int, value) -> torch.Tensor:
    """`x` [n, T, ...] right-padded with `value` to `width` columns (unchanged if it has as many)."""
    if x.dim() < 2 or x.shape[1] >= width:
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def add_up(parts: list, out: dict | None = None) -> dict:
    """Dicts of floats (or of such dicts) added key by key, in list order, each key from 0.0."""
    out = {} if out is None else out
    for part in parts:
        for k, v in part.items():
            if isinstance(v, dict):
                out[k] = add_up([v], out.get(k, {}))
            else:
                out[k] = out.get(k, 0.0) + v
    return out


class Ranks:
    """The rank idioms of a loop (module doc); `Training` has them. Needs `model` and `amp`."""
    model: torch.nn.Module
    amp: object

    def every_rank(self, flag: bool) -> bool:
        """`flag` holds on every rank (one all-reduce; `flag` itself in one process)."""
        if not distributed.active():
            return flag
        return distributed.sum_floats([0.0 if flag else 1.0])[0] == 0

    def turns(self, parts: list) -> list:
        """`parts` padded with None to the most any rank has: a None is a turn that counts for
        nothing (`idle_turn`), taken so the ranks' collective forwards pair up."""
        if not distributed.active():
            return parts
        most = int(distributed.max_float(len(parts)))
        return parts + [None] * (most - len(parts))

    def idle_turn(self, filler: dict, temperature: float, backward: bool) -> None:
        """A forward (and backward) of the model on the one-row `filler` that changes nothing: the
        gradient is the loss times 0. A real sampled row, so its activations are finite (0 × a NaN
        gradient would not be 0)."""
        with torch.set_grad_enabled(backward):
            logps, _ = completion_token_logps(self.model, filler, temperature, self.amp)
            if backward:
                (logps.sum() * 0.0).backward()

    def gather_rows(self, x: torch.Tensor, value=0) -> torch.Tensor:
        """Every rank's rows of `x` [n, ...] one after the other, on every rank (rank order; [n, T]
        tensors right-padded with `value` to the widest rank's T). `x` itself in one process."""
        if distributed.active() and x.dim() >= 2:
            x = pad_width(x, int(distributed.max_float(x.shape[1])), value)
        return distributed.cat_ranks(x)

    def unique_groups(self, groups: torch.Tensor) -> torch.Tensor:
        """Group ids made distinct across ranks (each rank numbers its own groups from 0)."""
        if not distributed.active():
            return groups
        return groups + (distributed.rank() << 32)

    def sum_over_ranks(self, values: dict) -> dict:
        """Each value summed over the ranks (float64, one all-reduce; the same keys in the same
        order on every rank). `values` itself in one process."""
        if not distributed.active():
            return values
        return distributed.sum_dict(values)

    def sum_in_rank_order(self, values: dict) -> dict:
        """Every rank's `values` (floats, or dicts of floats) added key by key in rank order, so
        every rank gets the same floats; a key a rank lacks (a rank with nothing to train on
        logged no metric) counts 0 there. `values` itself in one process."""
        if not distributed.active():
            return values
        return add_up(distributed.all_gather_object(values))
