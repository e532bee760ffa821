"""Offline preference optimization: DPO (+ cDPO, rDPO, IPO, hinge, ...), KTO, SimPO, ORPO (docs/dpo.md).

The loop, top to bottom:
    setup_training: tokenizer -> pairs (or KTO's unpaired rows) read, validated and tokenized, errors
       before any model is loaded -> the policy (+ LoRA) -> run directory, optimizer, data order
    -> reference log-probs of every example, computed once and cached in the run directory: at
       step 0 the policy *is* the reference, so a fresh run needs no second model; a resumed run
       reads the cache (LoRA without a cache: the base with adapters disabled). SimPO and ORPO
       have no reference.
    -> for each optimizer step: draw a batch, split into micro-batches; chosen and rejected go
       through the policy in one concatenated forward; per-sequence log-probs -> the method's pure
       loss (tether.objectives.preference) -> backward; KTO first estimates its reference point
       z0 from mismatched prompt/completion pairs (no grad); clip, step (finite-checked)
    -> log (TRL's metric names) / held-out implicit-reward accuracy and sampled completions /
       checkpoint (exact resume).

Under torchrun (tether/distributed.py) each rank takes a block of every global batch; the losses are
means over rows, weighted by the global row count, and the logged numbers (loss, rewards, accuracies,
KTO's z0, held-out metrics) are computed on every rank's per-sequence numbers gathered back into
one process's order: what one process computes and logs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Callable, Literal, Optional

import torch

from tether import distributed
from tether.config import flat_init
from tether.constraints import NonNegative, Positive, PositiveInt, Range
from tether.errors import NonFiniteLossError
from tether.models.logprobs import packing_layout
from tether.objectives import PREFERENCE_LOSSES, PairLogps, kto_kl_reference_point
from tether.trainers.core.common import StepClock, guarded_step
from tether.trainers.core.held_out import check_keep_best
from tether.trainers.core.sections import DataSection, ModelSection, OptimSection, RunSection
from tether.trainers.core.setup import Data, releases_process_state, setup_training
from tether.trainers.preference.data import collate, collate_mismatched, kl_partners, load_offline_data
# train_step looks `objective` up in this module (a test patches offline.objective); PAIR_OBJECTIVES
# names PreferenceSection.method's choices
from tether.trainers.preference.objective import (DRIFT_WARNING, PAIR_OBJECTIVES, REFERENCE_FREE, UnpairedLogps,
                                                  concat, detached, gather_rows, objective, on_cpu, split_rows)
from tether.trainers.preference.reference import completion_logps, get_reference, training_forwards


@dataclass
class PreferenceSection:
    """The preference objective (tether.objectives.preference) and its numbers."""
    method: Literal[tuple(PAIR_OBJECTIVES)] = "dpo"
    "dpo (pairs, reference) | kto (unpaired labels, reference) | simpo, orpo (pairs, no reference)"
    loss: Literal[tuple(PREFERENCE_LOSSES)] = "sigmoid"
    "dpo only: which DPO-family loss (tether.objectives.PREFERENCE_LOSSES); sigmoid with label_smoothing > 0 = cDPO"
    beta: Positive = 0.1
    "β: DPO/IPO/hinge/KTO temperature, SimPO's reward scale, ORPO's λ (weight of the odds-ratio term)"
    label_smoothing: Annotated[float, Range(ge=0, lt=0.5)] = 0.0
    "ε: assumed label-flip rate for sigmoid (cDPO), robust (rDPO, < 0.5) and simpo"
    gamma_beta_ratio: NonNegative = 0.5
    "simpo only: target margin as γ/β (the paper's γ = gamma_beta_ratio · beta)"
    desirable_weight: Positive = 1.0
    "kto only: λ_D, weight of desirable examples"
    undesirable_weight: Positive = 1.0
    "kto only: λ_U, weight of undesirable examples"
    dpop_lambda: NonNegative = 50.0
    "loss=dpop only: λ, weight of the penalty on log π(y_w) falling below log π_ref(y_w) (Pal et al. 2024: 50)"
    rpo_alpha: NonNegative = 0.0
    "dpo only: α, weight of the chosen completion's per-token NLL added to the loss (RPO, Pang et al. 2024; TRL's rpo_alpha; the paper uses 1.0): holds the chosen log-probs up while the margin widens"
    chosen_drift_warn: NonNegative = 4.6
    "warn once when logps/chosen_drift (train or held-out) falls below minus this many nats (4.6: the chosen completions 100x less likely than at the start); 0 = never"
    ref_model: Optional[str] = None
    "reference model (default: the initial policy); only read when its log-probs are not cached"
    sample_max_new_tokens: PositiveInt = 64
    "tokens per completion sampled from held-out (else training) prompts (run.num_samples of them)"

    def __post_init__(self):
        if self.method not in PAIR_OBJECTIVES:
            raise ValueError(f"method must be one of {', '.join(PAIR_OBJECTIVES)}; got {self.method!r}")
        if self.rpo_alpha and self.method != "dpo":
            raise ValueError(f"rpo_alpha is added to the dpo losses only; method={self.method!r} "
                             f"(orpo has its own NLL term)")


@dataclass
class PreferenceDataSection(DataSection):
    """Preference pairs (prompt, chosen, rejected); kto also takes unpaired (prompt, completion, label)."""
    max_prompt_length: Optional[PositiveInt] = None
    "longest prompt in tokens (longer ones keep their end); null = only max_length applies"


def _optim(**overrides) -> OptimSection:
    return OptimSection(**{"lr": 1e-6, "schedule": "linear", "warmup_ratio": 0.1, **overrides})


def _run(name: str) -> RunSection:
    return RunSection(name=name, num_samples=2)  # samples are a peek at the policy: 2 keep evals cheap


@flat_init
@dataclass
class OfflineConfig:
    model: ModelSection = field(default_factory=ModelSection)
    "the policy to train (also the reference unless ref_model is set) and how it runs"
    data: PreferenceDataSection = field(default_factory=PreferenceDataSection)
    "training and held-out preference data, batch"
    optim: OptimSection = field(default_factory=_optim)
    "optimizer, schedule, length"
    run: RunSection = field(default_factory=lambda: _run("dpo"))
    "run directory, seed, logging, evaluation, checkpoints"
    preference: PreferenceSection = field(default_factory=PreferenceSection)
    "the preference objective"


# Presets: the four commands. Defaults follow the papers / TRL for real models.
@flat_init
@dataclass
class DPOConfig(OfflineConfig):
    pass


@flat_init
@dataclass
class KTOConfig(OfflineConfig):
    run: RunSection = field(default_factory=lambda: _run("kto"))
    preference: PreferenceSection = field(default_factory=lambda: PreferenceSection(method="kto"))


@flat_init
@dataclass
class SimPOConfig(OfflineConfig):
    run: RunSection = field(default_factory=lambda: _run("simpo"))
    # SimPO paper: β ∈ [2, 10], γ/β ∈ [0.3, 0.8]; TRL's CPO simpo default 2 / 0.5
    preference: PreferenceSection = field(default_factory=lambda: PreferenceSection(method="simpo", beta=2.0))


@flat_init
@dataclass
class ORPOConfig(OfflineConfig):
    optim: OptimSection = field(default_factory=lambda: _optim(lr=8e-6))  # from the base, as in the paper
    run: RunSection = field(default_factory=lambda: _run("orpo"))
    # β is ORPO's λ, the weight of the odds-ratio term (Hong et al. 2024)
    preference: PreferenceSection = field(default_factory=lambda: PreferenceSection(method="orpo", beta=0.1))


# ---- one optimizer step ---------------------------------------------------------------------------

def train_step(cfg, model, optimizer, scheduler, micro: list[list[dict]], paired: bool,
               reference: Optional[dict], pad_id: int, device, amp,
               kl_pool: Optional[list[dict]] = None, partners: Optional[list[int]] = None,
               step: Optional[Callable[[float], float]] = None) -> dict:
    """Forward/backward every micro-batch, then one guarded optimizer step (`step(loss)`, default
    common.guarded_step on `optimizer`; the trainer passes Training.guarded_step, which counts
    refusals). Returns the metrics (loss, method metrics, grad_norm, tokens) or raises
    NonFiniteLossError (step skipped).

    Under torchrun `micro` is this rank's part of the global batch (ranks are micro-batches,
    distributed.py): every loss here is a mean over rows, so each micro-batch's is weighted by its
    rows over the *global* batch's, and the logged loss, the metrics and KTO's reference point are
    computed on the whole batch's per-sequence numbers, gathered from every rank."""
    n_total = int(distributed.sum_floats([sum(len(rows) for rows in micro)])[0])
    packing = packing_layout(model, cfg.data.packing)
    z0 = None
    if cfg.preference.method == "kto":
        # Reference point from mismatched pairs under the current policy, no grad (it is detached
        # in the loss anyway): a mean over the global batch, so every rank's rows go into it (a
        # rank's own mean would give each rank another z0, and the loss another value).
        with torch.no_grad():
            kl = torch.cat([completion_logps(model, collate_mismatched(rows, kl_pool, partners, pad_id,
                                                                       cfg.data.max_length, packing),
                                             device, amp)[0]
                            for rows in micro])
        ref_kl = reference["train.kl"][torch.tensor([ex["idx"] for rows in micro for ex in rows])].to(device)
        z0 = kto_kl_reference_point(distributed.cat_ranks(kl), distributed.cat_ranks(ref_kl))
    inputs, tokens = [], 0
    for rows in distributed.accumulation(model, micro):
        batch = collate(rows, paired, pad_id, packing)
        tokens += int(batch["attention_mask"].sum())
        x = split_rows(paired, rows, *completion_logps(model, batch, device, amp), reference, "train")
        loss, _ = objective(cfg, x, z0)
        # batch-mean losses: weight each micro-batch by its share, so accumulation = one big batch
        (loss * (len(rows) / n_total)).backward()
        inputs.append(detached(x))
    loss, metrics = objective(cfg, gather_rows(concat(inputs)), z0)
    # the loss and every metric to Python in one transfer (one sync, not one per number)
    loss, *values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=loss.device).reshape(())
                                 for v in (loss.detach(), *metrics.values())]).tolist()
    grad_norm = step(loss) if step is not None else \
        guarded_step(model, optimizer, scheduler, cfg.optim.max_grad_norm, loss)
    return {"loss": loss, **dict(zip(metrics, values)), "grad_norm": grad_norm,
            "tokens": int(distributed.sum_floats([tokens])[0])}


# ---- evaluation: held-out metrics, sampled completions -------------------------------------------

@torch.no_grad()
def evaluate_preferences(cfg, model, examples: list[dict], paired: bool, reference, pad_id, device,
                         amp) -> dict:
    """Held-out metrics over the whole eval set: implicit-reward accuracy and margins (unpaired
    rows: reward means per label; z0 does not enter them). Under torchrun each rank scores a share
    of the batches (distributed.rank_share) and the metrics are computed on all of them, put back
    in order: the numbers one process computes, also where the ranks' shares differ in size."""
    was = model.training
    model.eval()
    batch_size = cfg.data.batch_size
    packing = packing_layout(model, cfg.data.packing)
    mine = []
    for chunk in distributed.rank_share(examples, batch_size):
        # None: a forward that counts for nothing (sharded forwards are collective)
        rows = chunk if chunk is not None else examples[:batch_size]
        logps, lengths = completion_logps(model, collate(rows, paired, pad_id, packing), device, amp)
        if chunk is not None:
            mine.append(on_cpu(split_rows(paired, chunk, logps, lengths, reference, "eval")))
    parts = distributed.rank_unshare(mine, -(-len(examples) // batch_size))
    model.train(was)
    loss, m = objective(cfg, concat(parts), 0.0)
    m.pop("kl", None)
    return {"eval/loss": float(loss), **{f"eval/{k}": float(v) for k, v in m.items()}}


def eval_metric_names(cfg) -> set[str]:
    """The names :func:`evaluate_preferences` logs for this method: its objective's metrics on two
    made-up pairs (and, for KTO, whose held-out rows may be unpaired, on two labelled rows)."""
    logps, lengths = torch.tensor([-1.0, -2.0]), torch.tensor([2, 3])
    ref = None if cfg.preference.method in REFERENCE_FREE else logps - 0.5
    names = set(objective(cfg, PairLogps(logps, logps - 1, ref, None if ref is None else ref - 1,
                                         lengths, lengths), 0.0)[1])
    if cfg.preference.method == "kto":
        names |= set(objective(cfg, UnpairedLogps(logps, torch.tensor([True, False]), logps - 0.5), 0.0)[1])
    return {"eval/loss"} | {f"eval/{k}" for k in names - {"kl"}}


def distinct_prompts(examples: list[dict], count: int) -> list[list[int]]:
    """The first `count` distinct prompts (token ids) of `examples`, to sample completions from."""
    prompts: list[list[int]] = []
    for ex in examples:
        if len(prompts) == count:
            break
        if ex["prompt_ids"] not in prompts:
            prompts.append(ex["prompt_ids"])
    return prompts


# ---- the run -------------------------------------------------------------------------------------

@releases_process_state
def train_offline(cfg: OfflineConfig) -> dict:
    """Run DPO / KTO / SimPO / ORPO per `cfg`; returns the summary (also written to summary.json),
    whose `model` is the final checkpoint's path (the adapter's under LoRA)."""
    method = cfg.preference.method
    check_keep_best(cfg, eval_metric_names(cfg), held_out=bool(cfg.data.eval_data or cfg.data.eval_fraction > 0))

    def load(tokenizer):
        train, held_out, paired, eval_paired, report = load_offline_data(cfg, tokenizer)
        return Data(train, held_out, report, {"paired": paired, "eval_paired": eval_paired})
    t = setup_training(cfg, load)
    # Under torchrun a rank's rows are a block of the global batch: when it holds whole micro-batches
    # (grad_accum a multiple of the processes), the ranks run exactly one process's forwards, so the
    # reference cache is one process's and step 1's log-ratios are exactly 0 on any hardware.
    t.order.contiguous = True
    model, tokenizer, device, amp = t.model, t.tokenizer, t.device, t.amp
    pad_id, batch_size = tokenizer.pad_token_id, cfg.data.batch_size
    paired, eval_paired = t.data.extra["paired"], t.data.extra["eval_paired"]

    reference, reference_from = None, "none (reference-free)"
    if method not in REFERENCE_FREE:
        reference, reference_from = get_reference(
            cfg, t.run.path, model, t.ckpt is None, {"train": t.data.train, "eval": t.data.eval},
            {"train": paired, "eval": eval_paired}, pad_id, device, amp,
            forwards={"train": training_forwards(t.order, len(t.data.train), batch_size)})
    partners = kl_partners(len(t.data.train)) if method == "kto" else None
    if reference is not None and cfg.preference.chosen_drift_warn > 0:
        t.watch("chosen_drift", ("logps/chosen_drift", "eval/logps/chosen_drift"),
                -cfg.preference.chosen_drift_warn, DRIFT_WARNING)

    def evaluate() -> dict:
        out = {}
        if t.data.eval:
            out = evaluate_preferences(cfg, model, t.data.eval, eval_paired, reference, pad_id, device, amp)
        prompts = distinct_prompts(t.data.eval or t.data.train, cfg.run.num_samples)
        completions = t.sample(prompts, cfg.preference.sample_max_new_tokens)
        t.add_samples([{"prompt": tokenizer.decode(p, skip_special_tokens=True), "completion": c}
                       for p, c in zip(prompts, completions)])
        return out

    # Logged metrics are means over the steps since the last row: t.window, which the checkpoint
    # keeps, so a resume inside a window logs what an uninterrupted run logs. The clock only times
    # the window (throughput is wall-clock, never resume-exact).
    clock, last = StepClock(), {}
    while t.step < t.total_steps:
        rows = [t.data.train[j] for j in t.order.next()]
        micro = [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
        try:
            out = train_step(cfg, model, t.optimizer, t.scheduler, micro, paired, reference, pad_id,
                             device, amp, kl_pool=t.data.train, partners=partners, step=t.guarded_step)
        except NonFiniteLossError:  # refused by guarded_step (and counted): nothing reached the weights
            out = {"loss": math.nan, "grad_norm": math.nan, "tokens": 0}
        t.step += 1
        clock.tick(tokens=out.pop("tokens"))
        t.window.add(out)
        last = out
        if t.log_due():
            t.log({**t.window.means(), "lr": t.lr, "epoch": t.order.epoch, "skipped_steps": t.skipped,
                   **clock.lap()})
            t.window.reset()
        if t.due(cfg.run.eval_every):
            t.log_eval(evaluate())
        if t.due(cfg.run.save_every):
            t.checkpoint()
        t.bar.update({"loss": out["loss"], "acc": out.get("rewards/accuracies", math.nan),
                      **({"drift": out["logps/chosen_drift"]} if "logps/chosen_drift" in out else {}),
                **t.eval_shown})

    final_eval = evaluate()
    t.log_eval(final_eval)
    return t.finish({
        "method": method, "loss_type": cfg.preference.loss if method == "dpo" else method,
        "train_examples": len(t.data.train), "eval_examples": len(t.data.eval),
        "final_loss": last.get("loss"), "reference": reference_from, "data": t.data.report,
        "model": str(t.run.checkpoint_dir(t.step)),  # the checkpoint finish() writes
        "train": {k: v for k, v in last.items() if k.startswith(("rewards/", "logps/", "kl"))},
        **final_eval})
