"""Where a completion ends: stop strings matched on decoded text while decoding (:class:`StopChecker`),
and the waves' outputs cut at EOS, stop string or length into a :class:`Rollout` (:func:`assemble`)."""
from __future__ import annotations

import torch

from .sampling import SamplingConfig
from .types import Rollout


class StopChecker:
    """Finds the token at which a stop string first completes, decoding a short window per check."""

    def __init__(self, tokenizer, stops: list[str], n: int):
        self.tok, self.stops = tokenizer, stops
        self.window = max(map(len, stops)) + 8  # tokens of look-back: a stop spans <= len(stop) tokens
        self.ids: list[list[int]] = [[] for _ in range(n)]

    def _hit(self, ids: list[int]) -> bool:
        text = self.tok.decode(ids, skip_special_tokens=True)
        return any(s in text for s in self.stops)

    def update(self, i: int, new: list[int]) -> int | None:
        """Append ``new`` tokens to sequence i; the completion length at the first stop, or None."""
        ids = self.ids[i]
        c = len(ids)
        ids.extend(new)
        lo = max(0, c - self.window)
        if not self._hit(ids[lo:]):
            return None
        for m in range(c, len(ids)):  # rare: find the exact token
            if self._hit(ids[lo:m + 1]):
                return m + 1
        return len(ids)


def assemble(seqs, group, parts, cfg: SamplingConfig, eos: list[int], pad: int, tokenizer, device) -> Rollout:
    """One :class:`Rollout` from the waves' ``parts`` (tokens [n, T'], log-probs [n, T'], {row: length
    at a stop string}): each completion ends at its first end token (unless ``cfg.ignore_eos``) or
    stop string, whichever comes first, else at the longest wave's length; padded with ``pad``."""
    T = max(p[0].shape[1] for p in parts)
    toks = torch.cat([torch.nn.functional.pad(p[0], (0, T - p[0].shape[1]), value=pad) for p in parts])
    lps = torch.cat([torch.nn.functional.pad(p[1], (0, T - p[1].shape[1])) for p in parts])
    N = toks.shape[0]
    ends = torch.full((N,), T, dtype=torch.long)
    reasons = ["length"] * N
    if eos and not cfg.ignore_eos:
        is_end = torch.isin(toks, torch.tensor(eos))
        first = is_end.int().argmax(1)
        for i in is_end.any(1).nonzero().flatten().tolist():
            ends[i], reasons[i] = first[i] + 1, "eos"
    offset = 0
    for p in parts:
        for i, e in p[2].items():
            if e <= ends[offset + i]:
                ends[offset + i], reasons[offset + i] = e, "stop"
        offset += p[0].shape[0]
    width = int(ends.max())
    mask = torch.arange(width)[None, :] < ends[:, None]
    toks = toks[:, :width].masked_fill(~mask, pad)
    lps = lps[:, :width].masked_fill(~mask, 0.0)
    texts = [""] * N
    if tokenizer is not None:
        texts = tokenizer.batch_decode([r[:e].tolist() for r, e in zip(toks, ends.tolist())],
                                       skip_special_tokens=True)
    return Rollout(prompt_ids=seqs, completion_ids=toks.to(device), completion_mask=mask.to(device),
                   logprobs=lps.to(device), texts=texts, finish_reasons=reasons,
                   group=torch.tensor(group, device=device),
                   logprob_temperature=cfg.temperature if cfg.temperature > 0 else 1.0,
                   pad_token_id=pad)


def assemble_episodes(seqs, group, parts, cfg: SamplingConfig, pad: int, tokenizer, device, episodes) -> Rollout:
    """One :class:`Rollout` of multi-turn episodes from the waves' ``parts`` (tokens, log-probs,
    stop ends, step kinds): each row's completion is the steps that produced a token (kind 1: the
    model's, kind 2: the environment's), in order, with the waiting steps between turns left out.
    ``completion_mask`` marks the model's tokens, ``observation_mask`` the environment's; texts
    decode the whole completion. Finish reasons come from ``episodes.finish_reason(i)`` where it
    has one (default: 'length' for an episode the step budget cut, else 'eos')."""
    rows = []
    for tok, lp, _, kind in parts:
        for r in range(tok.shape[0]):
            keep = kind[r] > 0
            rows.append((tok[r][keep], lp[r][keep], kind[r][keep]))
    N = len(rows)
    width = max((len(r[0]) for r in rows), default=0)
    toks = torch.full((N, width), pad, dtype=torch.long)
    lps = torch.zeros((N, width))
    model = torch.zeros((N, width), dtype=torch.bool)
    env = torch.zeros((N, width), dtype=torch.bool)
    for i, (t, lp, k) in enumerate(rows):
        L = len(t)
        toks[i, :L], lps[i, :L] = t, lp
        model[i, :L], env[i, :L] = k == 1, k == 2
    lps = lps.masked_fill(~model, 0.0)
    texts = [""] * N
    if tokenizer is not None:
        texts = tokenizer.batch_decode([t.tolist() for t, _, _ in rows], skip_special_tokens=True)
    reason = getattr(episodes, "finish_reason", None)
    reasons = [(reason(i) if reason else None) or "length" for i in range(N)]
    return Rollout(prompt_ids=seqs, completion_ids=toks.to(device), completion_mask=model.to(device),
                   logprobs=lps.to(device), texts=texts, finish_reasons=reasons,
                   group=torch.tensor(group, device=device),
                   logprob_temperature=cfg.temperature if cfg.temperature > 0 else 1.0,
                   pad_token_id=pad, observation_mask=env.to(device))
