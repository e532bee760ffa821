"""The offline trainer's objective: one batch's per-sequence log-probs -> the method's pure loss
(tether.objectives.preference) and its metrics, under TRL's metric names (docs/dpo.md).

A step's metrics are this module's functions of the *whole* batch's per-sequence numbers (under
torchrun gathered from every rank first: `gather_rows`), so they are what one process computes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from tether import distributed
from tether.objectives import PairLogps, kto_loss, orpo_loss, pairwise_preference_loss, simpo_loss


@dataclass(frozen=True)
class UnpairedLogps:
    """KTO's per-row inputs [N]: the policy's summed completion log-probs, the labels (True =
    desirable) and the reference's log-probs."""
    completion: Tensor
    label: Tensor
    ref_completion: Optional[Tensor] = None


def _simpo(x: PairLogps, s):
    avg = x.length_averaged()
    return simpo_loss(avg.chosen, avg.rejected, s.beta, s.gamma_beta_ratio * s.beta, s.label_smoothing)


def _orpo(x: PairLogps, s):
    # the SFT term is the chosen answer's NLL as a per-sequence token mean (Hong et al. 2024, eq. 6)
    avg = x.length_averaged()
    loss, m = orpo_loss(avg.chosen, avg.rejected, -avg.chosen, s.beta)
    return loss, {**m, "rewards/margins": m["rewards/chosen"] - m["rewards/rejected"]}


PAIR_OBJECTIVES = {  # method -> (pairs, the preference section) -> (loss, metrics)
    "dpo": lambda x, s: pairwise_preference_loss(x, s.loss, s),
    # KTO trains on unpaired rows (kto_objective); held-out pairs are scored with DPO's implicit
    # reward, so accuracy and margins compare across methods
    "kto": lambda x, s: pairwise_preference_loss(x, "sigmoid", s),
    "simpo": _simpo,
    "orpo": _orpo,
}
REFERENCE_FREE = ("simpo", "orpo")


def kto_objective(x: UnpairedLogps, s, z0):
    """KTO on unpaired rows, logged with the pairwise methods' metric names. Its own path: a row is
    one completion and a label, and the loss needs the batch's reference point z0, so it is not a
    function of one pair's log-probs."""
    loss, m = kto_loss(x.completion, x.ref_completion, x.label, z0, s.beta, s.desirable_weight,
                       s.undesirable_weight)
    desirable, logps = x.label, x.completion.detach()
    m = {**m, "logps/chosen": logps[desirable].mean(), "logps/rejected": logps[~desirable].mean(),
         "rewards/margins": m["rewards/chosen"] - m["rewards/rejected"],
         "logps/chosen_drift": chosen_drift(x.completion[desirable], x.ref_completion[desirable])}
    # a group absent from the batch has no mean: drop it rather than log a fake 0
    for side in ("chosen", "rejected"):
        if int(m[f"count/{side}"]) == 0:
            for k in (f"rewards/{side}", f"logps/{side}", "rewards/margins", f"logps/{side}_drift"):
                m.pop(k, None)
    return loss, m


def chosen_drift(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """`logps/chosen_drift`: mean over the chosen completions of log π(y_w|x) − log π_ref(y_w|x),
    summed over tokens (nats), i.e. how far their log-probs moved since training started (the
    reference is the initial policy unless ref_model is set): exactly 0 at step 1, and free of the
    batch-to-batch spread of `logps/chosen` itself. A DPO-family loss can widen the margin while
    this falls; far below 0, held-out quality tends to go with it (preference.chosen_drift_warn)."""
    return (logps - ref_logps).detach().mean()


DRIFT_WARNING = ("step {step}: {key} = {value:.2f} nats (below {floor:g}): the chosen completions are "
                 "now far less likely than at the start, however healthy rewards/accuracies looks; "
                 "held-out quality may be collapsing. Counter it with preference.rpo_alpha=1 (NLL on "
                 "the chosen completions), loss=dpop, or a lower lr")


def objective(cfg, x: PairLogps | UnpairedLogps, z0=None):
    """The method's loss and metrics on one batch's per-sequence log-probs."""
    if isinstance(x, UnpairedLogps):
        return kto_objective(x, cfg.preference, z0)
    loss, m = PAIR_OBJECTIVES[cfg.preference.method](x, cfg.preference)
    m.setdefault("logps/chosen", x.chosen.detach().mean())
    m.setdefault("logps/rejected", x.rejected.detach().mean())
    if x.ref_chosen is not None:  # reference-free methods (simpo, orpo) have no starting point
        m["logps/chosen_drift"] = chosen_drift(x.chosen, x.ref_chosen)
    return loss, m


def split_rows(paired: bool, examples: list[dict], logps, lengths, reference: Optional[dict],
               split: str) -> PairLogps | UnpairedLogps:
    """One forward's per-sequence tensors (pairs: [chosen rows; rejected rows]) as the objective's
    inputs, with the cached reference log-probs of the same examples."""
    idx = torch.tensor([ex["idx"] for ex in examples])

    def ref(key: str):
        return None if reference is None else reference[f"{split}.{key}"][idx].to(logps.device)
    if paired:
        n = len(examples)
        return PairLogps(logps[:n], logps[n:], ref("chosen"), ref("rejected"), lengths[:n], lengths[n:])
    labels = torch.tensor([ex["label"] for ex in examples], device=logps.device)
    return UnpairedLogps(logps, labels, ref("completion"))


def _tensors(x) -> dict:
    return {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if getattr(x, f.name) is not None}


def concat(parts: list):
    """A step's inputs from its micro-batches' (the loss metrics are over the whole batch)."""
    return dataclasses.replace(parts[0], **{k: torch.cat([getattr(p, k) for p in parts])
                                            for k in _tensors(parts[0])})


def detached(x):
    """`x` with every tensor detached (what a step keeps of a micro-batch for its metrics)."""
    return dataclasses.replace(x, **{k: v.detach() for k, v in _tensors(x).items()})


def gather_rows(x):
    """`x` (one rank's per-sequence numbers) extended to every rank's rows, in rank order: with
    ranks holding consecutive blocks of a batch (EpochSampler(contiguous=True)), the batch as one
    process holds it. `x` itself in one process (collective)."""
    if not distributed.active():
        return x
    return dataclasses.replace(x, **{k: distributed.cat_ranks(v) for k, v in _tensors(x).items()})


def on_cpu(x):
    """`x` with its tensors on the CPU, to travel between ranks (unchanged in one process)."""
    if not distributed.active():
        return x
    return dataclasses.replace(x, **{k: v.cpu() for k, v in _tensors(x).items()})
