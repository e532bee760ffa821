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
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Annotated, Callable, Literal, Optional

import torch
from torch import Tensor

from tether.config import flat_init
from tether.constraints import NonNegative, Positive, PositiveInt, Range
from tether.errors import NonFiniteLossError
from tether.objectives import (PREFERENCE_LOSSES, PairLogps, kto_kl_reference_point, kto_loss,
                               orpo_loss, pairwise_preference_loss, simpo_loss)
from tether.trainers.common import StepClock, guarded_step
from tether.trainers.offline_data import collate, collate_mismatched, kl_partners, load_offline_data
from tether.trainers.offline_reference import completion_logps, get_reference, training_forwards
from tether.trainers.sections import DataSection, ModelSection, OptimSection, RunSection
from tether.trainers.setup import Data, setup_training


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


# ---- the objective: per-sequence numbers -> the method's pure loss ---------------------------------

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


def _concat(parts: list):
    """A step's inputs from its micro-batches' (the loss metrics are over the whole batch)."""
    return dataclasses.replace(parts[0], **{k: torch.cat([getattr(p, k) for p in parts])
                                            for k in _tensors(parts[0])})


# ---- one optimizer step ---------------------------------------------------------------------------

def train_step(cfg, model, optimizer, scheduler, micro: list[list[dict]], paired: bool,
               reference: Optional[dict], pad_id: int, device, amp,
               kl_pool: Optional[list[dict]] = None, partners: Optional[list[int]] = None,
               step: Optional[Callable[[float], float]] = None) -> dict:
    """Forward/backward every micro-batch, then one guarded optimizer step (`step(loss)`, default
    common.guarded_step on `optimizer`; the trainer passes Training.guarded_step, which counts
    refusals). Returns the metrics (loss, method metrics, grad_norm, tokens) or raises
    NonFiniteLossError (step skipped)."""
    n_total = sum(len(rows) for rows in micro)
    z0 = None
    if cfg.preference.method == "kto":
        # Reference point from mismatched pairs under the current policy, no grad (it is detached
        # in the loss anyway). Under data parallelism this mean would be all-reduced across ranks.
        with torch.no_grad():
            kl = torch.cat([completion_logps(model, collate_mismatched(rows, kl_pool, partners, pad_id,
                                                                       cfg.data.max_length), device, amp)[0]
                            for rows in micro])
        ref_kl = reference["train.kl"][torch.tensor([ex["idx"] for rows in micro for ex in rows])].to(device)
        z0 = kto_kl_reference_point(kl, ref_kl)
    inputs, tokens = [], 0
    for rows in micro:
        batch = collate(rows, paired, pad_id)
        tokens += int(batch["attention_mask"].sum())
        x = split_rows(paired, rows, *completion_logps(model, batch, device, amp), reference, "train")
        loss, _ = objective(cfg, x, z0)
        # batch-mean losses: weight each micro-batch by its share, so accumulation = one big batch
        (loss * (len(rows) / n_total)).backward()
        inputs.append(dataclasses.replace(x, **{k: v.detach() for k, v in _tensors(x).items()}))
    loss, metrics = objective(cfg, _concat(inputs), z0)
    loss = float(loss)
    grad_norm = step(loss) if step is not None else \
        guarded_step(model, optimizer, scheduler, cfg.optim.max_grad_norm, loss)
    return {"loss": loss, **{k: float(v) for k, v in metrics.items()}, "grad_norm": grad_norm,
            "tokens": tokens}


# ---- evaluation: held-out metrics, sampled completions -------------------------------------------

@torch.no_grad()
def evaluate_preferences(cfg, model, examples: list[dict], paired: bool, reference, pad_id, device,
                         amp) -> dict:
    """Held-out metrics over the whole eval set: implicit-reward accuracy and margins (unpaired
    rows: reward means per label; z0 does not enter them)."""
    was = model.training
    model.eval()
    parts, batch_size = [], cfg.data.batch_size
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        logps, lengths = completion_logps(model, collate(chunk, paired, pad_id), device, amp)
        parts.append(split_rows(paired, chunk, logps, lengths, reference, "eval"))
    model.train(was)
    loss, m = objective(cfg, _concat(parts), 0.0)
    m.pop("kl", None)
    return {"eval/loss": float(loss), **{f"eval/{k}": float(v) for k, v in m.items()}}


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

def train_offline(cfg: OfflineConfig) -> dict:
    """Run DPO / KTO / SimPO / ORPO per `cfg`; returns the summary (also written to summary.json),
    whose `model` is the final checkpoint's path (the adapter's under LoRA)."""
    method = cfg.preference.method

    def load(tokenizer):
        train, held_out, paired, eval_paired, report = load_offline_data(cfg, tokenizer)
        return Data(train, held_out, report, {"paired": paired, "eval_paired": eval_paired})
    t = setup_training(cfg, load)
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
            t.log(evaluate())
        if t.due(cfg.run.save_every):
            t.checkpoint()
        t.bar.update({"loss": out["loss"], "acc": out.get("rewards/accuracies", math.nan),
                      **({"drift": out["logps/chosen_drift"]} if "logps/chosen_drift" in out else {})})

    final_eval = evaluate()
    t.log(final_eval)
    return t.finish({
        "method": method, "loss_type": cfg.preference.loss if method == "dpo" else method,
        "train_examples": len(t.data.train), "eval_examples": len(t.data.eval),
        "final_loss": last.get("loss"), "reference": reference_from, "data": t.data.report,
        "model": str(t.run.checkpoint_dir(t.step)),  # the checkpoint finish() writes
        "train": {k: v for k, v in last.items() if k.startswith(("rewards/", "logps/", "kl"))},
        **final_eval})
