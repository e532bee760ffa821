"""The policy forward every RL and preference trainer shares (`tether.models.logprobs.completion_token_logps`):
the chunked LM head over completion tokens only must give the same log-probs, entropy and
parameter gradients as the plain path (full HF forward + logits), under padding, temperature,
chunks smaller than a row, LoRA, and without grad."""

import copy
from contextlib import nullcontext

import pytest
import torch

from tether.models import make_tiny_model
from tether.objectives import token_logps
from tether.models import logprobs as common  # the policy forward lives with the models
from tether.models.load import compile_layers


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model, _ = make_tiny_model(None)
    model.float()
    B, T = 3, 14
    ids = torch.randint(3, model.config.vocab_size, (B, T))
    am = torch.ones(B, T, dtype=torch.long)
    am[0, :3] = 0  # left padding
    cm = torch.zeros(B, T, dtype=torch.long)
    cm[:, 6:] = 1
    cm[1, 10:] = 0  # right padding after a shorter completion
    return model, dict(input_ids=ids, attention_mask=am, completion_mask=cm)


def _run(model, batch, split: bool, chunk, entropy_grad=True, temperature=0.7, monkeypatch=None):
    m = copy.deepcopy(model)
    monkeypatch.setattr(common, "HEAD_CHUNK_ELEMENTS", chunk)
    if not split:
        monkeypatch.setattr(common, "_split_head", lambda _: None)
    lp, ent = common.completion_token_logps(m, batch, temperature, nullcontext(), True, entropy_grad)
    monkeypatch.undo()
    loss = (lp * torch.linspace(0.5, 1.5, lp.shape[1])).sum() + (ent if entropy_grad else 0)
    loss.backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def test_split_head_found_for_llama(setup):
    body, head = common._split_head(setup[0])
    assert head is setup[0].lm_head and body is setup[0].model


def test_chunked_head_equals_full_logits_for_gemma3(setup, monkeypatch):
    """Gemma 3's layout (scaled embedding tied to the head, four norms a layer, sliding windows): the
    chunked head's log-probs, entropy and gradients equal the model's own logits'; a config with a
    final soft cap (Gemma 2's) keeps the model's forward."""
    torch.manual_seed(0)
    model, _ = make_tiny_model(None, family="gemma3", sliding_window=8)
    model.float()
    assert model.config.model_type == "gemma3_text"
    body, head = common._split_head(model)
    assert head is model.lm_head and body is model.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: the embedding's scale is not in it
    _, batch = setup
    batch = dict(batch, input_ids=batch["input_ids"] % model.config.vocab_size)
    lp_full, ent_full, g_full = _run(model, batch, False, None, monkeypatch=monkeypatch)
    lp, ent, g = _run(model, batch, True, 700, monkeypatch=monkeypatch)
    torch.testing.assert_close(lp, lp_full, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_full, atol=1e-5, rtol=0)
    for n in g_full:
        torch.testing.assert_close(g[n], g_full[n], atol=1e-5, rtol=1e-4, msg=n)
    assert lp_full.abs().sum() > 1.0 and (lp - lp_full).abs().max() < 1e-5
    capped = copy.deepcopy(model)
    capped.config.final_logit_softcapping = 30.0
    assert common._split_head(capped) is None


def test_chunked_only_when_logits_exceed_one_chunk(setup, monkeypatch):
    """Small logits take the plain forward (same numbers, less overhead); large ones the chunked head."""
    model, batch = setup
    calls = []
    real = common._chunked_head
    monkeypatch.setattr(common, "_chunked_head", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        common.completion_token_logps(model, batch, 1.0, nullcontext())
        assert not calls  # 3 x 14 x V logits fit the CPU budget
        monkeypatch.setattr(common, "HEAD_CHUNK_ELEMENTS", 2000)
        common.completion_token_logps(model, batch, 1.0, nullcontext())
        assert calls


@pytest.mark.parametrize("chunk", [2000, 700])  # logits of several tokens / of fewer than one row per chunk
def test_chunked_head_equals_full_logits(setup, chunk, monkeypatch):
    model, batch = setup
    lp_full, ent_full, g_full = _run(model, batch, False, None, monkeypatch=monkeypatch)
    lp, ent, g = _run(model, batch, True, chunk, monkeypatch=monkeypatch)
    sel = torch.nn.functional.pad(batch["completion_mask"][:, 1:].bool(), (1, 0))
    assert (lp[~sel] == 0).all() and (lp_full[~sel] == 0).all()  # 0 outside the completions
    torch.testing.assert_close(lp, lp_full, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_full, atol=1e-5, rtol=0)
    # and both equal log_softmax(z / T)[y] read from a plain forward
    with torch.no_grad():
        ref = token_logps(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                          batch["input_ids"], 0.7)
    torch.testing.assert_close(lp[sel], ref[sel], atol=1e-5, rtol=0)
    for n in g_full:
        torch.testing.assert_close(g[n], g_full[n], atol=1e-5, rtol=1e-4, msg=n)


def test_detached_entropy_does_not_train(setup, monkeypatch):
    model, batch = setup
    _, ent, g = _run(model, batch, True, 2000, entropy_grad=False, monkeypatch=monkeypatch)
    _, _, g_full = _run(model, batch, False, None, entropy_grad=False, monkeypatch=monkeypatch)
    assert not ent.requires_grad
    for n in g_full:
        torch.testing.assert_close(g[n], g_full[n], atol=1e-5, rtol=1e-4, msg=n)


def test_lora_reference_through_the_split_head(setup, monkeypatch):
    """Under PEFT the body keeps its LoRA layers and `disable_adapter` gives the base model's numbers."""
    peft = pytest.importorskip("peft", reason="peft not installed (pip install -e '.[lora]')")
    monkeypatch.setattr(common, "HEAD_CHUNK_ELEMENTS", 2000)  # the chunked path at these tiny shapes
    model, batch = setup
    base = copy.deepcopy(model)
    lm = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                  init_lora_weights=False))
    assert common._split_head(lm) is not None
    with torch.no_grad():
        want, _ = common.completion_token_logps(base, batch, 1.0, nullcontext())
        with lm.disable_adapter():
            got, _ = common.completion_token_logps(lm, batch, 1.0, nullcontext())
        on, _ = common.completion_token_logps(lm, batch, 1.0, nullcontext())
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert (on - want).abs().max() > 1e-3  # the adapters do act when enabled
    # tether's own switch (models.lora.adapters_off): the same base numbers, and the adapters stay
    # trainable inside it (peft's context turns requires_grad off, which broke FSDP2's bf16 policy)
    from tether.models.lora import adapters_off
    trained = {n for n, p in lm.named_parameters() if p.requires_grad}
    with torch.no_grad(), adapters_off(lm):
        off, _ = common.completion_token_logps(lm, batch, 1.0, nullcontext())
        assert {n for n, p in lm.named_parameters() if p.requires_grad} == trained and trained
    torch.testing.assert_close(off, want, atol=1e-6, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(common.completion_token_logps(lm, batch, 1.0, nullcontext())[0], on)


def test_autocast_fp32_weights(setup, monkeypatch):
    """fp32 weights under bf16 autocast (the DPO bench's setting): the head runs in bf16, the
    weight gradient comes back fp32, and both agree with the full-logits path to bf16 precision."""
    model, batch = setup
    amp = torch.autocast("cpu", dtype=torch.bfloat16)
    out = {}
    for split in (False, True):
        m = copy.deepcopy(model)
        if split:
            monkeypatch.setattr(common, "HEAD_CHUNK_ELEMENTS", 2000)
        else:
            monkeypatch.setattr(common, "_split_head", lambda _: None)
        lp, _ = common.completion_token_logps(m, batch, 1.0, amp)
        monkeypatch.undo()
        lp.sum().backward()
        out[split] = lp.detach(), m.lm_head.weight.grad
    assert out[True][1].dtype == torch.float32
    torch.testing.assert_close(out[True][0], out[False][0], atol=0.05, rtol=0)
    g0, g1 = out[False][1], out[True][1]
    assert (g1 - g0).norm() / g0.norm() < 0.02


def test_compile_layers_wraps_every_decoder_layer(setup):
    """GRPOConfig.compile: every decoder layer (not the LM head, not the model) gets compiled."""
    m = copy.deepcopy(setup[0])
    assert compile_layers(m) == len(m.model.layers)
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in m.model.layers)
    assert getattr(m, "_compiled_call_impl", None) is None and getattr(m.lm_head, "_compiled_call_impl", None) is None


@pytest.mark.parametrize("dynamic", [True, "sequence", None])
def test_compiled_layers_take_a_new_sequence_length_without_recompiling(setup, dynamic):
    """compile_layers compiles for dynamic shapes from the first call: batches of other lengths
    (every GRPO step's longest completion differs) run the same graph — also with only the length
    symbolic ("sequence"). With torch.compile's default (dynamic=None: static first, compiled again
    at the first new length) the same calls compile again — 9-10 s stalls of a GRPO step on an H200
    (models/load.compile_layers).
    (Dynamo only: a backend that counts its graphs.)"""
    import torch._dynamo
    model, batch = setup
    m = copy.deepcopy(model)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    try:
        compile_layers(m, backend=counting, dynamic=dynamic)
        cut, seen = batch["input_ids"].shape[1], []
        with torch.no_grad():
            for T in (cut, cut - 3, cut - 5):  # (none equal to another size of the tiny model)
                common.completion_token_logps(m, {k: v[:, :T] for k, v in batch.items()}, 0.7, nullcontext())
                seen.append(len(graphs))
    finally:
        torch._dynamo.reset()
    assert seen[0] >= 1
    if dynamic:
        assert seen == [seen[0]] * 3
    else:
        assert seen[1] > seen[0]


def test_a_checkpointed_layer_recomputes_inside_its_compiled_region(setup):
    """Under gradient checkpointing, compile_layers moves each layer's checkpoint into the compiled
    forward (models/load.checkpoint_inside): a forward + backward runs each compiled region once
    (the recompute is part of its backward, not a second call, as it is when the checkpoint wraps
    the compiled call), nothing but layer inputs is kept for backward (no MLP activation of
    intermediate width), and the gradients equal the eager checkpointed model's.
    (Dynamo with a backend that counts its calls: Inductor on this CPU takes ~35 s.)"""
    import torch._dynamo
    model, batch = setup
    width = model.config.intermediate_size
    calls, out = [], []

    def counting(gm, example_inputs):
        def run(*args):
            calls.append(1)
            return gm.forward(*args)
        return run
    torch._dynamo.reset()
    try:
        for comp in (False, True):
            m = copy.deepcopy(model)
            m.gradient_checkpointing_enable()
            m.train()
            if comp:
                compile_layers(m, backend=counting)
                assert not any(layer.gradient_checkpointing for layer in m.model.layers)
            kept = []

            def pack(t):
                if not isinstance(t, torch.nn.Parameter):
                    kept.append(tuple(t.shape))
                return t
            calls.clear()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                lp, ent = common.completion_token_logps(m, batch, 0.7, nullcontext(), True, True)
            ((lp * torch.linspace(0.5, 1.5, lp.shape[1])).sum() + ent).backward()
            assert not any(width in shape for shape in kept), kept
            out.append((lp.detach(), {n: p.grad for n, p in m.named_parameters()}))
    finally:
        torch._dynamo.reset()
    assert len(calls) == len(model.model.layers)
    torch.testing.assert_close(out[1][0], out[0][0], atol=1e-6, rtol=0)
    for n in out[0][1]:
        torch.testing.assert_close(out[1][1][n], out[0][1][n], atol=1e-6, rtol=1e-5, msg=n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (compiling on CPU takes ~35 s)")
@pytest.mark.parametrize("dynamic", [True, "sequence"])
def test_compiled_layers_same_logps_and_grads(setup, monkeypatch, dynamic):
    model, batch = setup
    batch = {k: v.cuda() for k, v in batch.items()}
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    out = []
    for comp in (False, True):
        m = copy.deepcopy(model).cuda()
        m.gradient_checkpointing_enable()
        m.train()
        if comp:
            compile_layers(m, dynamic=dynamic)
        lp, ent = common.completion_token_logps(m, batch, 0.7, nullcontext(), True, True)
        ((lp * torch.linspace(0.5, 1.5, lp.shape[1], device="cuda")).sum() + ent).backward()
        out.append((lp.detach(), {n: p.grad for n, p in m.named_parameters()}))
    torch.testing.assert_close(out[1][0], out[0][0], atol=1e-5, rtol=0)
    for n in out[0][1]:
        torch.testing.assert_close(out[1][1][n], out[0][1][n], atol=1e-5, rtol=1e-4, msg=n)


def test_sequence_dynamic_layers_give_the_same_logps_and_grads(setup):
    """compile_layers(dynamic="sequence") (the marks in a pre-hook, the forward compiled): the same
    log-probs and gradients as the plain model under gradient checkpointing, at two lengths.
    (Dynamo with the eager backend: Inductor on this CPU takes ~35 s.)"""
    import torch._dynamo
    model, batch = setup
    torch._dynamo.reset()
    try:
        for T in (batch["input_ids"].shape[1], batch["input_ids"].shape[1] - 4):
            out = []
            part = {k: v[:, :T] for k, v in batch.items()}
            for comp in (False, True):
                m = copy.deepcopy(model)
                m.gradient_checkpointing_enable()
                m.train()
                if comp:
                    compile_layers(m, backend="eager", dynamic="sequence")
                lp, ent = common.completion_token_logps(m, part, 0.7, nullcontext(), True, True)
                ((lp * torch.linspace(0.5, 1.5, lp.shape[1])).sum() + ent).backward()
                out.append((lp.detach(), {n: p.grad for n, p in m.named_parameters()}))
            torch.testing.assert_close(out[1][0], out[0][0], atol=1e-6, rtol=0)
            for n in out[0][1]:
                torch.testing.assert_close(out[1][1][n], out[0][1][n], atol=1e-6, rtol=1e-5, msg=n)
    finally:
        torch._dynamo.reset()


def test_head_fp32_under_bf16_autocast_gives_the_float32_logits(setup, monkeypatch):
    """model.head_fp32 (logprobs.HEAD_DTYPE = float32): under bf16 autocast the body runs in bf16,
    the head in float32 — the log-probs equal a float32 head applied by hand to the body's bf16
    hidden states (1e-5), where the default bf16 head is off by > 1e-3 (its logits rounded to bf16);
    gradients flow into the head's float32 weight."""
    model, batch = setup
    amp = torch.autocast("cpu", dtype=torch.bfloat16)
    m = copy.deepcopy(model)
    with torch.no_grad():  # large logits, as a trained model's, where bf16 rounding shows (the tiny
        m.lm_head.weight.mul_(30.0)  # model ties its head to the embeddings: both scale)
    with torch.no_grad(), amp:  # the reference: body in bf16 as the trainer runs it, head by hand
        h = m.model(**common.forward_inputs(batch)).last_hidden_state
    logits = torch.nn.functional.linear(h.float(), m.lm_head.weight.float())
    ref = token_logps(logits, batch["input_ids"], 0.7)  # [B, T]: position t scores token t
    ref = ref * torch.nn.functional.pad(batch["completion_mask"][:, 1:], (1, 0))
    with torch.no_grad():
        bf16_head, _ = common.completion_token_logps(m, batch, 0.7, amp)
    monkeypatch.setattr(common, "HEAD_DTYPE", torch.float32)
    lp, _ = common.completion_token_logps(m, batch, 0.7, amp)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)
    assert (bf16_head - ref).abs().max() > 1e-3
    lp.sum().backward()
    assert m.lm_head.weight.grad is not None and m.lm_head.weight.grad.dtype == torch.float32
    assert float(m.lm_head.weight.grad.abs().sum()) > 0


def test_head_fp32_does_not_outlive_its_run(tmp_path, monkeypatch):
    """A run with model.head_fp32 sets logprobs.HEAD_DTYPE for its own forwards and resets it at its
    end, so later code in the process (tether eval, library calls) gets the default head again."""
    import json

    import tether.trainers.sft as sft
    make_tiny_model(tmp_path / "model")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"prompt": "a", "completion": "b"}) + "\n" for _ in range(4)))
    seen = []
    real = sft.completion_token_logps
    monkeypatch.setattr(sft, "completion_token_logps", lambda *a, **k: seen.append(common.HEAD_DTYPE) or real(*a, **k))
    monkeypatch.setattr(common, "HEAD_CHUNK_ELEMENTS", 64)  # SFT's loss through the chunked head
    sft.train_sft(sft.SFTConfig(model=str(tmp_path / "model"), data=str(tmp_path / "d.jsonl"),
                                runs_dir=str(tmp_path / "runs"), max_steps=1, batch_size=2, device="cpu",
                                progress=False, head_fp32=True))
    assert seen and set(seen) == {torch.float32}
    assert common.HEAD_DTYPE is None


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA head kernels (offset chunks through grad_in_place)")])])
def test_head_gradient_by_vocabulary_chunks_of_128_columns(monkeypatch, dev):
    """dW by vocabulary chunks (a vocabulary wider than one chunk): equal to autograd through the full
    logits, and every chunk but the last 128·k columns wide — an odd width (16,303 at 7B) leaves each
    chunk's rows unaligned and cuBLAS takes an align-1 GEMM (39 ms of a 0.62 s 7B DPO step, H200)."""
    torch.manual_seed(0)
    N, H, V, T = 50, 16, 1000, 0.7
    h, b = torch.randn(N, H, device=dev, requires_grad=True), torch.randn(V, device=dev, requires_grad=True)
    w = (0.3 * torch.randn(V, H, device=dev)).requires_grad_()  # logits of a few units, as a trained head's
    y = torch.randint(0, V, (N,), device=dev)
    g_lp, g_ent = torch.randn(N, device=dev), torch.randn(N, device=dev)
    widths = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, wt, bias=None: widths.append(wt.shape[0]) or real(x, wt, bias))
    lp, ent = common._HeadLogps.apply(h, w, b, y, T, 10, torch.float32, True)  # 10 tokens a chunk -> 200 columns
    (lp * g_lp + ent * g_ent).sum().backward()
    monkeypatch.undo()
    grads = [t.grad.clone() for t in (h, w, b)]
    for t in (h, w, b):
        t.grad = None
    logp = torch.log_softmax(real(h, w, b) / T, -1)
    ref_lp, ref_ent = logp.gather(-1, y[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    (ref_lp * g_lp + ref_ent * g_ent).sum().backward()
    for got, t in zip(grads, (h, w, b)):
        torch.testing.assert_close(got, t.grad, atol=1e-5, rtol=1e-4)
    vocab_chunks = [c for c in widths if c < V]
    assert vocab_chunks == [128] * 7 + [104]  # 1000 = 7 · 128 + 104


def _two_micro_batches(model, batch, flat: bool, monkeypatch, dev="cpu"):
    """Gradients of two micro-batches' losses accumulated (as a trainer does), through the chunked
    head; `flat`: the parameters' .grad a flat buffer (common.flat_grad_buffer), else autograd's own."""
    from tether.trainers.core.common import flat_grad_buffer
    m = copy.deepcopy(model).to(dev)
    if flat:
        assert flat_grad_buffer(m) is not None
    monkeypatch.setattr(common, "HEAD_CHUNK_ELEMENTS", 2000)
    for scale in (1.0, -0.5):
        b = {k: v.to(dev) for k, v in batch.items()}
        lp, ent = common.completion_token_logps(m, b, 0.7, nullcontext(), True, True)
        (scale * (lp * torch.linspace(0.5, 1.5, lp.shape[1], device=dev)).sum() + ent).backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def test_head_adds_its_weight_gradient_into_a_flat_buffer(setup, monkeypatch):
    """Where .grad is the trainer's flat buffer, the chunked head adds dW into it itself (a tied
    head's dW is then not held until the embedding's backward): the gradients over two micro-batches
    equal autograd's, and the head returned no dW for the tied weight."""
    model, batch = setup
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    into = []
    real = common.grad_in_place
    monkeypatch.setattr(common, "grad_in_place", lambda w: into.append(real(w)) or into[-1])
    flat = _two_micro_batches(model, batch, True, monkeypatch)
    assert len(into) == 2 and all(g is not None for g in into)
    into.clear()
    own = _two_micro_batches(model, batch, False, monkeypatch)
    assert into == [None, None]  # autograd's .grad: not the trainer's buffer, so dW is returned
    for n in own:
        torch.testing.assert_close(flat[n], own[n], atol=1e-6, rtol=1e-5, msg=n)
    emb = "model.embed_tokens.weight"
    assert flat[emb].abs().sum() > 0


def test_head_returns_its_weight_gradient_to_hooks(setup):
    """A hook on the head's weight sees the whole gradient as autograd delivers it, buffer or not."""
    from tether.trainers.core.common import flat_grad_buffer
    model, batch = setup
    m = copy.deepcopy(model)
    flat_grad_buffer(m)
    w = m.get_output_embeddings().weight
    seen = []
    w.register_hook(lambda g: seen.append(g.clone()))
    h = torch.randn(5, w.shape[1], requires_grad=True)
    y = torch.randint(0, w.shape[0], (5,))
    lp, _ = common._HeadLogps.apply(h, w, None, y, 1.0, 2, torch.float32, False)
    lp.sum().backward()
    p = torch.log_softmax(h.detach() @ w.detach().t(), -1).exp()
    ref = (torch.nn.functional.one_hot(y, w.shape[0]).float() - p).t() @ h.detach()
    torch.testing.assert_close(seen[0], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory")
def test_tied_head_gradient_is_not_held_through_the_backward(monkeypatch):
    """On CUDA, bf16, a tied head of 32k × 256 (16 MB): with the flat gradient buffer the backward's
    allocated peak is lower by at least that dW (autograd would hold it until the embedding's
    backward), and the gradients equal the held path's."""
    from tether.models import make_tiny_model as tiny
    model, _ = tiny(None, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512)
    model.resize_token_embeddings(32768)
    model.to(torch.bfloat16)
    torch.manual_seed(0)
    B, T = 4, 256
    batch = dict(input_ids=torch.randint(3, 32768, (B, T)), attention_mask=torch.ones(B, T, dtype=torch.long),
                 completion_mask=torch.cat([torch.zeros(B, 64, dtype=torch.long), torch.ones(B, T - 64, dtype=torch.long)], 1))
    peaks, grads = {}, {}
    for flat in (False, True):
        from tether.trainers.core.common import flat_grad_buffer
        m = copy.deepcopy(model).cuda()
        if flat:
            flat_grad_buffer(m)
        else:  # the same resident gradients, autograd's path (no marker)
            for p in m.parameters():
                p.grad = torch.zeros_like(p)
        b = {k: v.cuda() for k, v in batch.items()}
        monkeypatch.setattr(common, "HEAD_CHUNK_ELEMENTS", 1 << 20)
        lp, _ = common.completion_token_logps(m, b, 1.0, nullcontext(), False, False)
        monkeypatch.undo()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        lp.sum().backward()
        torch.cuda.synchronize()
        peaks[flat] = torch.cuda.max_memory_allocated() - base
        grads[flat] = {n: p.grad.float() for n, p in m.named_parameters()}
        del m, lp
    w_bytes = 32768 * 256 * 2
    assert peaks[False] - peaks[True] >= w_bytes, (peaks, w_bytes)
    for n in grads[False]:
        torch.testing.assert_close(grads[True][n], grads[False][n], atol=2e-2, rtol=2e-2, msg=n)
