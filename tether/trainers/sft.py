"""Supervised fine-tuning: language modelling, or prompt -> completion with completion-only loss.

The loop, top to bottom:
    load model + tokenizer  ->  load, validate and tokenize data (errors before any training;
       load_sft_data: rows -> examples, the held-out split, prompts to sample from)
    -> for each optimizer step: draw a batch, split into micro-batches, token-mean NLL over the
       completion mask of the *whole* accumulated batch, clip, step (finite-checked)
    -> log / eval (held-out loss and perplexity; with sft.eval_reward_funcs greedy pass@1 and
       rewards of the held-out prompts, core/held_out.py; sampled completions) / checkpoint (exactly
       resumable; run.keep_best keeps the best eval point's model as checkpoints/best).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from tether import distributed
from tether.config import ConfigError, flat_init
from tether.constraints import PositiveInt
from tether.data import collate_sequences, encode_prompts
from tether.data.pipeline import load_data
from tether.data.tokenize import encode_sft
from tether.errors import UserError
from tether.models.logprobs import (completion_token_logps, forward_inputs, packing_layout, saved_activations,
                                     uses_chunked_head)
from tether.objectives import sft_loss
from tether.trainers.core.common import StepClock
from tether.trainers.core.held_out import HeldOut, check_keep_best, eval_rewards, generation_metrics
from tether.trainers.core.sections import DataSection, ModelSection, OptimSection, RunSection
from tether.trainers.core.setup import Data, releases_process_state, setup_training

SFT_FORMATS = ("language-modeling", "prompt-completion")


@dataclass
class SFTSection:
    completion_only: bool = True
    "train only on completion / assistant tokens (prompt tokens are masked out of the loss)"
    sample_max_new_tokens: PositiveInt = 128
    "generation length of the completions sampled from eval prompts (run.num_samples of them), and of the greedy ones eval_reward_funcs score"
    eval_reward_funcs: list[str] = field(default_factory=list)
    "reward functions (as grpo's reward_funcs; each weight 1.0) scoring greedy completions of the held-out rows' prompts at eval points: eval/greedy/pass@1, eval/greedy/reward, ... (prompt-completion data; extra columns reach the functions)"


@flat_init
@dataclass
class SFTConfig:
    model: ModelSection = field(default_factory=ModelSection)
    "the model to fine-tune and how it runs"
    data: DataSection = field(default_factory=DataSection)
    "training and held-out data, batch"
    optim: OptimSection = field(default_factory=lambda: OptimSection(lr=2e-5, warmup_ratio=0.03))
    "optimizer, schedule, length"
    run: RunSection = field(default_factory=lambda: RunSection(name="sft"))
    "run directory, seed, logging, evaluation, checkpoints"
    sft: SFTSection = field(default_factory=SFTSection)
    "supervised fine-tuning"

    def __post_init__(self):
        if self.sft.eval_reward_funcs and not (self.data.eval_data or self.data.eval_fraction > 0):
            raise ConfigError("config key 'sft.eval_reward_funcs' needs held-out rows: data.eval_data=<file> "
                              "(or data.eval_fraction)")


# ---- data: rows -> validated, tokenized examples + eval split + prompts to sample from -------------

def sample_prompt(row: dict, tokenizer) -> str | None:
    """The text a model should continue for an eval sample of this row."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    messages = row.get("messages")
    if isinstance(messages, list):
        head = messages[:-1] if messages and messages[-1].get("role") == "assistant" else messages
        return tokenizer.apply_chat_template(head, tokenize=False, add_generation_prompt=True)
    text = row.get("text")
    if isinstance(text, str):
        return text[: max(1, len(text) // 4)]  # continue the first quarter of a document
    return None


def load_sft_data(cfg, tokenizer):
    """Returns (train_examples, eval_examples, eval_prompts, report_dict); raises DataError.
    `cfg`: the SFT config (its `data` section, `sft.completion_only` and `run.seed`)."""
    return load_sft_split(cfg, tokenizer)[:4]


def load_sft_split(cfg, tokenizer):
    """:func:`load_sft_data` + the held-out rows as read (eval_data's, or those of the
    eval_fraction split; [] without either): their prompts are sampled for eval/greedy/..."""
    d, completion_only, seed = cfg.data, cfg.sft.completion_only, cfg.run.seed
    rows = load_data(d.path, expect=SFT_FORMATS, split=d.split, rename=d.columns)
    eval_rows = load_data(d.eval_data, expect=SFT_FORMATS, rename=d.columns) if d.eval_data else None
    train_ex, rep = encode_sft(rows, tokenizer, d.max_length, d.truncation,
                               completion_only_loss=completion_only)
    report = {"train": rep.summary(), "train_rows": rep.total, "truncated": rep.truncated,
              "dropped": rep.dropped}
    if eval_rows is not None:
        eval_ex, erep = encode_sft(eval_rows, tokenizer, d.max_length, d.truncation,
                                   completion_only_loss=completion_only)
        report["eval"] = erep.summary()
        prompt_rows = held_rows = list(eval_rows)
    elif d.eval_fraction > 0:
        # A seeded split of the *encoded* examples, so the eval set is the same on resume.
        order = list(range(len(train_ex)))
        random.Random(seed).shuffle(order)
        n_eval = max(1, int(len(order) * d.eval_fraction))
        held = set(order[:n_eval])
        eval_ex = [train_ex[i] for i in sorted(held)]
        train_ex = [ex for i, ex in enumerate(train_ex) if i not in held]
        # examples[j] came from rows[kept_index[j]] (rows can be dropped when tokenizing).
        prompt_rows = held_rows = [rows[rep.kept_index[i]] for i in sorted(held)]
    else:
        eval_ex, prompt_rows, held_rows = [], list(rows)[:64], []
    prompts = [p for p in (sample_prompt(r, tokenizer) for r in prompt_rows[:64]) if p]
    return train_ex, eval_ex, prompts, report, held_rows


# ---- the loss and the loop ------------------------------------------------------------------------

def _micro_loss(model, batch: dict, device, amp) -> tuple[torch.Tensor, int]:
    """Summed completion-token NLL of one micro-batch (padded or packed: data.packing) and its
    token count. When the logits would be larger than one chunk of the LM head
    (models.logprobs.uses_chunked_head), the head runs on the target tokens only, in chunks
    (completion_token_logps, the RL and DPO trainers' forward): no [tokens, V] logits are held."""
    on = {k: v.to(device) for k, v in batch.items()}
    ids, mask = on["input_ids"], on["completion_mask"]
    n_tok = int(mask[:, 1:].sum())
    if uses_chunked_head(model, on):
        logps, _ = completion_token_logps(model, on, 1.0, amp)  # 0 outside the targets
        return -logps.sum(), n_tok
    with amp, saved_activations(ids.device):
        logits = model(**forward_inputs(on), use_cache=False).logits
    # sft_loss is the token mean over `mask` (shifted inside); scale back to a sum so the
    # accumulated batch is one token mean, not a mean of micro-batch means.
    return sft_loss(logits, ids, mask)[0] * n_tok, n_tok


@torch.no_grad()
def evaluate_loss(model, examples: list[dict], batch_size: int, pad_id: int, device, amp,
                  packing: str = "") -> float:
    """Token-mean NLL over `examples` (under torchrun: each rank a share, summed over ranks)."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    share = distributed.rank_share(examples, batch_size)
    for rows in share:
        batch = collate_sequences(rows or examples[:1], pad_id, packing)  # None: a turn that counts for nothing
        loss_sum, n = _micro_loss(model, batch, device, amp)
        if rows is not None:
            total, count = total + float(loss_sum), count + n
    model.train(was)
    total, count = distributed.sum_floats([total, count])
    return total / max(count, 1)


@releases_process_state
def train_sft(cfg: SFTConfig, *, eval_hook: Optional[Callable] = None,
              held_out: Optional[HeldOut] = None) -> dict:
    """Run SFT per `cfg`; returns the summary dict (also written to summary.json).

    `eval_hook(model, tokenizer, step) -> dict` adds task metrics (e.g. accuracy) at eval points.
    `held_out`: the greedy generation eval of prompt-only rows (tether bon's RFT run: the held-out
    prompts of an RL task, which SFT data cannot hold), in place of sft.eval_reward_funcs'.
    """
    d = cfg.data
    if held_out is not None and cfg.sft.eval_reward_funcs:
        raise ValueError("train_sft: pass held_out or set sft.eval_reward_funcs, not both")
    has_eval = bool(d.eval_data or d.eval_fraction > 0 or (held_out is not None and held_out.rows))
    # resolved before anything loads
    # (no held-out rows: no functions, so no rollout replica is built for them under torchrun)
    funcs = (held_out.funcs if held_out.rows else []) if held_out is not None \
        else eval_rewards(cfg.sft.eval_reward_funcs, [], [])[0]
    # an eval_hook's metric names are known only when it runs: then the first eval point checks
    likelihood = {"eval/loss", "eval/perplexity"} if d.eval_data or d.eval_fraction > 0 else set()
    check_keep_best(cfg, None if eval_hook else likelihood | generation_metrics(funcs),
                    held_out=has_eval or eval_hook is not None)

    def load(tokenizer):
        train_ex, eval_ex, prompts, report, held_rows = load_sft_split(cfg, tokenizer)
        prompt_rows = []
        if funcs and held_out is None:
            if not all("prompt" in row for row in held_rows):
                raise UserError(f"sft: sft.eval_reward_funcs needs prompts: the held-out data "
                                f"({d.eval_data or d.path}) is language-modeling; use prompt-completion rows")
            prompt_rows, _ = encode_prompts(held_rows, tokenizer, d.max_length, d.truncation,
                                            source=d.eval_data or d.path)
        return Data(train_ex, eval_ex, report, {"prompts": prompts, "prompt_rows": prompt_rows})
    # greedy sampling needs a whole model: under torchrun the replica (setup_training)
    t = setup_training(cfg, load, rollout_replica=bool(funcs))
    model, tok, device, amp, bs = t.model, t.tokenizer, t.device, t.amp, cfg.data.batch_size
    packing = packing_layout(model, cfg.data.packing)
    if held_out is None:
        held_out = HeldOut(t.data.extra["prompt_rows"], funcs, [1.0] * len(funcs), cfg.sft.sample_max_new_tokens,
                           batch_size=bs)

    def evaluate() -> dict:
        out = {}
        if t.data.eval:
            out["eval/loss"] = evaluate_loss(model, t.data.eval, bs, tok.pad_token_id, device, amp, packing)
            # `tether eval`'s perplexity on these rows (inf past exp's range, as a diverged loss)
            out["eval/perplexity"] = math.inf if out["eval/loss"] > 700 else math.exp(out["eval/loss"])
        out.update(held_out(t))
        prompts = t.data.extra["prompts"][:cfg.run.num_samples]
        completions = t.sample(prompts, cfg.sft.sample_max_new_tokens)
        t.add_samples([{"prompt": p, "completion": c} for p, c in zip(prompts, completions)])
        if eval_hook is not None:
            out.update(eval_hook(model, tok, t.step))
        return out

    clock, last = StepClock(), {}
    while t.step < t.total_steps:
        # one batch, split into micro-batches; the loss is the token mean over the whole batch
        idx = t.order.next()
        batches = [collate_sequences([t.data.train[j] for j in idx[i:i + bs]], tok.pad_token_id, packing)
                   for i in range(0, len(idx), bs)]
        # under torchrun `idx` is this rank's part and the token count is the global batch's
        # (distributed.py: ranks are micro-batches of one accumulated batch)
        tokens = [sum(int(b[k][:, 1:].sum() if k == "completion_mask" else b[k].sum()) for b in batches)
                  for k in ("completion_mask", "attention_mask")]
        n_total, n_seen = distributed.sum_floats(tokens)
        n_total = max(n_total, 1)
        parts = []  # the losses stay on the device until the step's end and are read in one transfer
        for b in distributed.accumulation(model, batches):
            part, _ = _micro_loss(model, b, device, amp)
            (part / n_total).backward()
            parts.append(part.detach().double())
        loss = distributed.sum_floats([sum(torch.stack(parts).tolist()) if parts else 0.0])[0] / n_total
        grad_norm = t.optimizer_step(loss)
        t.step += 1
        clock.tick(tokens=int(n_seen))
        last = {"loss": loss, "grad_norm": grad_norm, "lr": t.lr}
        if t.log_due():
            t.log({**last, "epoch": t.order.epoch, "skipped_steps": t.skipped, **clock.lap()})
        if t.due(cfg.run.eval_every):
            t.log_eval(evaluate())
        if t.due(cfg.run.save_every):
            t.checkpoint()
        t.bar.update({"loss": loss, "lr": last["lr"], **t.eval_shown})

    final_eval = evaluate()
    t.log_eval(final_eval)
    return t.finish({"train_examples": len(t.data.train), "eval_examples": len(t.data.eval),
                     "final_loss": last.get("loss"), "data": t.data.report, **final_eval})
