"""Process reward models (PRMs) as reward functions: `prm:<run>?aggregate=min|last|prod|mean`.

A PRM (`tether prm`) is the reward-model body + scalar head (tether.models.heads) trained with a
per-step binary cross-entropy: its head at the last token of step i (the step's separator) is the
logit of P(step i is correct | prompt, steps ≤ i). To score a generated completion, the text is cut
at the PRM's separator (saved with it in `prm.json`; tether.data.steps.split_steps), encoded as in
training (each step + separator; a last step without one gets it), and one forward gives every
step's probability p_1..p_S at once (the model is causal: the score at step i sees steps ≤ i only).
The completion's reward is an aggregate of them:

    min    min_i p_i           the weakest step (Wang et al. 2024, Math-Shepherd; the study's choice)
    last   p_S                 the last step's (an outcome RM trained as a one-step PRM reads this)
    prod   Π_i p_i             P(every step correct) if the steps' errors were independent
                               (Lightman et al. 2023, "Let's Verify Step by Step", §2.6)
    mean   (1/S) Σ_i p_i

`step_probabilities` is the one scorer: the trainer's held-out metrics, the reward, PPO's per-step
rewards and the study all read a PRM through it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from tether.errors import UserError

AGGREGATES = ("min", "last", "prod", "mean")
PRM_CONFIG = "prm.json"  # {"separator": str}: written by `tether prm` into each checkpoint
DEFAULT_SEPARATOR = "\n"  # TRL's PRMConfig.step_separator default


def aggregate_steps(probs: Tensor, aggregate: str = "min") -> float:
    """One completion's reward from its step probabilities [S] (module docstring)."""
    if probs.numel() == 0:
        raise ValueError("a completion has at least one step")
    if aggregate == "min":
        return float(probs.min())
    if aggregate == "last":
        return float(probs[-1])
    if aggregate == "prod":
        return float(probs.double().prod())
    if aggregate == "mean":
        return float(probs.mean())
    raise UserError(f"PRM aggregate must be one of {', '.join(AGGREGATES)}; got {aggregate!r}")


def read_separator(path: str | Path) -> str:
    """The step separator a PRM was trained with (prm.json beside its weights)."""
    f = Path(path) / PRM_CONFIG
    return json.loads(f.read_text())["separator"] if f.exists() else DEFAULT_SEPARATOR


@torch.no_grad()
def step_logits(model, sequences: list[list[int]], ends: list[list[int]], pad_id: int,
                batch_size: int = 64, amp=None) -> list[Tensor]:
    """The head's logits at each row's step ends: one [S_row] tensor per row, on the CPU.
    `model`: a ScalarHeadModel (per-token scalars); rows are right-padded per batch."""
    device = next(model.parameters()).device
    was = model.training
    model.eval()
    out = []
    for start in range(0, len(sequences), batch_size):
        seqs, idx = sequences[start:start + batch_size], ends[start:start + batch_size]
        T = max(map(len, seqs))
        ids = torch.tensor([s + [pad_id] * (T - len(s)) for s in seqs], device=device)
        mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs], device=device)
        if amp is None:
            values = model(ids, mask).float().cpu()
        else:
            with amp:
                values = model(ids, mask).float().cpu()
        out += [v[torch.tensor(e, dtype=torch.long)] for v, e in zip(values, idx)]
    model.train(was)
    return out


class ProcessReward:
    """A PRM as a reward function (TRL's signature) and as a per-step scorer (frozen, eval mode)."""

    def __init__(self, path: str | Path, aggregate: str = "min", device: str = "auto",
                 batch_size: int = 64, dtype: str = "auto", max_length: int = 0):
        from tether.models import load_tokenizer
        from tether.models.heads import ScalarHeadModel
        from tether.rewards.learned import resolve_rm_path

        aggregate_steps(torch.ones(1), aggregate)  # validate the rule before loading anything
        self.path = resolve_rm_path(path)
        self.aggregate, self.batch_size, self.max_length = aggregate, batch_size, max_length or None
        self.separator = read_separator(self.path)
        self.tokenizer = load_tokenizer(str(self.path))
        self.model = ScalarHeadModel.from_pretrained(self.path, kind="reward", dtype=dtype, device=device).eval()
        self.model.requires_grad_(False)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.reward_name = f"prm_{aggregate}"
        self.__name__ = self.reward_name

    def encode(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        """(ids, step ends) of one completion, cut at the separator and encoded as in training."""
        from tether.data.steps import encode_steps, split_steps
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise UserError("prm: process reward models score standard (string) prompts and completions")
        ids, ends = encode_steps(self.tokenizer, prompt, split_steps(completion, self.separator),
                                 self.separator, self.max_length)
        if not ends:  # the prompt alone fills max_length: score what fits, at its last token
            ids = ids[:self.max_length]
            ends = [len(ids) - 1]
        return ids, ends

    def step_probabilities(self, prompts, completions) -> list[Tensor]:
        """P(step correct) of every step of every completion: one [S] tensor each."""
        if len(prompts) != len(completions):
            raise UserError(f"prm: {len(prompts)} prompts for {len(completions)} completions")
        encoded = [self.encode(p, c) for p, c in zip(prompts, completions)]
        logits = step_logits(self.model, [e[0] for e in encoded], [e[1] for e in encoded], self.pad_id,
                             self.batch_size)
        return [torch.sigmoid(x) for x in logits]

    def __call__(self, prompts, completions, completion_ids=None, **columns) -> list[float]:
        return [aggregate_steps(p, self.aggregate) for p in self.step_probabilities(prompts, completions)]


def parse_prm_spec(spec: str) -> tuple[str, dict]:
    """'prm:<path>[?aggregate=min&batch_size=64&device=cpu&max_length=512]' -> (path, options)."""
    body = spec[4:] if spec.startswith("prm:") else spec
    path, _, query = body.partition("?")
    opts: dict = {}
    for part in filter(None, query.split("&")):
        key, _, value = part.partition("=")
        if key in ("aggregate", "device"):
            opts[key] = value
        elif key in ("batch_size", "max_length"):
            try:
                opts[key] = int(value)
            except ValueError:
                raise UserError(f"reward {spec!r}: {key} must be an integer, got {value!r}") from None
        else:
            raise UserError(f"reward {spec!r}: unknown option {key!r} (aggregate, batch_size, device, max_length)")
    if not path.strip():
        raise UserError(f"reward {spec!r}: no PRM path after 'prm:'")
    return path.strip(), opts
