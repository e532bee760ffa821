"""tether.objectives.logprobs: alignment, masking, precision and gradients of log-probs/entropy."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tether.objectives import entropy_from_logits, sequence_logps, sft_loss, token_entropy, token_logps

SETTINGS = settings(max_examples=40, deadline=None)


def naive_token_logps(logits, ids, temperature=1.0):
    lp = torch.log_softmax(logits[:, :-1].double() / temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return F.pad(lp, (1, 0))


def test_token_logps_matches_log_softmax_and_position_zero_is_zero():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 11, generator=g)
    ids = torch.randint(0, 11, (3, 6), generator=g)
    out = token_logps(logits, ids)
    assert out.shape == (3, 6)
    assert torch.all(out[:, 0] == 0)
    torch.testing.assert_close(out.double(), naive_token_logps(logits, ids), atol=1e-5, rtol=1e-5)


def test_token_logps_alignment_logits_t_predict_token_t_plus_1():
    # Logits at t put all mass on input_ids[t+1]; a missing or doubled shift gives ≈ −100.
    ids = torch.tensor([[3, 1, 4, 1, 5, 2]])
    logits = torch.zeros(1, 6, 7)
    for t in range(5):
        logits[0, t, ids[0, t + 1]] = 100.0
    out = token_logps(logits, ids)
    assert torch.all(out[0, 1:] > -1e-6)
    # and the first token of the completion mask picks up exactly its own log-prob
    mask = torch.tensor([[0, 0, 0, 1, 0, 0]])
    logits[0, 2, :] = 0.0  # uniform prediction of token 3
    assert sequence_logps(logits, ids, mask).item() == pytest.approx(-math.log(7), abs=1e-5)


def test_temperature_divides_logits():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 9, generator=g)
    ids = torch.randint(0, 9, (2, 5), generator=g)
    torch.testing.assert_close(token_logps(logits, ids, temperature=0.7).double(),
                               naive_token_logps(logits, ids, 0.7), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        token_logps(logits, ids, temperature=0.0)


def test_low_precision_logits_are_upcast():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 5, 50, generator=g) * 5).bfloat16()
    ids = torch.randint(0, 50, (2, 5), generator=g)
    out = token_logps(logits, ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_token_logps(logits.float(), ids), atol=1e-5, rtol=1e-5)


def test_sequence_logps_sum_and_average_over_completion_tokens():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 8, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 8, (2, 6), generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0]])
    tok = naive_token_logps(logits, ids)
    expect = (tok * mask).sum(-1)
    torch.testing.assert_close(sequence_logps(logits, ids, mask), expect)
    torch.testing.assert_close(sequence_logps(logits, ids, mask.bool()), expect)
    torch.testing.assert_close(sequence_logps(logits, ids, mask.float()), expect)
    torch.testing.assert_close(sequence_logps(logits, ids, mask, average=True), expect / torch.tensor([3.0, 2.0], dtype=torch.float64))


def test_sequence_logps_ignores_mask_at_position_zero_and_empty_rows():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 4, 5, generator=g)
    ids = torch.randint(0, 5, (2, 4), generator=g)
    m1 = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    m2 = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(sequence_logps(logits, ids, m1), sequence_logps(logits, ids, m2))
    torch.testing.assert_close(sequence_logps(logits, ids, m1, average=True), sequence_logps(logits, ids, m2, average=True))
    assert sequence_logps(logits, ids, m1, average=True)[1].item() == 0.0


@SETTINGS
@given(lengths=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5)), min_size=1, max_size=4),
       pad=st.integers(1, 4), seed=st.integers(0, 2**16), average=st.booleans())
def test_padding_never_changes_sequence_logps(lengths, pad, seed, average):
    g = torch.Generator().manual_seed(seed)
    V = 6
    T = max(p + c for p, c in lengths)
    logits = torch.randn(len(lengths), T, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for i, (p, c) in enumerate(lengths):
        mask[i, p:p + c] = True
    base = sequence_logps(logits, ids, mask, average=average)
    # More right-padding, with garbage logits (even NaN) beyond the sequences and random pad ids.
    extra = torch.randn(len(lengths), pad, V, generator=g, dtype=torch.float64) * 50
    extra[:, -1, 0] = float("nan")
    logits_p = torch.cat([logits, extra], 1)
    ids_p = torch.cat([ids, torch.randint(0, V, (len(lengths), pad), generator=g)], 1)
    mask_p = torch.cat([mask, torch.zeros(len(lengths), pad, dtype=torch.bool)], 1)
    torch.testing.assert_close(sequence_logps(logits_p, ids_p, mask_p, average=average), base)


def test_sequence_logps_gradcheck():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 5, (2, 4), generator=g)
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0]])
    assert torch.autograd.gradcheck(lambda z: sequence_logps(z, ids, mask), (logits,))
    assert torch.autograd.gradcheck(lambda z: sequence_logps(z, ids, mask, average=True, temperature=0.8), (logits,))


def test_sft_loss_matches_hf_shifted_cross_entropy():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 6, 10, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 10, (2, 6), generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]])
    loss, metrics = sft_loss(logits, labels, mask)
    hf_labels = labels.masked_fill(mask == 0, -100)
    expect = F.cross_entropy(logits[:, :-1].reshape(-1, 10), hf_labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss, expect)
    assert metrics["num_tokens"].item() == 6 and not metrics["nll"].requires_grad
    # -100 labels are ignored the same way, with or without a mask
    loss2, _ = sft_loss(logits, hf_labels)
    torch.testing.assert_close(loss2, expect)


def naive_entropy(logits):
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


def test_entropy_values_uniform_onehot_and_naive():
    V = 16
    uniform = torch.zeros(1, 2, V)
    assert token_entropy(uniform)[0, 0].item() == pytest.approx(math.log(V), rel=1e-6)
    peaked = torch.full((1, 1, V), -1e4)
    peaked[..., 3] = 0
    assert token_entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5, V, generator=g, dtype=torch.float64) * 3
    torch.testing.assert_close(token_entropy(logits), naive_entropy(logits))
    torch.testing.assert_close(token_entropy(logits, temperature=2.0), naive_entropy(logits / 2.0))


def test_entropy_from_logits_is_masked_mean_without_shift():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(2, 4, 6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]])
    H = naive_entropy(logits)
    torch.testing.assert_close(entropy_from_logits(logits, mask), (H * mask).sum() / mask.sum())
    # garbage (NaN) logits at masked-out positions do not leak into the value
    bad = logits.clone()
    bad[0, 3] = float("nan")
    torch.testing.assert_close(entropy_from_logits(bad, mask), (H * mask).sum() / mask.sum())


def test_entropy_handles_minus_inf_logits():
    logits = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]], requires_grad=True)
    h = entropy_from_logits(logits, torch.ones(1, 1))
    assert h.item() == pytest.approx(math.log(2), rel=1e-6)
    h.backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_gradcheck_and_matches_autograd_of_naive():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert torch.autograd.gradcheck(lambda z: token_entropy(z, temperature=1.3), (logits,))
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, mask), (logits,))
    (g1,) = torch.autograd.grad(entropy_from_logits(logits, mask), logits)
    (g2,) = torch.autograd.grad((naive_entropy(logits) * mask).sum() / mask.sum(), logits)
    torch.testing.assert_close(g1, g2)


def test_entropy_keeps_only_logits_for_backward():
    # The memory-lean contract: the graph saves the logits (already alive) and nothing [B,T,V]-sized
    # of its own, unlike log_softmax/softmax autograd.
    logits = torch.randn(2, 3, 7, requires_grad=True)
    out = token_entropy(logits)
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 1 and saved[0].data_ptr() == logits.data_ptr()


def test_token_logps_gradient_matches_log_softmax_autograd_and_keeps_only_logits():
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(2, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 7, (2, 5), generator=g)
    w = torch.randn(2, 5, generator=g, dtype=torch.float64)
    (g1,) = torch.autograd.grad((token_logps(logits, ids, temperature=0.9) * w).sum(), logits)
    (g2,) = torch.autograd.grad((naive_token_logps(logits, ids, 0.9) * w).sum(), logits)
    torch.testing.assert_close(g1, g2)
    assert torch.all(g1[:, -1] == 0)  # the last position predicts nothing inside the sequence
    assert torch.autograd.gradcheck(lambda z: token_logps(z, ids, temperature=1.7), (logits,))
    out = token_logps(logits.detach().bfloat16().requires_grad_(), ids)
    node = out.grad_fn.next_functions[0][0]  # pad ← _TokenLogps
    assert "TokenLogps" in type(node).__name__
    assert [x.dtype for x in node.saved_tensors] == [torch.bfloat16, torch.int64]  # no float32 copy


@pytest.mark.parametrize("budget", [1, 13, 40])
def test_tiled_log_probs_and_entropy_match_naive_for_any_tile_size(monkeypatch, budget):
    # The default tile (BLOCK_ELEMENTS) covers these small shapes in one block; shrink it so the
    # row-block and time-slice paths (and their boundaries) are exercised, forward and backward.
    from tether.objectives import logprobs
    monkeypatch.setattr(logprobs, "BLOCK_ELEMENTS", budget)
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 6, 7, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 7, (3, 6), generator=g)
    w = torch.randn(3, 6, generator=g, dtype=torch.float64)
    out = token_logps(logits, ids, temperature=0.8)
    torch.testing.assert_close(out, naive_token_logps(logits.detach(), ids, 0.8))
    (g1,) = torch.autograd.grad((out * w).sum(), logits)
    (g2,) = torch.autograd.grad((naive_token_logps(logits, ids, 0.8) * w).sum(), logits)
    torch.testing.assert_close(g1, g2)
    torch.testing.assert_close(token_entropy(logits.detach()), naive_entropy(logits.detach()))
    (h1,) = torch.autograd.grad((token_entropy(logits) * w).sum(), logits)
    (h2,) = torch.autograd.grad((naive_entropy(logits) * w).sum(), logits)
    torch.testing.assert_close(h1, h2)
    if budget == 13:  # gradcheck with tiles of one position (5 // 4 = 1) inside one row
        monkeypatch.setattr(logprobs, "BLOCK_ELEMENTS", 5)
        small = logits.detach()[:2, :3, :4].clone().requires_grad_()
        assert torch.autograd.gradcheck(lambda z: token_logps(z, ids[:2, :3] % 4, temperature=1.3), (small,))
        assert torch.autograd.gradcheck(lambda z: token_entropy(z, temperature=0.7), (small,))
    bf = logits.detach().bfloat16()
    torch.testing.assert_close(token_logps(bf, ids), naive_token_logps(bf.float(), ids).float(), atol=1e-5, rtol=1e-5)


def test_tiles_cover_every_position_exactly_once():
    from tether.objectives.logprobs import _tiles
    for B, T, V, budget in [(3, 6, 7, 1), (3, 6, 7, 13), (3, 6, 7, 50), (3, 6, 7, 10**9), (1, 1, 4, 2), (0, 5, 3, 8)]:
        seen = torch.zeros(B, T, dtype=torch.long)
        for b0, b1, t0, t1 in _tiles(B, T, V, budget):
            assert (b1 - b0) * (t1 - t0) * V <= max(budget, V)  # one position is the smallest tile
            seen[b0:b1, t0:t1] += 1
        assert torch.all(seen == 1)


def test_sft_loss_with_nothing_to_train_is_plus_zero():
    loss, m = sft_loss(torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3)), torch.zeros(2, 3))
    assert loss.item() == 0.0 and math.copysign(1.0, loss.item()) == 1.0 and m["num_tokens"].item() == 0
