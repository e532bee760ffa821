"""q|k|v and gate|up as one GEMM each (rollout/fuse.py, native.FUSE_PROJECTIONS): fuse_projections keeps
every parameter (object, shape, value) and the state_dict; the sampler over a fused model equals the
sampler over the same weights unfused (greedy tokens, prefill and decode logits) for Qwen2 (q/k/v
biases), Llama and Qwen3 (q/k norms), in bf16 and in fp32 on the torch path; in-place updates are
seen at the next call; a parameter re-homed after fusing sends the backend back to one GEMM per
projection (never a stale view); and the trainers' bf16 sampling copy is fused — also after
rollout.release_replica rebuilds it — and samples what the unfused copy samples."""
import copy
import json

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from tether.models import make_tiny_model
from tether.rollout import Sampler, native
from tether.rollout.fuse import fuse_projections
from tether.rollout.native import NativeBackend
from queue_support import digit_frac
from test_rollout_cpu import _model as _tiny_hf_model

VOCAB = 64


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # 2 shared cores: tiny ops in 2-thread regions stall when the other core is busy.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def torch_path(monkeypatch):
    """The torch code of the native backend also for fp32 models (not the C step, cpu.py)."""
    monkeypatch.setattr(native, "DECODE_ATTN", "bmm")


CONFIGS = {
    "qwen2": (Qwen2Config, dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                                intermediate_size=128)),
    "llama": (LlamaConfig, dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=96)),
    "qwen3": (Qwen3Config, dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                                intermediate_size=96)),
}


def _model(family, dtype=torch.float32, seed=0):
    cfg_cls, shape = CONFIGS[family]
    return _tiny_hf_model(cfg_cls, seed, **shape).to(dtype)


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (1, 7, 16, 17, 5, 30)]


def _fused_pair(family, dtype):
    plain = _model(family, dtype)
    return plain, fuse_projections(copy.deepcopy(plain))


def _layers_fused(backend) -> list[tuple[bool, bool]]:
    return [(L.qkv is not None and L.qkv.fused, L.gate_up is not None and L.gate_up.fused) for L in backend.layers]


def _backend_logits(model, prompts, steps=6):
    """Prefill logits [B, V] and `steps` decode steps' logits (greedy), straight from NativeBackend."""
    be = NativeBackend(model)
    B, P = len(prompts), max(map(len, prompts))
    ids = torch.zeros(B, P, dtype=torch.long)
    mask = torch.zeros(B, P, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], mask[i, P - len(p):] = torch.tensor(p), True
    be.alloc(B, P + steps + 1)
    with torch.inference_mode():
        out = [be.prefill(ids, mask, 0)]
        bias = torch.full((B, P + steps + 1), float("-inf"), dtype=be.dtype)
        bias[:, :P].masked_fill_(mask, 0.0)
        pos = mask.sum(-1)
        for t in range(steps):
            tok = out[-1].argmax(-1)
            out.append(be.decode(tok, pos + t, torch.tensor([P + t]), bias, P + t + 1))
    return be, torch.stack(out).float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_fused_equals_unfused_prefill_decode_and_sampling(family, dtype, torch_path):
    plain, fused = _fused_pair(family, dtype)
    prompts = _prompts()
    # The same products; on the CPU the wider GEMM accumulates each output in the same order (equal
    # here); the tolerance allows a BLAS that blocks a wider N differently (~1 ulp of the logits).
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    # ragged prompts (masked prefill) and equal-length ones (mask-free causal prefill)
    for batch in (prompts, [p[:5] for p in prompts if len(p) >= 5]):
        be_p, a = _backend_logits(plain, batch)
        be_f, b = _backend_logits(fused, batch)
        assert _layers_fused(be_p) == [(False, False)] * 2
        assert _layers_fused(be_f) == [(True, True)] * 2
        assert be_f.attention == "bmm" and be_f.cstep is None
        assert torch.allclose(a, b, rtol=0, atol=tol), (a - b).abs().max()
    for kw in (dict(temperature=0.0), dict(temperature=1.0, top_p=0.95)):
        ra = Sampler(plain, None, max_new_tokens=24, ignore_eos=True, **kw).sample(prompts, n=2, seed=3)
        s = Sampler(fused, None, max_new_tokens=24, ignore_eos=True, **kw)
        rb = s.sample(prompts, n=2, seed=3)
        assert _layers_fused(s.backend) == [(True, True)] * 2
        assert torch.equal(ra.completion_ids, rb.completion_ids)
        m = ra.completion_mask
        assert (ra.logprobs - rb.logprobs)[m].abs().max() <= tol


def test_the_switch_turns_fusion_off(monkeypatch, torch_path):
    _, fused = _fused_pair("qwen2", torch.bfloat16)
    monkeypatch.setattr(native, "FUSE_PROJECTIONS", False)
    assert _layers_fused(NativeBackend(fused)) == [(False, False)] * 2


def test_fuse_projections_keeps_parameters_values_and_state_dict():
    model = _model("qwen2")
    params = dict(model.named_parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([_prompts()[3]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert fuse_projections(model) is model
    after = dict(model.named_parameters())
    assert list(after) == list(params) and all(after[k] is params[k] for k in params)  # the same objects
    sd = model.state_dict()
    assert list(sd) == list(before) and all(torch.equal(sd[k], before[k]) for k in before)
    assert all(p.requires_grad for p in model.parameters())
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        for mods in ((a.q_proj, a.k_proj, a.v_proj), (mlp.gate_proj, mlp.up_proj)):
            ws = [m.weight for m in mods]
            assert len({w.untyped_storage().data_ptr() for w in ws}) == 1  # one buffer, rows in order
            assert all(w.is_contiguous() for w in ws)
            assert all(ws[i + 1].data_ptr() == ws[i].data_ptr() + ws[i].numel() * ws[i].element_size()
                       for i in range(len(ws) - 1))
        assert len({m.bias.untyped_storage().data_ptr() for m in (a.q_proj, a.k_proj, a.v_proj)}) == 1
        assert a.o_proj.weight.untyped_storage().data_ptr() != a.q_proj.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits)  # HF's own forward is unchanged
    ptrs = [p.data_ptr() for p in model.parameters()]
    fuse_projections(model)  # laid out already: nothing moves
    assert [p.data_ptr() for p in model.parameters()] == ptrs


def test_fuse_projections_leaves_lora_wrapped_projections_alone(torch_path):
    peft = pytest.importorskip("peft", reason="peft not installed (pip install -e '.[lora]')")
    model = peft.get_peft_model(_model("qwen2"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    fuse_projections(model)
    s = Sampler(model, None, max_new_tokens=4)
    s.sample(_prompts()[:2])
    assert _layers_fused(s.backend) == [(False, True)] * 2  # q/v wrapped: their group unfused; the MLP fused


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_in_place_updates_are_seen_at_the_next_call(dtype, torch_path):
    """A sampler built once over the fused model: in-place changes of the weights (an optimizer step,
    a .data add) reach its next call exactly as they reach a sampler over the unfused model."""
    plain, fused = _fused_pair("qwen2", dtype)
    prompts, kw = _prompts(), dict(max_new_tokens=16, temperature=1.0, ignore_eos=True)
    sa, sb = Sampler(plain, None, **kw), Sampler(fused, None, **kw)
    first = sb.sample(prompts, seed=1)
    backend = sb.backend
    for m in (plain, fused):
        a, mlp = m.model.layers[0].self_attn, m.model.layers[1].mlp
        with torch.no_grad():
            a.q_proj.weight.data.add_(0.25)
            a.v_proj.bias.mul_(-3.0)
        opt = torch.optim.SGD([mlp.up_proj.weight, a.k_proj.weight], lr=0.5)
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.full_like(p, 0.1)
        opt.step()
    ra, rb = sa.sample(prompts, seed=1), sb.sample(prompts, seed=1)
    assert sb.backend is backend and _layers_fused(backend) == [(True, True)] * 2  # same views, read live
    assert not torch.equal(first.logprobs, rb.logprobs)
    assert torch.equal(ra.completion_ids, rb.completion_ids)
    assert torch.equal(ra.logprobs, rb.logprobs) or dtype == torch.bfloat16 and \
        (ra.logprobs - rb.logprobs)[ra.completion_mask].abs().max() < 3e-2


def test_a_re_homed_parameter_falls_back_never_a_stale_view(torch_path):
    """p.data reassigned after fusing (the group no longer one buffer): a backend built before it
    sees the changed address at its next call and runs one GEMM per projection; a Sampler rebuilds
    its backend (the parameters moved), which finds that group unfused; fusing again restores it."""
    plain, fused = _fused_pair("qwen2", torch.bfloat16)
    prompts = _prompts()
    be = NativeBackend(fused)
    s = Sampler(fused, None, max_new_tokens=12, temperature=0.0, ignore_eos=True)
    s.sample(prompts)
    for m in (plain, fused):
        k = m.model.layers[1].self_attn.k_proj
        k.weight.data = k.weight.data + 0.5  # new memory: q, k, v no longer adjacent
        up = m.model.layers[0].mlp.up_proj
        up.weight.data = up.weight.data * -1.0
    _, want = _backend_logits(plain, prompts)
    _, got = _backend_logits(fused, prompts)
    assert torch.allclose(got, want, rtol=0, atol=3e-2)
    # the backend built before the change: its own next call falls back
    B, P = len(prompts), max(map(len, prompts))
    ids = torch.zeros(B, P, dtype=torch.long)
    mask = torch.zeros(B, P, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], mask[i, P - len(p):] = torch.tensor(p), True
    be.alloc(B, P + 1)
    with torch.inference_mode():
        assert torch.allclose(be.prefill(ids, mask, 0).float(), want[0], rtol=0, atol=3e-2)
    assert _layers_fused(be) == [(True, False), (False, True)]
    ra = Sampler(plain, None, max_new_tokens=12, temperature=0.0, ignore_eos=True).sample(prompts)
    rb = s.sample(prompts)
    assert _layers_fused(s.backend) == [(True, False), (False, True)]  # rebuilt: those groups unfused
    assert torch.equal(ra.completion_ids, rb.completion_ids)
    fuse_projections(fused)
    rc = s.sample(prompts)
    assert _layers_fused(s.backend) == [(True, True)] * 2
    assert torch.equal(ra.completion_ids, rc.completion_ids)


# -- the trainers' sampling copy ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def grpo_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuse")
    make_tiny_model(root / "model", family="qwen2", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=64)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(32):
            f.write(json.dumps({"prompt": f"Say {i}:"}) + "\n")
    return root


def _grpo(root, name, **kw):
    from tether.trainers.grpo import GRPOConfig, train_grpo
    cfg = GRPOConfig(model=str(root / "model"), data=str(root / "prompts.jsonl"), runs_dir=str(root / "runs"),
                     name=name, batch_size=2, num_generations=4, max_new_tokens=8, lr=1e-2, device="cpu",
                     progress=False, seed=0, **{"sampler_copy": True, "max_steps": 3, **kw})
    train_grpo(cfg, reward_funcs=[digit_frac])
    volatile = {"time", "step_time", "tokens_per_second", "rollout/tokens_per_second", "rollout/seconds",
                "gather_time", "queue/wait_seconds"}
    rows = [json.loads(x) for x in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in volatile} for r in rows]


@pytest.mark.parametrize("release", [False, True, "interleaved"], ids=["kept", "release_replica", "queue"])
def test_the_bf16_sampling_copy_is_fused_and_samples_what_the_unfused_copy_samples(grpo_setup, monkeypatch,
                                                                                   release):
    """rollout.sampler_copy with a bf16 copy (forced on CPU, as on CUDA under mixed precision: the
    torch path): every rollout runs on fused layers — with release_replica also after the copy is
    freed and rebuilt in new memory, and through the asynchronous queue on the sampler thread's own
    copy of it — and the run (rewards, losses, log-prob mismatch) equals the run with
    FUSE_PROJECTIONS off."""
    from tether.trainers.core import sharding
    monkeypatch.setattr(sharding, "sharding_bf16", lambda cfg, device: True)
    seen = []
    real_sample = Sampler.sample

    def spy(self, *a, **k):
        out = real_sample(self, *a, **k)
        if getattr(self.backend, "layers", None) is not None:
            seen.append((next(self.model.parameters()).dtype, _layers_fused(self.backend)))
        return out
    monkeypatch.setattr(Sampler, "sample", spy)
    kw = {False: {}, True: dict(release_replica=True),
          "interleaved": dict(placement="interleaved", max_staleness=1)}[release]
    fused = _grpo(grpo_setup, f"fused-{release}", **kw)
    assert len(seen) >= 3 and all(d == torch.bfloat16 and f == [(True, True)] * 2 for d, f in seen), seen
    seen.clear()
    monkeypatch.setattr(native, "FUSE_PROJECTIONS", False)
    plain = _grpo(grpo_setup, f"plain-{release}", **kw)
    assert seen and all(f == [(False, False)] * 2 for _, f in seen)
    assert fused == plain and len(fused) == 3
    assert fused[0]["loss"] != fused[-1]["loss"]  # the weights moved between the rollouts


def test_the_trained_policy_sampled_in_place_is_fused_and_its_checkpoints_resume_exactly(grpo_setup, monkeypatch,
                                                                                         torch_path):
    """No sampling copy (one process, the policy in its own dtype): the sampler reads the trained
    weights themselves, which setup lays out fused, so every rollout runs one GEMM per group, on
    the weights the optimizer updates in place (the run equals the run with FUSE_PROJECTIONS off,
    whose losses move). Its checkpoints are written per tensor: a bf16 save of the fp32 weights
    with the exact master weights beside, from which a resumed run repeats the uninterrupted one."""
    seen = []
    real_sample = Sampler.sample

    def spy(self, *a, **k):
        out = real_sample(self, *a, **k)
        seen.append((self.model, _layers_fused(self.backend)))
        return out
    monkeypatch.setattr(Sampler, "sample", spy)
    fused = _grpo(grpo_setup, "inplace", sampler_copy=False, max_steps=4, save_dtype="bf16", save_every=2)
    assert len(seen) == 4 and all(f == [(True, True)] * 2 for _, f in seen), seen
    ckpt = grpo_setup / "runs" / "inplace" / "checkpoints"
    from tether.run import MASTER_WEIGHTS
    assert (ckpt / "step-4" / MASTER_WEIGHTS).exists()
    seen.clear()
    cut = _grpo(grpo_setup, "inplace-cut", sampler_copy=False, max_steps=2, save_dtype="bf16")
    cut = _grpo(grpo_setup, "inplace-cut", sampler_copy=False, max_steps=4, save_dtype="bf16", resume=True)
    assert cut == fused and len(fused) == 4
    monkeypatch.setattr(native, "FUSE_PROJECTIONS", False)
    seen.clear()
    plain = _grpo(grpo_setup, "inplace-plain", sampler_copy=False, max_steps=4, save_dtype="bf16")
    assert seen and all(f == [(False, False)] * 2 for _, f in seen)
    assert plain == fused and fused[0]["loss"] != fused[-1]["loss"]
