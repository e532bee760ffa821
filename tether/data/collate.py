"""Batching: padding token lists into tensors, and a length-grouped batch sampler.

Everything here is deterministic: the sampler's order depends only on (seed, epoch, lengths).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import torch

__all__ = ["pad_batch", "pack_batch", "collate_sequences", "sequence_sums", "join_prompt_response",
           "pad_preference_batch", "LengthGroupedBatchSampler"]

PACKING = ("", "rows", "row")  # off (padded rows) | packed rows | one packed row (collate_sequences)


def _pad_value(key: str, pad_id: int, overrides: Mapping[str, int] | None) -> int:
    if overrides and key in overrides:
        return overrides[key]
    if key == "input_ids" or key.endswith("_ids"):
        return pad_id
    if key.endswith("labels"):
        return -100  # the ignore index of torch's cross-entropy
    return 0  # masks


def pad_batch(examples: Sequence[Mapping[str, Sequence[int]]], pad_id: int,
              keys: Sequence[str] = ("input_ids", "completion_mask"), side: str = "right",
              pad_to_multiple_of: int | None = None,
              pad_values: Mapping[str, int] | None = None) -> dict[str, torch.Tensor]:
    """Pad per-example token lists to one ``LongTensor`` per key, plus ``attention_mask``.

    All ``keys`` of an example describe the same sequence and must have equal lengths. Padding
    values: ``pad_id`` for ``input_ids``/``*_ids``, -100 for ``*labels``, 0 otherwise (override
    with ``pad_values``). ``side="left"`` pads at the start (for generation).
    ``attention_mask`` is 1 on real tokens.
    """
    if not examples:
        raise ValueError("pad_batch needs at least one example")
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    if pad_id is None:
        raise ValueError("pad_id is None: the tokenizer has no pad token (set tokenizer.pad_token, "
                         "e.g. to its eos_token)")
    lengths = [len(ex[keys[0]]) for ex in examples]
    for i, ex in enumerate(examples):
        for k in keys[1:]:
            if len(ex[k]) != lengths[i]:
                raise ValueError(f"example {i}: {k} has {len(ex[k])} entries but {keys[0]} has {lengths[i]}")
    width = max(lengths)
    if pad_to_multiple_of:
        width = math.ceil(width / pad_to_multiple_of) * pad_to_multiple_of
    out = {}
    for k in keys:
        t = torch.full((len(examples), width), _pad_value(k, pad_id, pad_values), dtype=torch.long)
        for i, ex in enumerate(examples):
            n = lengths[i]
            if n:
                row = torch.as_tensor(list(ex[k]), dtype=torch.long)
                if side == "right":
                    t[i, :n] = row
                else:
                    t[i, width - n:] = row
        out[k] = t
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    for i, n in enumerate(lengths):
        if side == "right":
            attn[i, :n] = 1
        elif n:
            attn[i, width - n:] = 1
    out["attention_mask"] = attn
    return out


def pack_batch(examples: Sequence[Mapping[str, Sequence[int]]], pad_id: int,
               keys: Sequence[str] = ("input_ids", "completion_mask"), one_row: bool = False,
               pad_values: Mapping[str, int] | None = None) -> dict[str, torch.Tensor]:
    """Padding-free packing: the examples laid end to end in rows, each keeping its own positions.

    Rows: first-fit decreasing (longest example first, each into the first row it fits) into rows
    no longer than the longest example, so a row holds several short examples where a padded batch
    would hold one and padding; `one_row`: everything in a single row (what flash attention's
    varlen kernels want: transformers runs them from the position ids when the batch is one row).
    Returns, besides ``keys`` [R, W] (padded as :func:`pad_batch` at the rows' ends):

    - ``position_ids``: 0, 1, ... restarting at each example (and on a row's padding tail), so
      rotary positions are the unpacked ones. Given these and *no* attention mask, transformers
      (masking_utils.find_packed_sequence_indices) cuts the rows where a position does not follow
      its predecessor and builds a causal mask that is block-diagonal per example: attention never
      crosses examples (`tether.models.logprobs.forward_inputs` passes it that way);
    - ``sequence_ids``: the example's index in ``examples`` on its tokens, -1 on padding (per-example
      sums: :func:`sequence_sums`); ``sequence_ends``: each example's last token as a flat index
      into the [R * W] tokens (a reward model reads its score there);
    - ``attention_mask``: 1 on real tokens, for counting them only (the model gets none).

    ``completion_mask`` is 0 at each example's first token: the token before it belongs to another
    example, so nothing predicts it (in a padded batch position 0 is never a target either), and
    the targets are exactly the unpacked batch's.
    """
    if not examples:
        raise ValueError("pack_batch needs at least one example")
    if pad_id is None:
        raise ValueError("pad_id is None: the tokenizer has no pad token (set tokenizer.pad_token, "
                         "e.g. to its eos_token)")
    lengths = [len(ex[keys[0]]) for ex in examples]
    for i, ex in enumerate(examples):
        if not lengths[i]:
            raise ValueError(f"example {i} is empty: packing needs at least one token per example")
        for k in keys[1:]:
            if len(ex[k]) != lengths[i]:
                raise ValueError(f"example {i}: {k} has {len(ex[k])} entries but {keys[0]} has {lengths[i]}")
    capacity = sum(lengths) if one_row else max(lengths)
    rows: list[list[int]] = []  # example indices per row, in packing order
    fill: list[int] = []
    for i in sorted(range(len(examples)), key=lambda j: -lengths[j]):  # stable: ties keep file order
        r = next((r for r in range(len(rows)) if fill[r] + lengths[i] <= capacity), None)
        if r is None:
            rows.append([])
            fill.append(0)
            r = len(rows) - 1
        rows[r].append(i)
        fill[r] += lengths[i]
    R, W = len(rows), max(fill)
    out = {k: torch.full((R, W), _pad_value(k, pad_id, pad_values), dtype=torch.long) for k in keys}
    pos = torch.zeros((R, W), dtype=torch.long)
    seq = torch.full((R, W), -1, dtype=torch.long)
    ends = torch.zeros(len(examples), dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            n = lengths[i]
            for k in keys:
                out[k][r, at:at + n] = torch.as_tensor(list(examples[i][k]), dtype=torch.long)
            pos[r, at:at + n] = torch.arange(n)
            seq[r, at:at + n] = i
            ends[i] = r * W + at + n - 1
            at += n
        pos[r, at:] = torch.arange(W - at)  # the padding tail: a block of its own
    if "completion_mask" in out:
        out["completion_mask"][pos == 0] = 0
    out.update(position_ids=pos, sequence_ids=seq, sequence_ends=ends, attention_mask=(seq >= 0).long())
    return out


def collate_sequences(seqs: Sequence[Mapping[str, Sequence[int]]], pad_id: int, packing: str = "",
                      keys: Sequence[str] = ("input_ids", "completion_mask")) -> dict[str, torch.Tensor]:
    """One batch of ``seqs``: right-padded rows (``packing=""``), or packed (:func:`pack_batch`:
    ``"rows"``, or ``"row"`` for one row). Per-sequence numbers of either: :func:`sequence_sums`."""
    if packing not in PACKING:
        raise ValueError(f"packing must be one of {PACKING}; got {packing!r}")
    if not packing:
        return pad_batch(seqs, pad_id, keys=keys)
    return pack_batch(seqs, pad_id, keys=keys, one_row=packing == "row")


def sequence_sums(values: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Per-sequence sums [N] of per-token ``values`` [R, W] (0 where they should not count): row
    sums of a padded batch, sums over each example's tokens of a packed one, in example order.
    Differentiable."""
    seq = batch.get("sequence_ids")
    if seq is None:
        return values.sum(-1)
    seq = seq.to(values.device).flatten()
    keep = (seq >= 0).nonzero().squeeze(1)
    return values.new_zeros(len(batch["sequence_ends"])).index_add(
        0, seq.index_select(0, keep), values.flatten().index_select(0, keep))


def join_prompt_response(prompt_ids: Sequence[int], response_ids: Sequence[int]) -> dict[str, list[int]]:
    """``{input_ids: prompt + response, completion_mask: 0 on prompt, 1 on response}``."""
    return {"input_ids": list(prompt_ids) + list(response_ids),
            "completion_mask": [0] * len(prompt_ids) + [1] * len(response_ids)}


def pad_preference_batch(examples: Sequence[Mapping], pad_id: int, side: str = "right",
                         pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """Preference examples (from ``encode_preference``) -> one padded batch of 2B sequences:
    rows ``0..B-1`` are prompt+chosen, rows ``B..2B-1`` prompt+rejected (one forward pass for
    both, as DPO/reward-model trainers want). Keys: input_ids, completion_mask, attention_mask."""
    seqs = [join_prompt_response(ex["prompt_ids"], ex["chosen_ids"]) for ex in examples]
    seqs += [join_prompt_response(ex["prompt_ids"], ex["rejected_ids"]) for ex in examples]
    return pad_batch(seqs, pad_id, side=side, pad_to_multiple_of=pad_to_multiple_of)


class LengthGroupedBatchSampler:
    """Batches of indices whose sequences have similar lengths (less padding), in random order.

    Indices are shuffled with ``seed + epoch``, cut into mega-batches of
    ``batch_size * mega_batch_mult`` (sorted by length inside, so batches are homogeneous), and the
    batches shuffled again; the batch holding the longest sequence goes first so that an
    out-of-memory error shows up at step 1. With ``num_replicas > 1`` each rank gets every
    ``num_replicas``-th batch; the batch list is cut (``drop_last``) or wrapped around so that all
    ranks get the same number of batches.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False, mega_batch_mult: int = 50, num_replicas: int = 1, rank: int = 0):
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} out of range for num_replicas={num_replicas}")
        self.lengths = list(lengths)
        self.batch_size, self.seed, self.shuffle, self.drop_last = batch_size, seed, shuffle, drop_last
        self.mega = max(1, mega_batch_mult) * batch_size
        self.num_replicas, self.rank = num_replicas, rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _all_batches(self) -> list[list[int]]:
        n = len(self.lengths)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(n, generator=g).tolist() if self.shuffle else list(range(n))
        batches = []
        for s in range(0, n, self.mega):
            chunk = sorted(order[s:s + self.mega], key=lambda i: -self.lengths[i])
            batches += [chunk[j:j + self.batch_size] for j in range(0, len(chunk), self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            # the short batch is whichever is smaller; drop exactly that one
            batches = [b for b in batches if len(b) == self.batch_size]
        if self.shuffle and len(batches) > 1:
            perm = torch.randperm(len(batches), generator=g).tolist()
            batches = [batches[i] for i in perm]
            longest = max(range(len(batches)), key=lambda b: max(self.lengths[i] for i in batches[b]))
            batches[0], batches[longest] = batches[longest], batches[0]
        r = self.num_replicas
        if r > 1 and batches and len(batches) % r:
            if self.drop_last:
                batches = batches[:len(batches) - len(batches) % r]
            else:
                batches += [batches[i % len(batches)] for i in range(r - len(batches) % r)]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._all_batches()[self.rank::self.num_replicas])

    def __len__(self) -> int:
        return len(self._all_batches()[self.rank::self.num_replicas])
