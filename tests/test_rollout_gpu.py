"""Rollout engine on CUDA: the graph-captured decode step against the eager one, exact fp32
log-probs, bf16 mismatch within bounds, compaction under graphs, and in-place weight updates seen."""

import pytest
import torch

from tether.models import make_tiny_model
from tether.objectives.logprobs import token_logps
from tether.rollout import Sampler, logprob_mismatch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["2+3=", "hello world, this is", "x", "The quick brown fox jumps", "ab"] * 4


def _model(dtype, family="qwen2", seed=0, eos_boost=1.0):
    model, tok = make_tiny_model(None, family=family, hidden_size=64, num_layers=2, num_heads=4,
                                 num_kv_heads=2, intermediate_size=128)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.25)
        model.get_output_embeddings().weight[tok.eos_token_id] *= eos_boost
    return model.to("cuda", dtype).eval(), tok


def _mismatch(model, ro):
    b = ro.training_batch()
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits
    return logprob_mismatch(b["logprobs"], token_logps(logits, b["input_ids"], ro.logprob_temperature),
                            b["completion_mask"])


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma3"])  # gemma3: local layers over 32 tokens
def test_graphs_equal_eager_and_fp32_logprobs_are_exact(family):
    model, tok = _model(torch.float32, family)
    for settings in (dict(temperature=0), dict(temperature=0.8, top_p=0.9, top_k=50)):
        g = Sampler(model, tok, max_new_tokens=48, **settings).sample(PROMPTS, n=2, seed=1)
        e = Sampler(model, tok, max_new_tokens=48, cuda_graphs=False, **settings).sample(PROMPTS, n=2, seed=1)
        assert g.stats["capture_s"] > 0 and e.stats["capture_s"] == 0
        assert g.texts == e.texts and g.finish_reasons == e.finish_reasons
        assert _mismatch(model, g)["sampling/sampling_logp_difference/max"] <= 1e-4


def test_compaction_under_graphs_and_graph_reuse():
    model, tok = _model(torch.float32, seed=1, eos_boost=1.2)
    s = Sampler(model, tok, max_new_tokens=64, temperature=0.9)
    a = s.sample(PROMPTS, n=3, seed=4)
    assert "eos" in a.finish_reasons and "length" in a.finish_reasons
    assert len({k[0] for k in s.graphs}) > 1  # 60 rows (bucket 64) compacted to smaller buckets
    b = s.sample(PROMPTS, n=3, seed=4)
    assert b.stats["capture_s"] == 0 and b.texts == a.texts  # graphs reused, same samples
    e = Sampler(model, tok, max_new_tokens=64, temperature=0.9, cuda_graphs=False).sample(PROMPTS, n=3, seed=4)
    assert e.texts == a.texts


def test_graphs_read_weights_updated_in_place():
    model, tok = _model(torch.float32)
    s = Sampler(model, tok, max_new_tokens=32, temperature=0)
    before = s.sample(PROMPTS).texts
    with torch.no_grad():  # an optimizer step updates parameters in place
        for p in model.parameters():
            p.mul_(1.3)
    after = s.sample(PROMPTS)
    assert after.stats["capture_s"] == 0 and after.texts != before
    assert after.texts == Sampler(model, tok, max_new_tokens=32, temperature=0, cuda_graphs=False).sample(PROMPTS).texts


def test_lent_kv_storage_under_graphs():
    """The cache as a view of a lent buffer (the GRPO trainer's gradients): graphs captured on it
    replay correctly after the lender scribbles NaN over it, the samples equal a private cache's."""
    model, tok = _model(torch.float32, seed=1, eos_boost=1.2)
    own = Sampler(model, tok, max_new_tokens=64, temperature=0.9).sample(PROMPTS, n=3, seed=4)
    s = Sampler(model, tok, max_new_tokens=64, temperature=0.9)
    s.kv_storage = torch.zeros(s.kv_cache_elements(60, 64 + 64), device="cuda")  # prompts < 64 tokens
    a = s.sample(PROMPTS, n=3, seed=4)
    assert s.backend.borrowed and s.backend.k.data_ptr() == s.kv_storage.data_ptr()
    s.kv_storage.fill_(float("nan"))
    b = s.sample(PROMPTS, n=3, seed=4)
    assert b.stats["capture_s"] == 0  # same graphs, replayed over the rewritten buffer
    for r in (a, b):
        assert r.texts == own.texts and torch.equal(r.logprobs, own.logprobs)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_bf16_mismatch_is_small(family):
    model, tok = _model(torch.bfloat16, family)
    ro = Sampler(model, tok, max_new_tokens=64).sample(PROMPTS, n=2, seed=0)
    m = _mismatch(model, ro)
    print(m)
    assert m["sampling/sampling_logp_difference/mean"] < 0.02 and m["sampling/sampling_logp_difference/max"] < 0.5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("G,D", [(7, 64), (2, 16), (4, 128), (4, 256)])
def test_decode_attention_kernel_equals_sdpa(dtype, tol, G, D):
    """The Triton decode-attention kernel against torch's SDPA: strided cache views (a slice of a
    larger cache), left-padding and future-slot masks, a block of 64 slots masked entirely."""
    from tether.rollout import kernels as attention
    if not attention.available(torch.device("cuda"), dtype, D, G):
        pytest.skip("the kernel does not run this dtype and head size (or triton is missing)")
    g = torch.Generator(device="cuda").manual_seed(0)
    B, Hkv, S, slots = 5, 2, 150, 201
    q = torch.randn(B, Hkv, G, D, device="cuda", generator=g).to(dtype)
    kc = torch.randn(B, Hkv, slots, D, device="cuda", generator=g).to(dtype)
    vc = torch.randn(B, Hkv, slots, D, device="cuda", generator=g).to(dtype)
    bias = torch.zeros(B, slots, device="cuda", dtype=dtype)
    bias[0, :20] = float("-inf")
    bias[1, 100:] = float("-inf")
    bias[2, 64:128] = float("-inf")  # one whole kernel block masked
    bias[3, :149] = float("-inf")  # only the last slot
    # this step's key / value, written into slot 140 by the kernel itself (k_new a strided view)
    k_new = torch.randn(B, Hkv + 3, D, device="cuda", generator=g).to(dtype)[:, 3:]
    v_new = torch.randn(B, Hkv, D, device="cuda", generator=g).to(dtype)
    bias[1, 140] = 0.0
    want_k, want_v = kc.clone(), vc.clone()
    want_k[:, :, 140], want_v[:, :, 140] = k_new, v_new
    k, v, b = kc[:, :, :S], vc[:, :, :S], bias[:, :S]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), want_k[:, :, :S].float(), want_v[:, :, :S].float(), attn_mask=b.float()[:, None, None],
        scale=D ** -0.5)
    got = attention.decode_attention(q, k, v, b, D ** -0.5, k_new, v_new, torch.tensor([140], device="cuda"))
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)  # the cache write, and nothing else
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=0)


@pytest.mark.parametrize("T,V", [(1.0, 5000), (0.7, 5000), (1.0, 1500)])  # 1500: one block, not a power of 2
def test_blockwise_sampling_equals_the_softmax_draw(T, V):
    """The Triton block-statistics draw (no float32 [B, V] copy) picks the token the softmax +
    inverse-CDF draw picks for the same uniform (but for float32 rounding at a token boundary), and
    its log-prob is log_softmax(z / T) at that token."""
    from tether.rollout import kernels, sampling
    if not kernels.sampling_available(torch.zeros(1, device="cuda")):
        pytest.skip("triton not importable")
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = (torch.randn(2048, V, device="cuda", generator=g) * 3).to(torch.bfloat16)
    logits[0, 1200:] = float("-inf")  # a whole block of -inf logits (V = 5000)
    u = torch.rand(2048, device="cuda", generator=g)
    p = torch.softmax(logits.float() / T, -1)
    want = sampling._inverse_cdf(p, u).squeeze(1)
    y, lp = sampling._sample_blockwise(logits, u, T)
    assert (y == want).float().mean() >= 0.99
    ref = torch.log_softmax(logits.float() / T, -1).gather(1, y[:, None]).squeeze(1)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)


def test_one_samplers_released_graphs_leave_anothers_intact():
    """Two Samplers in one process (the interleaved placement's sampler thread and the trainer's
    evaluation): destroying one's graphs must not touch the other's. Captured on torch's shared
    default capture stream they would share its cuBLAS workspace, created inside the first
    capturer's graph pool and dropped by a graph's destruction (pytorch/pytorch#193402): the other's
    GEMMs would then read freed memory. Here `b` captures first (the shared
    workspace would be in its pool), `a` second; `b` is released, the cache emptied and refilled with
    garbage, and `a` replays. The width makes the decode GEMMs long in K (split-K: a workspace)."""
    model, tok = make_tiny_model(None, family="qwen2", hidden_size=1024, num_layers=2, num_heads=8,
                                 num_kv_heads=2, intermediate_size=4096)
    model = model.to("cuda", torch.float32).eval()
    a, b = (Sampler(model, tok, max_new_tokens=24, temperature=0) for _ in range(2))
    b.sample(PROMPTS[:7])
    first = a.sample(PROMPTS).texts
    assert a._side.cuda_stream != b._side.cuda_stream
    b.release()  # its graphs destroyed, its stream handed back
    torch.cuda.empty_cache()
    junk = [torch.full((1 << 24,), float("nan"), device="cuda") for _ in range(8)]
    again = a.sample(PROMPTS)
    del junk
    assert again.stats["capture_s"] == 0 and again.texts == first
    eager = Sampler(model, tok, max_new_tokens=24, temperature=0, cuda_graphs=False).sample(PROMPTS).texts
    assert first == eager


def test_capture_streams_are_not_shared_by_live_samplers():
    """torch hands out its 32 pooled streams in turn: 40 Samplers alive at once still get 32
    different capture streams before any repeats, and one released gives its stream back."""
    import gc
    from tether.rollout import graphs
    gc.collect()  # Samplers of earlier tests gone, their streams back
    before = dict(graphs._capture_streams)
    free = 32 - len(before)
    raw = [(s.device, s.cuda_stream) for s in (graphs.take_stream(torch.device("cuda")) for _ in range(40))]
    assert len(set(raw[:free])) == free and not set(raw[:free]) & set(before)
    for k in raw:
        graphs.give_stream(k)
    assert graphs._capture_streams == before


def _episodes_on(dev, monkeypatch, temperature, overlap=None):
    """A multi-turn call on `dev` with the engine's switches at their defaults (OVERLAP_TURNS as given),
    counting the checks whose read had a step queued behind it and the record kernel's calls."""
    from test_rollout_episodes import PROMPTS as EP_PROMPTS, Replies, eosy_model
    import tether.rollout.engine as engine
    from tether.rollout import kernels

    model, tok = eosy_model()
    model = model.to(dev)
    queued, recorded = [], []
    read, record = engine._Host.read, kernels.record_step
    monkeypatch.setattr(engine._Host, "read", lambda self, st, b, t, then=None: (
        queued.append(then is not None), read(self, st, b, t, then))[1])
    monkeypatch.setattr(kernels, "record_step", lambda *a: (recorded.append(1), record(*a))[1])
    if overlap is not None:
        monkeypatch.setattr(engine, "OVERLAP_TURNS", overlap)
    replies = Replies(tok)
    ro = Sampler(model, tok, max_new_tokens=120, temperature=temperature, sync_every=5).sample(
        EP_PROMPTS, n=2, seed=3, episodes=replies)
    return model, tok, replies, ro, queued, recorded


def test_episodes_under_the_cuda_defaults_equal_one_forward_over_the_transcript(monkeypatch):
    """Multi-turn episodes sampled on CUDA as the engine runs them by default — CUDA graphs, the
    step's bookkeeping in one kernel, one more step queued behind each check's read — are the
    transcripts the environment wrote (the model's tokens as sampled, each reply after its turn),
    with fp32 log-probs equal to one training forward over the transcript and no loss on the
    replies."""
    from test_rollout_episodes import _train_logps, _transcript

    model, tok, replies, ro, queued, recorded = _episodes_on("cuda", monkeypatch, 0.9)
    assert any(queued) and recorded  # the defaults ran: a step queued at checks, the record kernel
    done = 0
    for i in range(len(ro)):
        model_ids = ro.completion_ids[i][ro.completion_mask[i]].tolist()
        assert model_ids == sum(replies.seen[i], [])[:len(model_ids)]
        if ro.finish_reasons[i] == "done":
            done += 1
            assert ro.completion_ids[i][ro.token_mask[i]].tolist() == _transcript(ro, i, replies, tok.eos_token_id)
    assert done >= len(ro) // 2
    b, lp = _train_logps(model, ro)
    m = b["completion_mask"].bool()
    assert (lp[m] - b["logprobs"][m]).abs().max() <= 1e-4
    assert not b["completion_mask"][:, ro.prompt_width:][ro.observation_mask].any()


def test_greedy_episodes_on_cuda_do_not_depend_on_the_queued_step(monkeypatch):
    """The queued step only makes an ended row wait one step more, masked: greedy episodes on CUDA
    are the same token for token, turn for turn, with it (the default) and without."""
    runs = []
    for overlap in (None, False):
        _, _, replies, ro, queued, _ = _episodes_on("cuda", monkeypatch, 0.0, overlap)
        assert any(queued) == (overlap is None)
        runs.append(([ro.completion_ids[i][ro.token_mask[i]].tolist() for i in range(len(ro))], replies.seen))
    assert runs[0] == runs[1]
    assert sum(len(v) for v in runs[0][1].values()) > len(runs[0][0])  # several turns an episode
