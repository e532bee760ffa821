"""Rollout engine on CPU: exactness against HF generate and a training forward, padding/batch
invariance, reproducibility, stop strings, finish reasons, n samples, and the graph code path."""

import pytest
import torch

from tether.models import make_tiny_model
from tether.objectives.logprobs import token_logps
from tether.rollout import Sampler, SamplingConfig, logprob_mismatch, native_support
from tether.rollout.hf import generate

PROMPTS = ["2+3=", "hello world, this is", "x", "The quick brown fox jumps", "ab"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # The CI box has 2 shared cores: tiny ops in 2-thread parallel regions can stall for a whole
    # scheduler quantum when the other core is busy, making this suite 10x slower.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _sharpen(model, std=0.3, seed=0, eos_boost=1.0, eos_id=None):
    """Random weights with enough scale that greedy decoding is varied, not one repeated char."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        if eos_id is not None:  # make EOS likely (tied embeddings: raises its logit everywhere)
            model.get_output_embeddings().weight[eos_id] *= eos_boost
    return model.eval()


def _tiny(family="llama", **kw):
    model, tok = make_tiny_model(None, family=family, hidden_size=32, num_layers=2, num_heads=2,
                                 num_kv_heads=1, intermediate_size=64)
    return _sharpen(model, eos_id=tok.eos_token_id, **kw), tok


@pytest.fixture(scope="module")
def lm():
    return _tiny()


@pytest.fixture(scope="module")
def eosy():
    """A model that ends most sequences early, at varied lengths (exercises batch compaction)."""
    return _tiny(seed=1, eos_boost=3.0)


def _ids(tok, text):
    return [tok.bos_token_id] + tok(text, add_special_tokens=False).input_ids


def _hf_greedy(model, tok, text, new):
    ids = torch.tensor([_ids(tok, text)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def _completion(ro, i):
    return ro.completion_ids[i][ro.completion_mask[i]].tolist()


def _train_logps(model, ro):
    b = ro.training_batch()
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits
    return b, token_logps(logits, b["input_ids"], ro.logprob_temperature)


def test_training_batch_padded_to_a_multiple_is_the_same_batch(lm):
    """training_batch(16) (GRPO's: few distinct widths on CUDA) pads on the right only: every tensor
    of the unpadded batch is its first columns, the padding is masked everywhere, and a training
    forward gives the same log-probs at every real position."""
    model, tok = lm
    ro = Sampler(model, tok).sample(PROMPTS, n=2, seed=0, max_new_tokens=13, temperature=1.0)
    plain, padded = ro.training_batch(), ro.training_batch(16)
    W = plain["input_ids"].shape[1]
    assert W % 16 and padded["input_ids"].shape[1] == W + (-W % 16)
    for k in plain:
        assert torch.equal(padded[k][:, :W], plain[k]), k
    assert not padded["attention_mask"][:, W:].any() and not padded["completion_mask"][:, W:].any()
    assert (padded["logprobs"][:, W:] == 0).all() and (padded["input_ids"][:, W:] == ro.pad_token_id).all()
    logps = []
    for b in (plain, padded):
        with torch.no_grad():
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                           position_ids=b["position_ids"]).logits
        logps.append(token_logps(logits, b["input_ids"], 1.0)[:, :W] * plain["completion_mask"])
    torch.testing.assert_close(logps[1], logps[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family,backend", [("llama", "native"), ("llama", "hf"), ("qwen2", "native")])
def test_greedy_equals_hf_generate_token_for_token(family, backend):
    model, tok = _tiny(family)
    ro = Sampler(model, tok, backend=backend).sample(PROMPTS, max_new_tokens=24, temperature=0)
    assert ro.stats["backend"] == backend
    for i, p in enumerate(PROMPTS):  # HF alone on each prompt (no padding) vs ours in a ragged batch
        hf = _hf_greedy(model, tok, p, 24)
        ours = _completion(ro, i)
        assert ours == hf[:len(ours)] and (len(ours) == 24 or ours[-1] == tok.eos_token_id)
    assert len({tuple(_completion(ro, i)) for i in range(len(PROMPTS))}) == len(PROMPTS)


@pytest.mark.parametrize("settings", [dict(temperature=0), dict(temperature=1.0),
                                      dict(temperature=0.7, top_k=8, top_p=0.9, min_p=0.02)])
def test_logprobs_match_a_training_forward(lm, settings):
    model, tok = lm
    ro = Sampler(model, tok).sample(PROMPTS, n=2, seed=0, max_new_tokens=32, **settings)
    assert ro.logprob_temperature == (settings["temperature"] or 1.0)
    b, lp = _train_logps(model, ro)
    m = logprob_mismatch(b["logprobs"], lp, b["completion_mask"])
    assert m["sampling/sampling_logp_difference/max"] <= 1e-4, m
    assert abs(m["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4
    # masked positions carry no log-prob; sampled tokens are never impossible
    assert (ro.logprobs[~ro.completion_mask] == 0).all() and (ro.logprobs[ro.completion_mask] < 0).all()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ragged_padding_and_batch_mates_do_not_change_a_sequence(lm, temperature):
    model, tok = lm
    s = Sampler(model, tok, max_new_tokens=30, temperature=temperature, top_k=20)
    batch = s.sample(PROMPTS, n=2, seed=11)
    for i, p in enumerate(PROMPTS):
        alone = s.sample([p], n=2, seed=11)
        for j in range(2):
            assert _completion(alone, j) == _completion(batch, 2 * i + j)
            assert alone.finish_reasons[j] == batch.finish_reasons[2 * i + j]
            k = alone.completion_mask[j].sum()
            assert torch.allclose(alone.logprobs[j, :k], batch.logprobs[2 * i + j, :k], atol=1e-5)


def test_seeded_sampling_is_reproducible_and_seeds_differ(lm):
    model, tok = lm
    s = Sampler(model, tok, max_new_tokens=20)
    a, b, c = s.sample(PROMPTS, seed=3), s.sample(PROMPTS, seed=3), s.sample(PROMPTS, seed=4)
    assert a.texts == b.texts and torch.equal(a.logprobs, b.logprobs)
    assert a.texts != c.texts
    torch.manual_seed(0)  # no seed: drawn from torch's RNG, so seeding torch reproduces too
    d = Sampler(model, tok, max_new_tokens=20).sample(PROMPTS)
    torch.manual_seed(0)
    assert Sampler(model, tok, max_new_tokens=20).sample(PROMPTS).texts == d.texts


def test_n_samples_per_prompt_are_grouped_and_distinct(lm):
    model, tok = lm
    ro = Sampler(model, tok).sample(PROMPTS[:3], n=4, seed=1, max_new_tokens=16)
    assert len(ro) == 12 and ro.group.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert ro.prompt_ids[4] == _ids(tok, PROMPTS[1])
    assert len(set(ro.texts[4:8])) > 1  # the n samples of one prompt are different draws
    # repeating a prompt in the list behaves like n (later copies are further samples)
    rep = Sampler(model, tok).sample([PROMPTS[0]] * 2, n=2, seed=1, max_new_tokens=16)
    assert rep.texts == ro.texts[0:4]


@pytest.mark.parametrize("path", ["c-step", "torch", "graphs", "hf", "window", "chunks"])
def test_a_prompt_sampled_n_times_is_prefilled_once_with_the_same_samples(eosy, monkeypatch, path):
    """engine.SHARE_PREFILL: the n rows of a prompt (and a repeated prompt, and a graph bucket's
    spare rows) share one prefill — the backend prefills only the distinct prompts and copies their
    cache rows — and the rollout equals the one that prefills every row: the same tokens, log-probs,
    finish reasons, on the C step, the torch path, the emulated graphs (with compaction), the HF
    backend and a sliding-window model. More distinct prompts than one prefill chunk holds: every
    row is prefilled, chunk by chunk, as without sharing."""
    from tether.rollout import engine, native
    model, tok = _windowed("gemma3") if path == "window" else eosy
    prompts = PROMPTS + [PROMPTS[1]]
    if path in ("torch", "window"):
        monkeypatch.setattr(native, "DECODE_ATTN", "bmm")
    backend = "hf" if path == "hf" else "native"
    rows = []

    def run(share):
        monkeypatch.setattr(engine, "SHARE_PREFILL", share)
        s = Sampler(model, tok, backend=backend, max_new_tokens=24, temperature=0.9, sync_every=3,
                    **({"prefill_tokens": 16} if path == "chunks" else {}))
        s._emulate_graphs = path == "graphs"
        real = None

        def spy(ids, attn, row0):
            rows.append((share, ids.shape[0]))
            return real(ids, attn, row0)
        s._pick_backend(s.config, 64)
        real, s.backend.prefill = s.backend.prefill, spy
        return s.sample(prompts, n=3, seed=4)
    shared, plain = run(True), run(False)
    prefilled = sum(n for sh, n in rows if sh)
    assert prefilled == (3 * len(prompts) if path == "chunks" else len(PROMPTS))  # a repeated prompt shares too
    assert sum(n for sh, n in rows if not sh) >= 3 * len(prompts)
    assert shared.texts == plain.texts and shared.finish_reasons == plain.finish_reasons
    assert torch.equal(shared.logprobs, plain.logprobs)
    assert len(set(shared.texts[:3])) > 1  # a prompt's rows still draw their own samples


def test_stop_strings_cut_at_the_completing_token(lm):
    model, tok = lm
    s = Sampler(model, tok, max_new_tokens=30, temperature=0)
    free = s.sample(PROMPTS)
    stops = [t[6:8] for t in free.texts]  # a 2-char string each greedy completion reaches later
    for sync in (1, 4):  # checked every step, and every 4 steps (rows overshoot, then are cut)
        ro = s.sample(PROMPTS, stop=stops, sync_every=sync)
        for i, t in enumerate(free.texts):
            cut = min(t.find(x) + len(x) for x in stops if x in t)
            assert ro.texts[i] == t[:cut], (ro.texts[i], t, stops)
            assert ro.finish_reasons[i] == "stop"
            assert tok.decode(_completion(ro, i), skip_special_tokens=True) == ro.texts[i]
    # a stop string never produced changes nothing
    assert s.sample(PROMPTS, stop=["\u00d7\u00f7\u00d7"]).texts == free.texts


def test_finish_reasons_eos_stop_token_and_length(lm, eosy):
    model, tok = lm
    s = Sampler(model, tok, max_new_tokens=12, temperature=0)
    free = s.sample(PROMPTS)
    assert all(r == "length" for r in free.finish_reasons) and free.completion_mask.all()
    # an extra end token: the completion ends with it, reason 'eos'
    end = _completion(free, 1)[5]
    ro = s.sample(PROMPTS, stop_token_ids=[end])
    i = _completion(free, 1).index(end)
    assert _completion(ro, 1) == _completion(free, 1)[:i + 1] and ro.finish_reasons[1] == "eos"
    # the EOS-prone model: EOS included and masked in, nothing after it
    model, tok = eosy
    ro = Sampler(model, tok, max_new_tokens=40).sample(PROMPTS, n=4, seed=0)
    eos = [i for i, r in enumerate(ro.finish_reasons) if r == "eos"]
    assert 0 < len(eos) < len(ro)
    for i in eos:
        c = _completion(ro, i)
        assert c[-1] == tok.eos_token_id and tok.eos_token_id not in c[:-1]
    ign = Sampler(model, tok, max_new_tokens=40, ignore_eos=True).sample(PROMPTS, n=4, seed=0)
    assert ign.completion_mask.all() and set(ign.finish_reasons) == {"length"}
    for i in eos:  # ignoring EOS continues the very same sequences
        assert _completion(ign, i)[:len(_completion(ro, i))] == _completion(ro, i)


def test_graph_code_path_and_compaction_match_plain_eager(eosy, monkeypatch):
    """The CUDA-graph path (bucketed batch, scratch-slot warm-up, attention over KV-length buckets,
    compaction to smaller buckets) emulated on CPU gives the same tokens as the plain eager loop."""
    from tether.rollout import engine
    monkeypatch.setattr(engine, "KV_BUCKET", 8)  # prompts + 40 new tokens: graphs at several KV lengths
    model, tok = eosy
    prompts = [f"{i}: " + PROMPTS[i % 5] for i in range(20)]
    for settings in (dict(temperature=0), dict(temperature=0.9, top_p=0.95)):
        plain = Sampler(model, tok, max_new_tokens=40, **settings).sample(prompts, n=2, seed=2)
        g = Sampler(model, tok, max_new_tokens=40, sync_every=3, **settings)
        g._emulate_graphs = True
        ro = g.sample(prompts, n=2, seed=2)
        assert ro.texts == plain.texts and ro.finish_reasons == plain.finish_reasons
        assert torch.allclose(ro.logprobs, plain.logprobs, atol=1e-5)
        assert {k[0] for k in g.graphs} >= {48, 16}  # 40 rows -> bucket 48, compacted to 16 or less
        assert len({k[1] for k in g.graphs}) >= 3  # several attended KV lengths
        b, lp = _train_logps(model, ro)
        assert logprob_mismatch(b["logprobs"], lp, b["completion_mask"])[
            "sampling/sampling_logp_difference/max"] <= 1e-4


def test_backends_agree_and_waves_equal_one_batch(eosy):
    model, tok = eosy
    kw = dict(max_new_tokens=30, temperature=0.8, top_k=30)
    native = Sampler(model, tok, backend="native", **kw).sample(PROMPTS, n=3, seed=9)
    hf = Sampler(model, tok, backend="hf", **kw).sample(PROMPTS, n=3, seed=9)
    waves = Sampler(model, tok, max_batch_size=4, **kw).sample(PROMPTS, n=3, seed=9)
    assert native.texts == hf.texts == waves.texts
    assert torch.equal(native.completion_mask, waves.completion_mask)


def test_other_architectures_fall_back_to_the_hf_backend():
    from transformers import GPT2Config, GPT2LMHeadModel
    _, tok = make_tiny_model(None)
    gpt2 = _sharpen(GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2,
                                               bos_token_id=1, eos_token_id=2)))
    assert native_support(gpt2, 64) is not None
    ro = Sampler(gpt2, tok).sample(PROMPTS[:3], max_new_tokens=10, temperature=0)
    assert ro.stats["backend"] == "hf"
    assert _completion(ro, 0) == _hf_greedy(gpt2, tok, PROMPTS[0], 10)[:len(_completion(ro, 0))]
    with pytest.raises(ValueError, match="native backend"):
        Sampler(gpt2, tok, backend="native").sample(PROMPTS[:1], max_new_tokens=2)


def _windowed(family):
    """A tiny model whose local layers attend over 8 tokens: Gemma 3's layout (four norms a layer with
    (1 + w) weights, q/k norms, a scaled embedding, gelu-tanh, RoPE tables per layer type, local and
    global layers alternating; its logits soft-capped at 5) or Mistral's (every layer local)."""
    if family == "gemma3":
        model, tok = make_tiny_model(None, family="gemma3", hidden_size=32, num_layers=2, num_heads=2,
                                     num_kv_heads=1, intermediate_size=64, sliding_window=8)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # norm weights away from their zero init: a (1 + w) read as w shows
            for n, p in model.named_parameters():
                if p.dim() == 1:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        model.config.final_logit_softcapping = 5.0  # cap · tanh(logits / cap), as HF's forward applies it
        return _sharpen(model), tok
    from transformers import AutoModelForCausalLM, MistralConfig
    _, tok = make_tiny_model(None)
    cfg = MistralConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, intermediate_size=64, sliding_window=8, tie_word_embeddings=True,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    return _sharpen(AutoModelForCausalLM.from_config(cfg)), tok


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_sliding_window_families_match_hf_generate_and_a_training_forward(family):
    """Past the window (prompts + 24 tokens > 8), the native backend's greedy tokens equal HF generate's
    on each prompt alone, and sampled log-probs in a ragged batch equal a training forward."""
    model, tok = _windowed(family)
    assert native_support(model, 64) is None
    ro = Sampler(model, tok, backend="native").sample(PROMPTS, max_new_tokens=24, temperature=0)
    for i, p in enumerate(PROMPTS):
        hf, ours = _hf_greedy(model, tok, p, 24), _completion(ro, i)
        assert ours == hf[:len(ours)] and (len(ours) == 24 or ours[-1] == tok.eos_token_id)
    assert len({tuple(_completion(ro, i)) for i in range(len(PROMPTS))}) >= 3
    ro = Sampler(model, tok).sample(PROMPTS, n=2, seed=0, max_new_tokens=32, temperature=1.0)
    assert ro.stats["backend"] == "native"
    b, lp = _train_logps(model, ro)
    assert logprob_mismatch(b["logprobs"], lp, b["completion_mask"])["sampling/sampling_logp_difference/max"] <= 1e-4


def test_hf_generate_helper_keeps_its_contract(lm):
    model, tok = lm
    texts = generate(model, tok, PROMPTS, max_new_tokens=12, batch_size=2)
    for p, t in zip(PROMPTS, texts):
        assert t == tok.decode(_hf_greedy(model, tok, p, 12), skip_special_tokens=True)
    torch.manual_seed(5)
    a = generate(model, tok, PROMPTS, 12, do_sample=True, temperature=0.9, top_k=10)
    torch.manual_seed(5)
    assert generate(model, tok, PROMPTS, 12, do_sample=True, temperature=0.9, top_k=10) == a


def test_config_validation_and_inputs(lm):
    model, tok = lm
    with pytest.raises(ValueError):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError):
        SamplingConfig(temperature=-1)
    with pytest.raises(ValueError, match="tokenizer"):
        Sampler(model, None).sample(["text"])
    ro = Sampler(model, None).sample([_ids(tok, "2+3=")], max_new_tokens=4, temperature=0)
    assert ro.texts == [""] and ro.completion_ids.shape == (1, 4)
    assert Sampler(model, tok).sample("2+3=", max_new_tokens=4, temperature=0).prompt_ids == [_ids(tok, "2+3=")]


def test_kv_cache_in_lent_storage_same_samples_and_stale_values_masked():
    """Sampler.kv_storage: the cache is a view of the lent buffer, the samples and log-probs equal
    those with a cache of its own, and garbage left in the buffer between calls (a lender's
    gradients, even NaN) does not leak into the next call."""
    from tether.models import make_tiny_model
    from tether.rollout import Sampler, SamplingConfig
    model, _ = make_tiny_model(None)
    model.eval()
    V = model.config.vocab_size
    ids = torch.randint(5, V, (3, 9), generator=torch.Generator().manual_seed(0)).tolist()
    ids[1] = ids[1][:4]  # ragged: left padding in the cache
    cfg = SamplingConfig(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    own = Sampler(model, None, cfg).sample(ids, n=2, seed=5)
    s = Sampler(model, None, cfg)
    s.kv_storage = torch.zeros(1 << 20)
    a = s.sample(ids, n=2, seed=5)
    st = s.kv_storage
    assert s.backend.borrowed and st.data_ptr() <= s.backend.v.data_ptr() < st.data_ptr() + st.numel() * 4
    st.fill_(float("nan"))  # what a lender might leave
    b = s.sample(ids, n=2, seed=5)
    for r in (a, b):
        assert torch.equal(r.completion_ids, own.completion_ids)
        assert torch.equal(r.logprobs, own.logprobs)
    s.kv_storage = torch.zeros(10)  # too small: a cache of its own again
    c = s.sample(ids, n=2, seed=5)
    assert not s.backend.borrowed and torch.equal(c.completion_ids, own.completion_ids)


def test_completion_lists_are_the_masked_rows():
    """Rollout.completion_lists (one copy to the CPU) gives what masking row by row gives, for
    prefix masks and for holes (a partial rollout's rows need not be prefixes)."""
    from tether.rollout.types import Rollout
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (6, 9), generator=g)
    mask = torch.arange(9)[None] < torch.tensor([9, 1, 4, 0, 7, 3])[:, None]
    mask[4, 2] = False  # a hole
    r = Rollout(prompt_ids=[[1]] * 6, completion_ids=ids, completion_mask=mask, logprobs=torch.zeros(6, 9),
                texts=[""] * 6, finish_reasons=["length"] * 6, group=torch.arange(6), logprob_temperature=1.0,
                pad_token_id=0)
    got = r.completion_lists()
    assert got == [row[m].tolist() for row, m in zip(ids, mask)]
    assert [len(x) for x in got] == [9, 1, 4, 0, 6, 3]
