"""The chunked LM head's Triton kernels (`models/head_kernels.py`) against the torch math they
replace: softmax statistics, the in-place logits gradient (whole vocabulary and a vocabulary slice),
and the whole policy forward's log-probs, entropy and parameter gradients with and without them.

Runs on CUDA; on a machine without one, under Triton's interpreter (TRITON_INTERPRET=1) on CPU."""

import copy
import os
from contextlib import nullcontext

import pytest
import torch

from tether.models import make_tiny_model
from tether.models import head_kernels
from tether.models import logprobs as common

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(head_kernels.triton is None or not (DEV == "cuda" or INTERPRET),
                                 reason="needs Triton on CUDA (or TRITON_INTERPRET=1)")]


def _logits(n=7, V=5000, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, V, generator=g) * 3).to(DEV, dtype)
    y = torch.randint(0, V, (n,), generator=g).to(DEV)
    return z, y


@pytest.mark.parametrize("want_ent", [True, False])
def test_stats_match_torch(want_ent):
    z, y = _logits()
    T = 0.7
    lse, lp, ent = head_kernels.softmax_stats(z, y, T, want_ent)
    x = z.double() / T
    ref_lse = torch.logsumexp(x, -1)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=0)
    torch.testing.assert_close(lp.double(), x.gather(1, y[:, None])[:, 0] - ref_lse, atol=2e-5, rtol=0)
    if want_ent:
        p = torch.softmax(x, -1)
        torch.testing.assert_close(ent.double(), -(p * torch.log_softmax(x, -1)).sum(-1), atol=2e-5, rtol=0)


@pytest.mark.parametrize("has_lp,has_ent,v0", [(True, True, 0), (True, False, 1200), (False, True, 1200)])
def test_grad_in_place_matches_torch(has_lp, has_ent, v0):
    """dz over columns v0..v0+1500 of the vocabulary; targets inside and outside that slice."""
    z, y = _logits()
    T = 0.7
    y[:3] = v0 + torch.tensor([0, 5, 1499], device=DEV)  # inside the slice, at both ends
    lse, _, ent = head_kernels.softmax_stats(z, y, T, True)
    g = torch.Generator().manual_seed(1)
    g_lp = torch.randn(7, generator=g).to(DEV) if has_lp else None
    g_ent = torch.randn(7, generator=g).to(DEV) if has_ent else None
    part = z[:, v0:v0 + 1500].clone()
    out = head_kernels.grad_in_place(part, y, lse, ent, g_lp, g_ent, T, v0)
    assert out.data_ptr() == part.data_ptr()
    # reference: autograd through lp = log softmax(z/T)[y] and H = entropy(softmax(z/T))
    zr = z.double().requires_grad_()
    logp = torch.log_softmax(zr / T, -1)
    loss = 0
    if has_lp:
        loss = loss + (logp.gather(1, y[:, None])[:, 0] * g_lp.double()).sum()
    if has_ent:
        loss = loss + (-(logp.exp() * logp).sum(-1) * g_ent.double()).sum()
    loss.backward()
    torch.testing.assert_close(out.double(), zr.grad[:, v0:v0 + 1500], atol=1e-6, rtol=1e-4)


def test_policy_forward_same_with_and_without_kernels(monkeypatch):
    """completion_token_logps through the chunked head: kernels vs torch path, fp32."""
    torch.manual_seed(0)
    model, _ = make_tiny_model(None)
    model.float().to(DEV)
    B, T = 3, 14
    ids = torch.randint(3, model.config.vocab_size, (B, T), device=DEV)
    am = torch.ones(B, T, dtype=torch.long, device=DEV)
    am[0, :3] = 0
    cm = torch.zeros(B, T, dtype=torch.long, device=DEV)
    cm[:, 6:] = 1
    cm[1, 10:] = 0
    batch = dict(input_ids=ids, attention_mask=am, completion_mask=cm)
    monkeypatch.setattr(common, "HEAD_CHUNK_ELEMENTS", 3 * model.config.vocab_size // 2)  # chunks < 2 rows
    out = []
    for use in (True, False):
        monkeypatch.setattr(head_kernels, "available", lambda z, use=use: use)
        m = copy.deepcopy(model)
        lp, ent = common.completion_token_logps(m, batch, 0.7, nullcontext(), True, True)
        ((lp * torch.linspace(0.5, 1.5, T, device=DEV)).sum() + ent).backward()
        out.append((lp.detach(), ent.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (lp1, e1, g1), (lp0, e0, g0) = out
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(e1, e0, atol=1e-5, rtol=0)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-4, msg=n)
