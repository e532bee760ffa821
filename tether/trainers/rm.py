"""Reward model: Bradley–Terry on preference pairs (`tether rm`).

The loop, top to bottom:
    load + validate + tokenize pairs (each side exactly as LearnedReward will score it)
    -> reward model = causal-LM body + scalar head read at the last non-pad token
       (tether.models.heads.ScalarHeadModel; a sequence-classification checkpoint is accepted)
    -> for each optimizer step: chosen and rejected of a batch in one forward,
       L = mean −log σ(r_c − r_r − m)  [+ λ·mean (r_c + r_r)²]  (:func:`reward_model_loss`),
       clip, step (finite-checked)
    -> log / eval on held-out pairs (+ a few of them with their rewards in samples.jsonl) /
       checkpoint (exactly resumable)
    -> centering: the mean reward over the training responses becomes the head's offset, so the
       saved model scores the training distribution at mean 0 (what PPO wants from its RM).

Ensembles: one run is one model. Train k runs with different `seed` (head init + data order; see
`train_rm_ensemble`) and point LearnedReward / `rm:a,b,c` at them; aggregation happens there.

Under torchrun every member is built and sharded by setup_training like any trained model (the head
is drawn from the seed, the same on every rank, before sharding), each rank takes a block of every
global batch, and loss, accuracy, margin and reward statistics (train and held-out) are over the
global batch or the whole held-out set: what one process logs.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace

import torch

from tether import distributed
from tether.config import flat_init
from tether.constraints import NonNegative, Seed
from tether.data import collate_sequences
from tether.errors import UserError
from tether.models.heads import ScalarHeadModel
from tether.models.logprobs import packing_layout
from tether.objectives import bradley_terry_loss
from tether.rewards.learned import encode_scored
from tether.trainers.core.common import StepClock
from tether.trainers.core.held_out import check_keep_best
from tether.trainers.core.sections import DataSection, ModelSection, OptimSection, RunSection
from tether.trainers.core.setup import Data, setup_training, releases_process_state


@dataclass
class RMSection:
    use_margin: bool = True
    "subtract the `margin` column (Llama-2) inside the sigmoid when the data has one"
    center_rewards_coefficient: NonNegative = 0.0
    "λ of the auxiliary loss λ·mean((r_c + r_r)²) that keeps rewards near 0 (Eisenstein et al.)"
    center: bool = True
    "after training, set the head's offset so the mean reward over the training responses is 0"
    eval_seed: Seed = 0
    "seed of the eval_fraction split (kept apart from `seed` so ensemble members share held-out pairs)"


@flat_init
@dataclass
class RMConfig:
    model: ModelSection = field(default_factory=ModelSection)
    "initial model: a causal LM (the head starts fresh), a saved reward model, or a SequenceClassification checkpoint"
    data: DataSection = field(default_factory=lambda: DataSection(eval_fraction=0.1, batch_size=16))
    "preference pairs (prompt, chosen, rejected [, margin]); an over-long side keeps its start"
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=1e-5, warmup_ratio=0.03))
    "optimizer, schedule, length"
    run: RunSection = field(default_factory=lambda: RunSection(name="rm"))
    "run directory, seed (head init + data order: ensemble members differ by seed), logging, eval, checkpoints"
    rm: RMSection = field(default_factory=RMSection)
    "the Bradley–Terry loss and centering"

    def __post_init__(self):
        # ScalarHeadModel wraps the body itself and has no adapters: refused here, before any
        # work, rather than ignored.
        if self.model.lora_r > 0:
            raise ValueError("rm: lora_r is not supported for reward models (full fine-tuning only)")


# -- data ----------------------------------------------------------------------------------------

def load_pairs(source: str, tokenizer, max_length: int, split: str | None = None,
               truncation: str = "truncate", columns: dict | None = None) -> tuple[list[dict], dict]:
    """Validated preference rows -> [{chosen_ids, rejected_ids, margin, gold..., texts}] + report."""
    from tether.data.errors import DataError
    from tether.data.pipeline import load_data

    rows = load_data(source, expect="preference", split=split, rename=columns)
    out, truncated, dropped = [], 0, 0
    for i, row in enumerate(rows):
        ex = {f"{side}_ids": encode_scored(tokenizer, row["prompt"], row[side])
              for side in ("chosen", "rejected")}
        m = row.get("margin")
        if m is not None and not isinstance(m, (int, float)):
            raise DataError(rows.source, rows.row_number(i), "margin", f"must be a number, got {m!r}")
        if truncation == "drop" and max(len(ex["chosen_ids"]), len(ex["rejected_ids"])) > max_length:
            dropped += 1
            continue
        truncated += len(ex["chosen_ids"]) > max_length  # counted once per pair, by its chosen side
        ex = {k: ids[:max_length] for k, ids in ex.items()}
        ex["margin"] = float(m or 0.0)
        for k in ("gold_chosen", "gold_rejected", "label_prob"):  # gold-reward lab columns
            if isinstance(row.get(k), (int, float)):
                ex[k] = float(row[k])
        ex["text"] = {"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"]}
        out.append(ex)
    return out, {"rows": len(out), "truncated": truncated, "dropped": dropped,
                 "has_margin": "margin" in rows.columns}


def load_rm_data(cfg: RMConfig, tokenizer) -> Data:
    """Training and held-out pairs: `eval_data`, else `eval_fraction` of `data` carved out with
    `eval_seed` (not `seed`, so the members of an ensemble share their held-out pairs)."""
    spec = cfg.data
    train, report = load_pairs(spec.path, tokenizer, spec.max_length, spec.split, spec.truncation,
                               spec.columns)
    if spec.eval_data:
        held_out, _ = load_pairs(spec.eval_data, tokenizer, spec.max_length, truncation=spec.truncation,
                                 columns=spec.columns)
    elif spec.eval_fraction > 0:
        order = list(range(len(train)))
        random.Random(cfg.rm.eval_seed).shuffle(order)
        held = set(order[:max(1, int(len(order) * spec.eval_fraction))])
        held_out = [ex for i, ex in enumerate(train) if i in held]
        train = [ex for i, ex in enumerate(train) if i not in held]
    else:
        held_out = []
    if not train:
        raise UserError(f"rm: no training pairs left in '{spec.path}' after the eval split")
    if not cfg.rm.use_margin:
        for ex in train:
            ex["margin"] = 0.0
    return Data(train, held_out, report)


def pair_batch(examples: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """2B right-padded sequences (chosen rows first), their mask, and the B margins."""
    seqs = [ex["chosen_ids"] for ex in examples] + [ex["rejected_ids"] for ex in examples]
    T = max(map(len, seqs))
    ids = torch.tensor([s + [pad_id] * (T - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs])
    return ids, mask, torch.tensor([ex["margin"] for ex in examples])


def _pair_scores(model, examples, pad_id, device, amp, packing: str = ""):
    """Rewards of the chosen and of the rejected sides, and the margins, of one batch of pairs;
    padded, or packed (data.packing): then each side's reward is read at its own last token."""
    B = len(examples)
    if packing:
        seqs = [{"input_ids": ex[f"{side}_ids"]} for side in ("chosen", "rejected") for ex in examples]
        b = collate_sequences(seqs, pad_id, packing, keys=("input_ids",))
        with amp:  # no attention mask: the block-diagonal one comes from the position ids
            values = model(b["input_ids"].to(device), None, b["position_ids"].to(device))
        r = values.flatten().index_select(0, b["sequence_ends"].to(device)).float()
        return r[:B], r[B:], torch.tensor([ex["margin"] for ex in examples]).to(device)
    ids, mask, margin = pair_batch(examples, pad_id)
    with amp:
        r = model.score(ids.to(device), mask.to(device)).float()
    return r[:B], r[B:], margin.to(device)


# -- evaluation ----------------------------------------------------------------------------------

@torch.no_grad()
def score_pairs(model, examples: list[dict], batch_size: int, pad_id: int, device, amp, packing: str = ""):
    """Chosen and rejected rewards [N] of `examples` (in eval mode, returned on the CPU). Under
    torchrun each rank scores a share of the batches (distributed.rank_share) and every rank gets
    all the rewards, in order."""
    was = model.training
    model.eval()
    mine = []
    for chunk in distributed.rank_share(examples, batch_size):
        # None: a forward that counts for nothing (sharded forwards are collective)
        c, r, _ = _pair_scores(model, chunk if chunk is not None else examples[:batch_size], pad_id,
                               device, amp, packing)
        if chunk is not None:
            mine.append((c.cpu(), r.cpu()))
    parts = distributed.rank_unshare(mine, -(-len(examples) // batch_size))
    model.train(was)
    return torch.cat([c for c, _ in parts]), torch.cat([r for _, r in parts])


def pair_metrics(examples: list[dict], chosen: torch.Tensor, rejected: torch.Tensor,
                 prefix: str = "eval/") -> dict:
    """Pairwise accuracy, BT loss, margin, reward stats; Bayes-optimal accuracy and agreement with
    the gold ordering when the pairs carry the gold-reward lab's columns."""
    loss, m = bradley_terry_loss(chosen, rejected)
    both = torch.cat([chosen, rejected])
    out = {"loss": float(loss), "accuracy": float(m["accuracy"]), "margin": float(m["margin"]),
           "reward_mean": float(both.mean()), "reward_std": float(both.std()),
           "reward_min": float(both.min()), "reward_max": float(both.max())}
    if all("label_prob" in ex for ex in examples):
        out["bayes_accuracy"] = sum(max(ex["label_prob"], 1 - ex["label_prob"]) for ex in examples) / len(examples)
    if all("gold_chosen" in ex and "gold_rejected" in ex for ex in examples):
        gold = torch.tensor([ex["gold_chosen"] - ex["gold_rejected"] for ex in examples])
        untied = gold != 0
        if untied.any():
            out["gold_agreement"] = float((((chosen - rejected) > 0) == (gold > 0))[untied].float().mean())
    return {prefix + k: v for k, v in out.items()}


# what pair_metrics logs on any pairs (+ bayes_accuracy, gold_agreement where the data has the
# gold-reward lab's columns)
EVAL_METRICS = ("loss", "accuracy", "margin", "reward_mean", "reward_std", "reward_min", "reward_max",
                "bayes_accuracy", "gold_agreement")


def evaluate_pairs(model, examples: list[dict], batch_size: int, pad_id: int, device, amp,
                   prefix: str = "eval/", packing: str = "") -> dict:
    """:func:`pair_metrics` of the model's rewards on `examples` ({} when there are none)."""
    if not examples:
        return {}
    return pair_metrics(examples, *score_pairs(model, examples, batch_size, pad_id, device, amp, packing), prefix)


def pair_samples(model, examples: list[dict], pad_id: int, device, amp, packing: str = "") -> list[dict]:
    """Pairs as text with their rewards, the rows of samples.jsonl."""
    if not examples:
        return []
    chosen, rejected = score_pairs(model, examples, len(examples), pad_id, device, amp, packing)
    return [{**ex["text"], "reward_chosen": float(c), "reward_rejected": float(r)}
            for ex, c, r in zip(examples, chosen, rejected)]


@torch.no_grad()
def mean_reward(model, examples: list[dict], pad_id: int, device, amp, batch_size: int = 64,
                packing: str = "") -> float:
    """Mean reward over both responses of `examples`: the centering offset (under torchrun over
    every rank's share, the same on every rank)."""
    was = model.training
    model.eval()
    mine = []
    for chunk in distributed.rank_share(examples, batch_size):
        r = torch.cat(_pair_scores(model, chunk if chunk is not None else examples[:batch_size], pad_id,
                                   device, amp, packing)[:2]).cpu()
        if chunk is not None:  # None: a forward that counts for nothing (collective forwards)
            mine.append(r)
    rewards = distributed.rank_unshare(mine, -(-len(examples) // batch_size))
    model.train(was)
    return float(torch.cat(rewards).mean())


# -- training ------------------------------------------------------------------------------------

def reward_model_loss(chosen: torch.Tensor, rejected: torch.Tensor, margins: torch.Tensor,
                      center_coefficient: float = 0.0):
    """Bradley–Terry loss with a margin and a centering term, over a batch of pairs:

        L = mean_i −log σ(r_c,i − r_r,i − m_i) + λ·mean_i (r_c,i + r_r,i)²

    (Ouyang et al. 2022 eq. 1; the margin m: Touvron et al. 2023 (Llama 2) eq. 2; the centering
    term λ = `center_coefficient`, which holds the rewards' level near 0: Eisenstein et al. 2023).
    Returns (loss, {accuracy, margin}) as :func:`tether.objectives.bradley_terry_loss`."""
    loss, metrics = bradley_terry_loss(chosen, rejected, margins)
    if center_coefficient:
        loss = loss + center_coefficient * ((chosen + rejected) ** 2).mean()
    return loss, metrics


def load_reward_model(cfg: RMConfig, ckpt) -> ScalarHeadModel:
    """The model to train, from the checkpoint on resume. A fresh head's init draws from torch's
    RNG, seeded by setup_training just before: ensemble members differ by seed."""
    return ScalarHeadModel.from_pretrained(str(ckpt) if ckpt else cfg.model.path, kind="reward",
                                           dtype=cfg.model.dtype, device=cfg.model.device,
                                           attn_implementation=cfg.model.attn_implementation)


@releases_process_state
def train_rm(cfg: RMConfig) -> dict:
    """Train a Bradley–Terry reward model per `cfg`; returns the summary (also summary.json)."""
    check_keep_best(cfg, [f"eval/{k}" for k in EVAL_METRICS],
                    held_out=bool(cfg.data.eval_data or cfg.data.eval_fraction > 0))
    t = setup_training(cfg, lambda tokenizer: load_rm_data(cfg, tokenizer), build=load_reward_model)
    # Under torchrun a rank's pairs are a block of the global batch: whole micro-batches of one
    # process when grad_accum is a multiple of the processes, and gathered rewards in its order.
    t.order.contiguous = True
    model, device, amp, batch_size = t.model, t.device, t.amp, cfg.data.batch_size
    pad_id = t.tokenizer.pad_token_id if t.tokenizer.pad_token_id is not None else 0
    packing = packing_layout(model, cfg.data.packing)

    def evaluate(examples: list[dict], prefix: str = "eval/") -> dict:
        return evaluate_pairs(model, examples, batch_size * 4, pad_id, device, amp, prefix, packing)

    def write_samples() -> None:  # the same first pairs each time, so they can be followed
        shown = (t.data.eval or t.data.train)[:cfg.run.num_samples]
        t.add_samples(pair_samples(model, shown, pad_id, device, amp, packing))

    clock, started, last = StepClock(), time.time(), {}
    while t.step < t.total_steps:
        indices = t.order.next()  # under torchrun this rank's part of the global batch
        n_total = int(distributed.sum_floats([len(indices)])[0])
        loss_sum, accuracy, margin, rewards = 0.0, 0.0, 0.0, []
        for start in distributed.accumulation(model, range(0, len(indices), batch_size)):
            pairs = [t.data.train[j] for j in indices[start:start + batch_size]]
            chosen, rejected, margins = _pair_scores(model, pairs, pad_id, device, amp, packing)
            loss, stats = reward_model_loss(chosen, rejected, margins, cfg.rm.center_rewards_coefficient)
            # the loss is a mean over the whole accumulated (global) batch: a micro-batch's mean
            # weighs its share of the pairs; the ranks' weighted sums add up to the batch mean
            weight = len(pairs) / n_total
            (loss * weight).backward()
            loss_sum += float(loss.detach()) * weight
            accuracy += float(stats["accuracy"]) * weight
            margin += float(stats["margin"]) * weight
            rewards.append(torch.cat([chosen, rejected]).detach().cpu())
        loss_sum, accuracy, margin = distributed.sum_floats([loss_sum, accuracy, margin])
        grad_norm = t.optimizer_step(loss_sum)
        t.step += 1
        clock.tick()
        rewards = distributed.cat_ranks(torch.cat(rewards))  # min / max / mean over the global batch
        last = {"loss": loss_sum, "accuracy": accuracy, "margin": margin,
                "reward_mean": float(rewards.mean()), "reward_min": float(rewards.min()),
                "reward_max": float(rewards.max()), "grad_norm": grad_norm, "lr": t.lr}
        if t.log_due():
            t.log({**last, "epoch": t.order.epoch, "skipped_steps": t.skipped, **clock.lap()})
        if t.due(cfg.run.eval_every):
            t.log_eval(evaluate(t.data.eval))
            write_samples()
        if t.due(cfg.run.save_every):
            t.checkpoint()
        t.bar.update({"loss": loss_sum, "acc": accuracy, **t.eval_shown})

    if cfg.rm.center:
        # Idempotent: re-centering a centered model adds ~0, so a resume at the end is harmless.
        model.offset += mean_reward(model, t.data.train[:2048], pad_id, device, amp, packing=packing)
    final_eval = evaluate(t.data.eval)
    train_eval = evaluate(t.data.train[:len(t.data.eval) or 512], prefix="train/")
    t.log_eval({**final_eval, **train_eval})
    write_samples()
    report = t.data.report
    return t.finish({"train_pairs": len(t.data.train), "eval_pairs": len(t.data.eval),
                     "final_loss": last.get("loss"), "offset": model.offset,
                     "truncated": report["truncated"], "dropped": report["dropped"],
                     "has_margin": report["has_margin"] and cfg.rm.use_margin,
                     "train_seconds": round(time.time() - started, 2), **final_eval,
                     **{k: train_eval[k] for k in ("train/accuracy",) if k in train_eval}})


def train_rm_ensemble(cfg: RMConfig, seeds: list[int]) -> list[str]:
    """k reward models differing only by seed (runs <name>-s<seed>); returns their checkpoints,
    ready for LearnedReward(paths, aggregate=...). The held-out split is shared (eval_seed)."""
    return [train_rm(replace(cfg, name=f"{cfg.run.name}-s{s}", seed=s))["checkpoint"] for s in seeds]
