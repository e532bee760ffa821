"""The CPU decode step and prefill in C (rollout/cpu.py, cpu_decode.c) against the torch path of the
same engine and against a training forward, across the shapes the C code special-cases: GQA groups
of 1, 2 and 3 query heads (an odd group leaves one head alone in the last pair), head_dim 16, 32
and 64 (pv_tile's 1-, 2- and 4-vector variants), Qwen2's q/k/v biases, Qwen3's q/k norms, prompts
that cross 16-slot tile boundaries with left padding, batch compaction, two threads; and the
fallbacks (no compiler, a LoRA-wrapped model, bf16, the TETHER_CPU_DECODE=0 switch)."""
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from tether.models import make_tiny_model
from tether.rollout import Sampler, cpu, native
from test_rollout import _train_logps  # the training forward's log-probs of a rollout

VOCAB = 64


def _model(cfg_cls, seed=0, **shape):
    cfg = cfg_cls(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=256, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_theta=10000.0, **shape)
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # weights with enough scale that sampling is far from uniform
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
            else:  # norm weights and Qwen2's q/k/v biases: not all ones / zeros
                p.add_(torch.randn_like(p) * 0.1)
    return m


SHAPES = {
    # name: (config class, shape): G = heads / kv_heads, D = head_dim
    "llama G2 D16": (LlamaConfig, dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=96)),
    "qwen2 bias G3 D16": (Qwen2Config, dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                                            intermediate_size=128)),
    "qwen3 qk-norm G1 D32": (Qwen3Config, dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                                               head_dim=32, intermediate_size=96)),
    "llama G2 D64": (LlamaConfig, dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                       intermediate_size=128)),
}


def _prompts(n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 15, 16, 17, 33, 5, 40, 2, 31][:n]  # around tile (16-slot) boundaries, ragged
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lengths]


def _sample(model, attn, threads=1, **kw):
    old, n = native.DECODE_ATTN, torch.get_num_threads()
    native.DECODE_ATTN = attn
    torch.set_num_threads(threads)
    try:
        s = Sampler(model, None, **kw)
        ro = s.sample(_prompts(), n=2, seed=5)
        return ro, s.backend.attention
    finally:
        native.DECODE_ATTN = old
        torch.set_num_threads(n)


@pytest.mark.parametrize("name", list(SHAPES))
def test_c_step_equals_the_torch_path_and_a_training_forward(name):
    cfg_cls, shape = SHAPES[name]
    model = _model(cfg_cls, **shape)
    kw = dict(max_new_tokens=40, temperature=1.0, ignore_eos=True)
    ro_c, used = _sample(model, "auto", **kw)
    ro_t, other = _sample(model, "bmm", **kw)
    assert (used, other) == ("c", "bmm")
    # Same draws (inverse CDF with the same uniforms; float32 rounding differences in the
    # probabilities would have to land within ~1e-6 of a CDF boundary to change a token).
    assert torch.equal(ro_c.completion_ids, ro_t.completion_ids)
    m = ro_c.completion_mask  # float32 rounding of log-probs of magnitude ~10-20 (these weights): ~1e-5
    assert (ro_c.logprobs - ro_t.logprobs)[m].abs().max() < 1e-4
    b, lp = _train_logps(model, ro_c)  # the bar: |sampler - training forward| <= 1e-4 in fp32
    assert (lp - b["logprobs"])[b["completion_mask"].bool()].abs().max() < 1e-4


def test_c_step_with_compaction_two_threads_and_greedy():
    """EOS-heavy model: rows finish at different steps, the batch is compacted (cache rows moved in
    the tiled layout); two threads split the attention's row blocks and the GEMMs."""
    model = _model(LlamaConfig, seed=3, **SHAPES["llama G2 D16"][1])
    with torch.no_grad():
        model.lm_head.weight[2] *= 2.5  # EOS likely (tied embeddings)
    for settings in (dict(temperature=0.0), dict(temperature=1.0, top_p=0.9)):
        kw = dict(max_new_tokens=40, **settings)
        ro_c, used = _sample(model, "auto", threads=2, **kw)
        ro_t, _ = _sample(model, "bmm", threads=2, **kw)
        assert used == "c"
        assert len(set(ro_c.completion_mask.sum(-1).tolist())) > 3  # varied lengths: compaction ran
        assert ro_c.finish_reasons == ro_t.finish_reasons
        assert torch.equal(ro_c.completion_ids, ro_t.completion_ids)
        assert (ro_c.logprobs - ro_t.logprobs)[ro_c.completion_mask].abs().max() < 1e-4


def test_an_unwritable_cache_directory_falls_back_to_the_temp_directory(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TETHER_CACHE", str(blocker))
    monkeypatch.setattr(cpu, "_lib", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: it still builds (or finds) the step
        assert cpu.library() is not None


def test_fallbacks_keep_the_torch_path(monkeypatch):
    model, tok = make_tiny_model(None, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                                 intermediate_size=96)
    # bf16 on CPU: not the C step
    assert cpu.support(model.to(torch.bfloat16)) is not None
    model = model.float()
    assert cpu.support(model) is None
    # a LoRA-wrapped model: its adapters must apply, so the projections are not plain nn.Linear
    peft = pytest.importorskip("peft", reason="peft not installed (pip install -e '.[lora]')")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert "plain" in cpu.support(lora.get_base_model())
    s = Sampler(lora, tok, max_new_tokens=5)
    s.sample(["ab"])
    assert s.backend.attention != "c"
    # no compiler: one warning, then the torch path
    model, tok = make_tiny_model(None, hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                                 intermediate_size=96)
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: "a CPU this test made up")  # not the cached build
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        s = Sampler(model, tok, max_new_tokens=5)
        s.sample(["ab"])
    assert s.backend.attention == "bmm" and any("torch path" in str(x.message) for x in w)


def test_the_environment_switch_routes_to_the_torch_path(monkeypatch):
    """TETHER_CPU_DECODE=0: the torch path, chosen without building the C step and without a warning;
    its outputs are the torch path's bit for bit (the C step's log-probs differ in float32 rounding)."""
    model = _model(LlamaConfig, **SHAPES["llama G2 D16"][1])
    kw = dict(max_new_tokens=40, temperature=1.0, ignore_eos=True)
    ro_c, used_c = _sample(model, "auto", **kw)
    ro_t, used_t = _sample(model, "bmm", **kw)
    assert (used_c, used_t) == ("c", "bmm")
    assert not torch.equal(ro_c.logprobs, ro_t.logprobs)  # so the equality below tells the paths apart
    monkeypatch.setenv("TETHER_CPU_DECODE", "0")
    monkeypatch.setattr(cpu, "library", lambda: pytest.fail("the C step was built though switched off"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ro, used = _sample(model, "auto", **kw)
    assert used == "bmm"
    assert torch.equal(ro.completion_ids, ro_t.completion_ids) and torch.equal(ro.logprobs, ro_t.logprobs)
    assert torch.equal(ro.completion_ids, ro_c.completion_ids)  # and the same samples as the C step
    with pytest.raises(ValueError, match="TETHER_CPU_DECODE"):  # forcing the C step names the switch
        _sample(model, "c", **kw)
