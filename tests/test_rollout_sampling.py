"""One sampling step: the filters restrict the support to exactly the right tokens, the draw follows
the renormalized distribution, and the returned log-prob is the full-vocabulary tempered one."""

import pytest
import torch

from tether.rollout import sampling
from tether.rollout.sampling import SamplingConfig, sample_tokens, sequence_keys, uniforms

V = 40


@pytest.fixture(params=[1024, 7], ids=["one-level", "two-level"], autouse=True)
def cdf_block(request, monkeypatch):
    """Run every test with the plain inverse CDF (V <= 2 blocks) and with the two-level one
    (blocks of 7 over 40 tokens: 5 full blocks and a short tail block)."""
    monkeypatch.setattr(sampling, "CDF_BLOCK", request.param)
    return request.param


def _logits(seed=0):
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 2.0  # distinct values


def _expected(z, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The filtered, renormalized distribution, written independently of the implementation."""
    p = torch.softmax(z / temperature, -1)
    keep = torch.ones(V, dtype=torch.bool)
    if top_k:
        keep[torch.argsort(p, descending=True)[top_k:]] = False
    if top_p < 1:
        q = torch.where(keep, p, 0.0)
        q = q / q.sum()
        order = torch.argsort(q, descending=True)
        mass, nucleus = 0.0, []
        for i in order.tolist():  # smallest prefix of most likely tokens holding >= top_p
            nucleus.append(i)
            mass += q[i].item()
            if mass >= top_p:
                break
        keep &= torch.isin(torch.arange(V), torch.tensor(nucleus))
    if min_p:
        q = torch.where(keep, p, 0.0)
        keep &= q >= min_p * q.max()
    out = torch.where(keep, p, 0.0)
    return out / out.sum()


def _frequencies(z, cfg, n=20000):
    u = (torch.arange(n, dtype=torch.float32) + 0.5) / n  # stratified: frequencies are near-exact
    y, lp = sample_tokens(z.expand(n, V).contiguous(), u, cfg)
    full = torch.log_softmax(z / (cfg.temperature or 1.0), -1)
    assert torch.allclose(lp, full[y], atol=1e-6)  # full-vocabulary tempered log-prob, no renormalizing
    return torch.bincount(y, minlength=V).float() / n


@pytest.mark.parametrize("settings", [
    dict(), dict(temperature=0.5), dict(temperature=1.7), dict(top_k=5), dict(top_k=1),
    dict(top_p=0.7), dict(top_p=0.05), dict(min_p=0.1), dict(top_k=10, top_p=0.8, min_p=0.05, temperature=0.8),
])
def test_filters_give_exactly_the_expected_support_and_distribution(settings):
    for seed in range(3):
        z = _logits(seed)
        freq = _frequencies(z, SamplingConfig(**settings))
        exp = _expected(z, **settings)
        assert not ((freq > 0) & (exp == 0)).any(), settings  # nothing outside the support is drawn
        assert (freq[exp >= 2e-4] > 0).all(), settings  # every token of the support that 20k
        assert (freq - exp).abs().max() < 1e-3          # stratified draws can resolve is drawn


def test_a_looser_or_tighter_support_would_be_caught():
    """The check above is sharp: the expected supports differ for neighbouring settings."""
    z = _logits(1)
    assert not torch.equal(_expected(z, top_k=5) > 0, _expected(z, top_k=6) > 0)
    assert not torch.equal(_expected(z, top_p=0.7) > 0, _expected(z, top_p=0.8) > 0)
    assert (_frequencies(z, SamplingConfig(top_k=5)) > 0).sum() == 5


def test_greedy_and_edge_uniforms():
    z = _logits(2)[None].repeat(3, 1)
    y, lp = sample_tokens(z, torch.zeros(3), SamplingConfig(temperature=0))
    assert (y == z[0].argmax()).all() and torch.allclose(lp, torch.log_softmax(z[0], -1).max().expand(3))
    # u = 0 and u -> 1 land on the first / last token of the support, never on a filtered one
    cfg = SamplingConfig(top_k=3)
    top3 = set(torch.topk(z[0], 3).indices.tolist())
    y, _ = sample_tokens(z[:2], torch.tensor([0.0, 1.0 - 2**-24]), cfg)
    assert set(y.tolist()) <= top3


def test_random_streams_depend_on_seed_prompt_and_occurrence_only():
    k = sequence_keys(0, [[1, 2], [3], [1, 2]])
    assert k[0] != k[2] and k[0] != k[1]  # the second copy of a prompt is a new sample
    assert sequence_keys(0, [[3], [1, 2]]) == [k[1], k[0]]  # independent of batch order/mates
    assert sequence_keys(1, [[1, 2]]) != [k[0]]
    u = uniforms(k, 5)
    assert u.shape == (3, 5) and torch.equal(u[0], uniforms([k[0]], 5)[0]) and 0 <= u.min() and u.max() < 1
