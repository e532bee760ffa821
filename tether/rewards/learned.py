"""Learned reward models (and ensembles of them) as reward functions with TRL's signature.

    rm = LearnedReward(["runs/rm-s0", "runs/rm-s1", "runs/rm-s2"], aggregate="mean_minus_std", k=1.0)
    rm(prompts, completions)          -> list[float]
    rm.score_ids(input_ids, mask)     -> Tensor [N]   (ids already in the RM's tokenizer)

Each path is a reward-model directory (``scalar_head.safetensors``, an
``AutoModelForSequenceClassification`` checkpoint) or a ``tether rm`` run directory (its newest
checkpoint is used). An ensemble is simply several paths: k runs of ``tether rm`` with different
``seed`` (head init and data order). Conservative aggregation over the k member scores r_1..r_k
(Coste et al. 2023):

    mean              (1/k) Σ r_j
    min               min_j r_j                    (worst-case optimization)
    mean_minus_std    mean − k·std,  std = sqrt((1/k) Σ (r_j − mean)²)   (population std; 0 for k=1)

Text is tokenised exactly as ``tether rm`` tokenised its training pairs
(:func:`encode_scored` = the data layer's prompt + completion encoding: BOS + prompt, completion +
EOS for strings; the chat template for conversations), and the score is read at the last token.

Layer note: this module imports torch, unlike the rest of tether.rewards; the registry imports it
lazily, only for ``rm:`` specs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from tether.errors import UserError

AGGREGATES = ("mean", "min", "mean_minus_std")


def encode_scored(tokenizer, prompt, completion) -> list[int]:
    """Token ids of (prompt, completion) as the RM sees them (training and scoring alike)."""
    from tether.data.tokenize import encode_prompt_completion
    return encode_prompt_completion({"prompt": prompt, "completion": completion}, tokenizer)["input_ids"]


def aggregate_scores(scores: Tensor, aggregate: str = "mean", k: float = 1.0) -> Tensor:
    """[members, N] -> [N] by the ensemble rule (see the module docstring)."""
    if aggregate == "mean":
        return scores.mean(0)
    if aggregate == "min":
        return scores.min(0).values
    if aggregate == "mean_minus_std":
        return scores.mean(0) - k * scores.std(0, correction=0)
    raise UserError(f"reward-model aggregate must be one of {', '.join(AGGREGATES)}; got {aggregate!r}")


def resolve_rm_path(path: str | Path) -> Path:
    """A model directory as given, or a run directory's newest checkpoint."""
    from tether.run import latest_checkpoint

    p = Path(path)
    if (p / "config.json").exists():
        return p
    ckpt = latest_checkpoint(p) if p.is_dir() else None
    if ckpt is None:
        raise UserError(f"reward model '{path}' is neither a model directory nor a run with checkpoints")
    return ckpt


class LearnedReward:
    """A reward function backed by one reward model or an ensemble (frozen, eval mode)."""

    def __init__(self, paths: str | Sequence[str], aggregate: str = "mean", k: float = 1.0,
                 device: str = "auto", batch_size: int = 64, dtype: str = "auto", max_length: int = 0):
        from tether.models import load_tokenizer
        from tether.models.heads import ScalarHeadModel

        if isinstance(paths, (str, Path)):
            paths = [p for p in str(paths).split(",") if p.strip()]
        if not paths:
            raise UserError("LearnedReward needs at least one reward-model path")
        aggregate_scores(torch.zeros(1, 1), aggregate, k)  # validate the rule before loading anything
        self.paths = [resolve_rm_path(p.strip() if isinstance(p, str) else p) for p in paths]
        self.aggregate, self.k, self.batch_size, self.max_length = aggregate, float(k), batch_size, max_length
        self.tokenizer = load_tokenizer(str(self.paths[0]))
        self.models = []
        for p in self.paths:
            m = ScalarHeadModel.from_pretrained(p, kind="reward", dtype=dtype, device=device).eval()
            m.requires_grad_(False)
            if self.models and m.config.vocab_size != self.models[0].config.vocab_size:
                raise UserError(f"ensemble member '{p}' has a different vocabulary from '{self.paths[0]}'")
            self.models.append(m)
        self.device = next(self.models[0].parameters()).device
        self.reward_name = "rm" if len(self.models) == 1 else f"rm_ensemble{len(self.models)}_{aggregate}"
        self.__name__ = self.reward_name

    @torch.no_grad()
    def score_members(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Every member's score, [members, N] (input in the RM's tokenizer; any padding side)."""
        ids, mask = input_ids.to(self.device), attention_mask.to(self.device)
        return torch.stack([m.score(ids, mask).float() for m in self.models])

    def score_ids(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Aggregated scores [N] for token ids already in the RM's tokenizer."""
        return aggregate_scores(self.score_members(input_ids, attention_mask), self.aggregate, self.k)

    def encode(self, prompts, completions) -> list[list[int]]:
        seqs = [encode_scored(self.tokenizer, p, c) for p, c in zip(prompts, completions)]
        if self.max_length:
            seqs = [s[:self.max_length] for s in seqs]
        return seqs

    def members(self, prompts, completions) -> Tensor:
        """[members, N] scores of text pairs (ensemble diagnostics: disagreement, per-member curves)."""
        if len(prompts) != len(completions):
            raise UserError(f"reward model: {len(prompts)} prompts for {len(completions)} completions")
        seqs, out = self.encode(prompts, completions), []
        pad = self.tokenizer.pad_token_id or 0
        for i in range(0, len(seqs), self.batch_size):
            chunk = seqs[i:i + self.batch_size]
            T = max(map(len, chunk))
            ids = torch.tensor([s + [pad] * (T - len(s)) for s in chunk])
            mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in chunk])
            out.append(self.score_members(ids, mask).cpu())
        return torch.cat(out, dim=1) if out else torch.zeros(len(self.models), 0)

    def __call__(self, prompts, completions, completion_ids=None, **columns) -> list[float]:
        scores = aggregate_scores(self.members(prompts, completions), self.aggregate, self.k)
        return scores.tolist()


def parse_rm_spec(spec: str) -> tuple[list[str], dict]:
    """'rm:<path>[,<path>...][?aggregate=min&k=2]' -> (paths, options)."""
    body = spec[3:] if spec.startswith("rm:") else spec
    body, _, query = body.partition("?")
    paths = [p.strip() for p in body.split(",") if p.strip()]
    opts: dict = {}
    for part in filter(None, query.split("&")):
        key, _, value = part.partition("=")
        if key == "aggregate":
            opts["aggregate"] = value
        elif key == "k":
            try:
                opts["k"] = float(value)
            except ValueError:
                raise UserError(f"reward {spec!r}: k must be a number, got {value!r}") from None
        elif key in ("batch_size", "max_length"):
            opts[key] = int(value)
        elif key == "device":
            opts[key] = value
        else:
            raise UserError(f"reward {spec!r}: unknown option {key!r} (aggregate, k, batch_size, device, max_length)")
    if not paths:
        raise UserError(f"reward {spec!r}: no reward-model path after 'rm:'")
    return paths, opts
