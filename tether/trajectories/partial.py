"""Partial rollouts: a long completion continues across weight updates, each of its tokens tagged
with the policy version that sampled it, so one slow sample never holds up a batch.

A source of the trajectory queue (asynchronous.py, disaggregated.py) calls the producer
`PartialRollouts(step, sampler)` for batch j, in order, with the weights of version
v_j = max(start, j − S) (S = queue.max_staleness: the queue's fixed schedule, so v_j is known here
without asking the source). Round j:

  1. `batch_size` new prompts join the pool (G sequences each), drawn from the data order;
  2. every unfinished sequence of the pool generates up to `partial_tokens` more tokens with v_j's
     weights: the new ones from their prompts (one sampler call), the carried ones from prompt +
     their tokens so far (another), *re-prefilled* with v_j's weights (no KV cache survives a
     round: the prefix's keys and values would be an older version's, and the next token would
     belong to neither policy);
  3. a sequence ends at an end token, a stop string (matched across the round boundary: the
     checker keeps every token of the sequence) or at max_new_tokens; each new token records v_j
     next to its log-prob (`Rollout.versions`), so μ of every token is the policy that drew it;
  4. the groups whose G sequences all ended, oldest first, are scored and are batch j; the others
     carry over. A round that ends no group is followed by another with the same weights and the
     next batch of prompts (the pipeline fills: at the start, when every completion needs R rounds,
     step 0 runs R rounds and each later step one), so a batch is never empty
     (`num_sampling_rounds` counts the rounds).

Every draw is a function of (seed, step, the weights): the run is reproducible whatever the
speeds. A sequence lives at most R = ceil(max_new_tokens / partial_tokens) rounds, so the pool
holds at most R batches of prompts and a token lags the trainer by at most S + R − 1 versions. With
partial_tokens ≥ max_new_tokens no completion spans two rounds and a round's new sequences are
sampled exactly as the unpartial sampler samples them (one call, same seed, prompt-major): the
batches, and so the run, are the loop's without partial rollouts (tested at S = 0 and 1). The groups in flight
go into each checkpoint (`state_dict`, saved by the queue's sources: a resume is exact); those
still in flight when the run ends are never trained.

The trainer treats the tokens as it treats a stale batch (the GRPO loop's prepare_batch): with
is_correction = tis | mis it weighs each by π_old / μ, μ the log-prob of the version that drew it;
without, they are trained as if fresh. Metrics:
`partial/token_staleness/{mean,max}` (versions the trained tokens lag the trainer),
`partial/spanning_completions` (the fraction of trained completions whose tokens come from more
than one version), `partial/groups` (trained this step: their number varies) and
`partial/groups_in_flight` (carried into the next round).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from tether import distributed
from tether.config import ConfigError
from tether.rollout import Rollout
from tether.rollout.finish import StopChecker
from tether.trajectories.sampling import GroupSampler, StepBatch, sum_stats


@dataclass
class Group:
    """One prompt's G sequences in flight."""
    row: dict
    "the prompt's data row"
    ids: list = field(default_factory=list)
    "per sequence: completion token ids so far"
    logps: list = field(default_factory=list)
    "per sequence: the sampler's log-prob of each token"
    versions: list = field(default_factory=list)
    "per sequence: the policy version that sampled each token"
    reasons: list = field(default_factory=list)
    "per sequence: finish reason ('eos', 'stop', 'length'), None while it runs"
    stops: Optional[StopChecker] = None
    "stop strings matched over each sequence's whole completion"

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.reasons)


def _pad(rows: list, width: int, value, dtype) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = torch.tensor(r, dtype=dtype)
    return out


class PartialRollouts:
    """The stateful producer of partial rollouts (module doc); called as `produce(step, sampler)`."""

    def __init__(self, next_prompts: Callable, score: Callable, cfg, start: int, epoch: Callable = lambda: 0.0):
        """`next_prompts() -> (rows, None)`: the next batch of prompt rows (the loop's data order);
        `score(seq_rows, rollout) -> (per_fn, rewards)`; `cfg`: the GRPO config (rollout, queue,
        run.seed); `start`: the step the run starts at; `epoch()`: the data order's epoch."""
        if distributed.active():
            raise ConfigError("config key 'queue.partial': partial rollouts run in one process, or "
                              "placement=disaggregated with one trainer process (torchrun --nproc-per-node 2)")
        self.next_prompts, self.score, self.epoch = next_prompts, score, epoch
        self.G, self.max_new = cfg.rollout.num_generations, cfg.rollout.max_new_tokens
        self.stop = list(cfg.rollout.stop)
        self.budget = min(cfg.queue.partial_tokens, self.max_new)
        self.seed, self.start, self.S = cfg.run.seed, start, cfg.queue.max_staleness
        self.pool: list[Group] = []

    @classmethod
    def of(cls, groups: GroupSampler, cfg, start: int) -> "PartialRollouts":
        """Partial rollouts of `groups`' prompt stream and scoring (a trainer's GroupSampler)."""
        return cls(groups.prompts, groups.scoring, cfg, start, epoch=groups.prompts.epoch)

    def version(self, step: int) -> int:
        """The weights batch `step` is sampled with (the queue's schedule, asynchronous.py)."""
        return max(self.start, step - self.S)

    def __call__(self, step: int, sampler) -> StepBatch:
        version, seed = self.version(step), self.seed * 1_000_003 + step  # the loop's seed of step
        stats, rounds, generated = [], 0, 0
        while True:
            self._draw(sampler)
            live = [(g, k) for g in self.pool for k in range(self.G) if g.reasons[k] is None]
            # Two sampler calls: the new sequences (prompt-major, keyed as Sampler.sample(n=G) keys
            # them), then the carried ones, each from its prompt + completion so far. One call would
            # left-pad every short prompt to the longest carried context: on the CPU that prefill
            # cost 0.16 s against 0.045 s for the two (bench/async.py's long tail, 32 + 8 rows).
            new = [(g, k) for g, k in live if not g.ids[k]]
            carried = [(g, k) for g, k in live if g.ids[k]]
            for salt, part in enumerate((new, carried)):
                if not part:
                    continue
                ro = sampler.sample([g.row["prompt_ids"] + g.ids[k] for g, k in part], n=1,
                                    seed=seed + rounds * (1 << 32) + salt * (1 << 31),
                                    max_new_tokens=self.budget)
                stats.append(ro.stats)
                # to the host once per call (not three transfers per row: 640 rows a round at a long tail)
                ids, logps, lengths = ro.completion_ids.tolist(), ro.logprobs.tolist(), ro.completion_mask.sum(1).tolist()
                for i, (g, k) in enumerate(part):
                    generated += self._extend(g, k, ids[i][:lengths[i]], logps[i], ro.finish_reasons[i], version)
            rounds += 1
            if any(g.done for g in self.pool):
                break
        done = [g for g in self.pool if g.done]
        self.pool = [g for g in self.pool if not g.done]
        rollout = self._rollout(done, sampler, ro.logprob_temperature)
        rollout.stats = {**sum_stats(stats), "tokens": generated}
        prompt_rows = [g.row for g in done]
        per_fn, rewards = self.score([g.row for g in done for _ in range(self.G)], rollout)
        return StepBatch(rollout, prompt_rows, per_fn, rewards, rewards, per_fn,
                         torch.arange(len(rewards)) // self.G, generated,
                         {"num_sampling_rounds": rounds, "partial/groups_in_flight": len(self.pool),
                          "partial/groups": len(done)},
                         epoch=self.epoch())

    def _draw(self, sampler) -> None:
        """The next batch of prompts joins the pool, G empty sequences each."""
        rows, _ = self.next_prompts()
        for row in rows:
            g = Group(row, [[] for _ in range(self.G)], [[] for _ in range(self.G)],
                      [[] for _ in range(self.G)], [None] * self.G)
            g.stops = StopChecker(sampler.tokenizer, self.stop, self.G) if self.stop else None
            self.pool.append(g)

    def _extend(self, g: Group, k: int, tokens: list, logps: list, finished: str, version: int) -> int:
        """Append this round's `tokens` of g's sequence k (their log-probs `logps`, the call's finish
        reason `finished`), cut at what it has left of max_new_tokens; decide whether it ended.
        Returns the tokens kept."""
        n = len(tokens)
        room = self.max_new - len(g.ids[k])
        new = tokens[:min(n, room)]
        reason = finished if n <= room else "length"  # the call's own 'length' is the budget's
        if g.stops is not None:
            end = g.stops.update(k, new)  # the completion's length at the first stop string, or None
            if end is not None:
                new, reason = new[:end - len(g.ids[k])], "stop"
        g.ids[k] += new
        g.logps[k] += logps[:len(new)]
        g.versions[k] += [version] * len(new)
        if reason in ("eos", "stop") or len(g.ids[k]) >= self.max_new:
            g.reasons[k] = reason if reason in ("eos", "stop") else "length"
        return len(new)

    def _rollout(self, done: list[Group], sampler, temperature: float) -> Rollout:
        """The finished groups as one Rollout (prompt-major, G each), with per-token versions."""
        seqs = [(g, k) for g in done for k in range(self.G)]
        ids = [g.ids[k] for g, k in seqs]
        width = max(map(len, ids))
        toks = _pad(ids, width, sampler.pad, torch.long)
        mask = _pad([[True] * len(x) for x in ids], width, False, torch.bool)
        texts = [""] * len(seqs)
        if sampler.tokenizer is not None:
            texts = sampler.tokenizer.batch_decode(ids, skip_special_tokens=True)
        device = next(sampler.model.parameters()).device
        return Rollout(prompt_ids=[g.row["prompt_ids"] for g, _ in seqs], completion_ids=toks.to(device),
                       completion_mask=mask.to(device),
                       logprobs=_pad([g.logps[k] for g, k in seqs], width, 0.0, torch.float32).to(device),
                       texts=texts, finish_reasons=[g.reasons[k] for g, k in seqs],
                       group=torch.arange(len(done), device=device).repeat_interleave(self.G),
                       logprob_temperature=temperature, pad_token_id=sampler.pad,
                       versions=_pad([g.versions[k] for g, k in seqs], width, -1, torch.long).to(device))

    def state_dict(self) -> list:
        """The groups in flight (checkpointed by the queue's sources, asynchronous.py): plain lists."""
        return [(g.row, [list(x) for x in g.ids], [list(x) for x in g.logps], [list(x) for x in g.versions],
                 list(g.reasons)) for g in self.pool]

    def load_state_dict(self, state: list, tokenizer=None) -> None:
        self.pool = []
        for row, ids, logps, versions, reasons in state:
            g = Group(row, ids, logps, versions, reasons)
            if self.stop:  # the checker holds each sequence's tokens so far
                g.stops = StopChecker(tokenizer, self.stop, self.G)
                g.stops.ids = [list(x) for x in ids]
            self.pool.append(g)


def partial_metrics(batch, step: int) -> dict:
    """Token staleness over the trained tokens and the completions spanning versions (module doc)."""
    v = batch.collected.rollout.versions
    if v is None:
        return {}
    # a batch that came through a pickle (the disaggregated sampler, a resumed checkpoint's
    # batches in flight) holds its rollout on the CPU; the mask is on the trainer's device
    v = v.to(batch.mask.device)
    P = batch.collected.rollout.prompt_width  # the completion columns: after the prompts, before any padding
    mask = batch.mask[:, P:P + v.shape[1]]
    lag = (step - v)[mask].float()
    rows = mask.any(1)
    lo = torch.where(mask, v, torch.iinfo(v.dtype).max).amin(1)
    hi = torch.where(mask, v, -1).amax(1)
    spanning = (hi > lo)[rows]
    return {"partial/token_staleness/mean": float(lag.mean()) if lag.numel() else 0.0,
            "partial/token_staleness/max": float(lag.max()) if lag.numel() else 0.0,
            "partial/spanning_completions": float(spanning.float().mean()) if spanning.numel() else 0.0}
