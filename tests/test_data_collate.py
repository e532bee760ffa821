"""Collation: padding both sides, multiples, masks; the length-grouped sampler is deterministic,
covers every index once, and shards across ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.data import LengthGroupedBatchSampler, encode_sft, join_prompt_response, pad_batch

try:
    from tests.test_data_utils import make_tokenizer
except ImportError:
    from test_data_utils import make_tokenizer

EXAMPLES = [{"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]}, {"input_ids": [8], "completion_mask": [1]}]


def test_pad_right():
    b = pad_batch(EXAMPLES, pad_id=0)
    assert set(b) == {"input_ids", "completion_mask", "attention_mask"}
    assert all(t.dtype == torch.long for t in b.values())
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["completion_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_pad_left_and_multiple():
    b = pad_batch(EXAMPLES, pad_id=9, side="left", pad_to_multiple_of=4)
    assert b["input_ids"].tolist() == [[9, 5, 6, 7], [9, 9, 9, 8]]
    assert b["completion_mask"].tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]
    assert b["attention_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]


def test_pad_values_by_key_and_errors():
    ex = [{"input_ids": [1, 2], "step_labels": [-100, 1]}, {"input_ids": [3], "step_labels": [0]}]
    b = pad_batch(ex, pad_id=0, keys=("input_ids", "step_labels"))
    assert b["step_labels"].tolist() == [[-100, 1], [0, -100]]  # labels pad with the ignore index
    with pytest.raises(ValueError, match="completion_mask has 1 entries but input_ids has 2"):
        pad_batch([{"input_ids": [1, 2], "completion_mask": [1]}], pad_id=0)
    with pytest.raises(ValueError, match="pad_id is None"):
        pad_batch(EXAMPLES, pad_id=None)
    with pytest.raises(ValueError):
        pad_batch([], pad_id=0)


def test_pad_real_encoded_batch_keeps_alignment():
    tok = make_tokenizer()
    examples, _ = encode_sft([{"prompt": "ab", "completion": "cd"}, {"prompt": "longer", "completion": " text"}], tok)
    b = pad_batch(examples, tok.pad_token_id)
    for i, ex in enumerate(examples):
        n = len(ex["input_ids"])
        assert b["input_ids"][i, :n].tolist() == ex["input_ids"]
        assert b["completion_mask"][i, :n].tolist() == ex["completion_mask"]
        assert b["completion_mask"][i, n:].sum() == 0 and b["attention_mask"][i].sum() == n
    assert join_prompt_response([1, 2], [3]) == {"input_ids": [1, 2, 3], "completion_mask": [0, 0, 1]}


def test_sampler_groups_by_length_and_is_deterministic():
    lengths = [(i * 37) % 101 for i in range(200)]
    s = LengthGroupedBatchSampler(lengths, batch_size=8, seed=3, mega_batch_mult=4)
    a, b = list(s), list(LengthGroupedBatchSampler(lengths, batch_size=8, seed=3, mega_batch_mult=4))
    assert a == b and len(a) == len(s) == 25
    assert sorted(i for batch in a for i in batch) == list(range(200))
    assert max(lengths[i] for i in a[0]) == max(lengths)  # longest batch first
    s.set_epoch(1)
    assert list(s) != a  # a new order per epoch, still deterministic
    # grouping: far less padding than random batches
    spread = sum(max(lengths[i] for i in bt) - min(lengths[i] for i in bt) for bt in a)
    assert spread < 25 * 40


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 60), bs=st.integers(1, 7), reps=st.integers(1, 4), drop_last=st.booleans(),
       seed=st.integers(0, 5))
def test_sampler_sharding_covers_every_index(n, bs, reps, drop_last, seed):
    lengths = [(i * 7) % 13 for i in range(n)]
    per_rank = [list(LengthGroupedBatchSampler(lengths, bs, seed=seed, drop_last=drop_last,
                                               num_replicas=reps, rank=r)) for r in range(reps)]
    assert len({len(b) for b in per_rank}) == 1  # every rank takes the same number of steps
    seen = [i for batches in per_rank for batch in batches for i in batch]
    if drop_last:
        assert len(seen) == len(set(seen)) and all(len(b) == bs for bs_ in per_rank for b in bs_)
    else:
        assert set(seen) == set(range(n))  # nothing lost (wrap-around may repeat a batch)
