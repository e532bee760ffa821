"""Padding-free packing (tether.data.pack_batch, data.packing) for SFT, RM and the DPO family, and
the chunked LM head in SFT: a packed batch must give every sequence the log-probs, rewards, losses
and gradients its padded batch gives (fp32, float rounding apart), for Llama- and Qwen2-shaped
models under sdpa and eager attention."""

import contextlib
import copy

import pytest
import torch

from tether.data import collate_sequences, join_prompt_response, pack_batch, sequence_sums
from tether.models import logprobs as common
from tether.models import make_tiny_model
from tether.models.heads import ScalarHeadModel
from tether.trainers import rm, sft
from tether.trainers.preference.offline import DPOConfig, KTOConfig, ORPOConfig, SimPOConfig, train_step
from tether.trainers.preference.data import kl_partners, to_unpaired
from tether.trainers.preference.reference import completion_logps, reference_logps

CPU = torch.device("cpu")
NO_AMP = contextlib.nullcontext()
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: packed and padded rows differ only in matmul shapes


# ---- the layout -----------------------------------------------------------------------------------

def test_pack_batch_layout_by_hand():
    """Lengths 3, 5, 2 into rows of at most 5 (the longest), first-fit decreasing: [ex1], [ex0 ex2]."""
    ex = [{"input_ids": [10, 11, 12], "completion_mask": [0, 1, 1]},
          {"input_ids": [20, 21, 22, 23, 24], "completion_mask": [1, 1, 0, 1, 1]},
          {"input_ids": [30, 31], "completion_mask": [1, 1]}]
    b = pack_batch(ex, pad_id=0)
    assert b["input_ids"].tolist() == [[20, 21, 22, 23, 24], [10, 11, 12, 30, 31]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert b["sequence_ids"].tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 2, 2]]
    # each sequence's first token is no target (the token before it is another sequence's)
    assert b["completion_mask"].tolist() == [[0, 1, 0, 1, 1], [0, 1, 1, 0, 1]]
    assert b["sequence_ends"].tolist() == [7, 4, 9]
    assert b["attention_mask"].tolist() == [[1] * 5] * 2

    one = pack_batch(ex, pad_id=0, one_row=True)
    assert one["input_ids"].tolist() == [[20, 21, 22, 23, 24, 10, 11, 12, 30, 31]]
    assert one["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]]
    assert one["sequence_ends"].tolist() == [7, 4, 9]

    # padding at a row's end: its own positions, sequence -1, not counted, never a target
    b = pack_batch(ex[:1] + ex[2:] + [{"input_ids": [40, 41, 42, 43], "completion_mask": [1] * 4}], pad_id=9)
    assert b["input_ids"].tolist() == [[40, 41, 42, 43], [10, 11, 12, 9], [30, 31, 9, 9]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]]
    assert b["sequence_ids"].tolist() == [[2, 2, 2, 2], [0, 0, 0, -1], [1, 1, -1, -1]]
    assert b["attention_mask"].sum() == 9 and b["completion_mask"][b["sequence_ids"] < 0].sum() == 0
    assert sequence_sums(torch.arange(12.0).view(3, 4), b).tolist() == [4 + 5 + 6, 8 + 9, 0 + 1 + 2 + 3]


def test_pack_batch_refuses_an_empty_sequence():
    with pytest.raises(ValueError, match="example 1 is empty"):
        pack_batch([{"input_ids": [1], "completion_mask": [1]}, {"input_ids": [], "completion_mask": []}], 0)


# ---- per-sequence log-probs ---------------------------------------------------------------------------

def _sequences(vocab: int, n: int = 7, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p, c = (int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g)))
        out.append(join_prompt_response(torch.randint(3, vocab, (p,), generator=g).tolist(),
                                        torch.randint(3, vocab, (c,), generator=g).tolist()))
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request):
    model, tok = make_tiny_model(None, family=request.param, hidden_size=64, num_layers=2,
                                 intermediate_size=128)
    return model.float(), tok


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("layout", ["rows", "row"])
@pytest.mark.parametrize("chunked", [False, True])
def test_packed_logps_equal_padded(family, impl, layout, chunked, monkeypatch):
    """Summed completion log-probs and lengths per sequence, through the offline trainers' forward
    (plain LM head, and the chunked one), and their gradients."""
    base, tok = family
    model = copy.deepcopy(base)
    model.config._attn_implementation = impl
    if chunked:  # the chunked head at these tiny shapes: chunks of 1.5 rows of logits
        monkeypatch.setattr(common, "HEAD_CHUNK_ELEMENTS", 3 * model.config.vocab_size // 2)
    seqs = _sequences(len(tok))
    got = {}
    for packing in ("", layout):
        model.zero_grad()
        logps, lengths = completion_logps(model, collate_sequences(seqs, tok.pad_token_id, packing), CPU, NO_AMP)
        (logps * torch.linspace(0.5, 1.5, len(seqs))).sum().backward()
        got[packing] = logps.detach(), lengths, {n: p.grad.clone() for n, p in model.named_parameters()}
    (lp, n, grads), (lp_p, n_p, grads_p) = got[""], got[layout]
    assert torch.equal(n, n_p) and n.tolist() == [float(sum(s["completion_mask"][1:])) for s in seqs]
    torch.testing.assert_close(lp_p, lp, **TOL)
    for k in grads:
        torch.testing.assert_close(grads_p[k], grads[k], **TOL)


@pytest.mark.parametrize("packing", ["", "rows"])
def test_offline_chunked_head_equals_full_logits(family, packing, monkeypatch):
    """The DPO family's per-sequence log-probs through the chunked LM head (chunks of 1.5 rows of
    logits) equal the HF forward's full logits, values and gradients, padded and packed."""
    base, tok = family
    batch = collate_sequences(_sequences(len(tok)), tok.pad_token_id, packing)
    got = []
    for split in (True, False):
        model = copy.deepcopy(base)
        monkeypatch.setattr(common, "HEAD_CHUNK_ELEMENTS", 3 * model.config.vocab_size // 2)
        if not split:
            monkeypatch.setattr(common, "_split_head", lambda _: None)
        calls = []
        hook = model.lm_head.register_forward_hook(lambda *a: calls.append(1))
        logps, _ = completion_logps(model, batch, CPU, NO_AMP)
        hook.remove()
        monkeypatch.undo()
        assert bool(calls) != split  # the chunked head never runs the model's own lm_head
        (logps * torch.linspace(0.5, 1.5, len(logps))).sum().backward()
        got.append((logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(got[0][0], got[1][0], **TOL)
    for k in got[1][1]:
        torch.testing.assert_close(got[0][1][k], got[1][1][k], **TOL)


def test_attention_crossing_sequences_would_be_caught(family):
    """The control: the same packed rows given a mask of ones (attention across sequences, positions
    still reset) move the log-probs far beyond the tolerance above."""
    model, tok = family
    seqs = _sequences(len(tok))
    packed = collate_sequences(seqs, tok.pad_token_id, "rows")
    with torch.no_grad():
        right, _ = completion_logps(model, packed, CPU, NO_AMP)
        crossed = {k: v for k, v in packed.items() if k not in ("sequence_ids", "sequence_ends")}
        wrong = common.completion_token_logps(model, crossed, 1.0, NO_AMP)[0]
    wrong = sequence_sums(wrong, packed)
    assert (wrong - right).abs().max() > 1e-2


# ---- a training step: the DPO family -----------------------------------------------------------------

@pytest.mark.parametrize("cls,kw", [(DPOConfig, {}), (DPOConfig, {"loss": "ipo", "rpo_alpha": 1.0}),
                                    (KTOConfig, {}), (SimPOConfig, {}), (ORPOConfig, {})])
def test_offline_step_packed_equals_padded(family, cls, kw):
    """train_step's loss, metrics and gradients (two micro-batches, KTO's mismatched KL batch too)
    with data.packing on equal those with it off; the reference, computed with the same packing,
    gives step 1's exact zero log-ratios either way."""
    base, tok = family
    seqs = _sequences(len(tok), n=12, seed=4)
    pairs = [{"prompt_ids": [s["input_ids"][0]] + s["input_ids"][1:2], "chosen_ids": s["input_ids"][2:] or [5],
              "rejected_ids": t["input_ids"][1:] or [6]} for s, t in zip(seqs[:6], seqs[6:])]
    out = {}
    for packing in (False, True):
        cfg = cls(model="x", data="x", packing=packing, batch_size=3, **kw)
        paired = cfg.preference.method != "kto"
        ex = [dict(e, idx=i) for i, e in enumerate(pairs if paired else to_unpaired(pairs))]
        model = copy.deepcopy(base).train()
        ref = None if cfg.preference.method in ("simpo", "orpo") else \
            reference_logps(model, {"train": ex}, {"train": paired}, cfg, tok.pad_token_id, CPU, NO_AMP,
                            forwards={"train": [list(range(len(ex)))[i:i + 3] for i in range(0, len(ex), 3)]})
        grads = {}

        def step(loss, model=model, grads=grads):  # keep the gradients, no update
            grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
            return 0.0
        micro = [ex[i:i + 3] for i in range(0, len(ex), 3)]
        out[packing] = train_step(cfg, model, None, None, micro, paired, ref, tok.pad_token_id, CPU, NO_AMP,
                                  kl_pool=ex, partners=kl_partners(len(ex)), step=step), grads
    (m, g), (m_p, g_p) = out[False], out[True]
    assert m["tokens"] == m_p["tokens"]
    for k in m:
        assert m_p[k] == pytest.approx(m[k], rel=1e-5, abs=1e-5), k
    if cls is DPOConfig:  # the reference is the policy at step 0, in the same batches: exactly 0
        assert m_p["rewards/margins"] == 0.0 and m_p["logps/chosen_drift"] == 0.0
    for k in g:
        torch.testing.assert_close(g_p[k], g[k], **TOL)


# ---- SFT ---------------------------------------------------------------------------------------------

def _sft_loss_and_grads(model, batch):
    model.zero_grad()
    loss, n = sft._micro_loss(model, batch, CPU, NO_AMP)
    loss.backward()
    return float(loss.detach()), n, {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("layout", ["rows", "row"])
def test_sft_micro_loss_packed_equals_padded(family, layout):
    """Summed NLL, target-token count and gradients; language modelling (every token a target:
    each sequence's first token must not be predicted from the previous sequence) and prompt-
    completion rows mixed."""
    base, tok = family
    model = copy.deepcopy(base)
    seqs = _sequences(len(tok))
    seqs[0]["completion_mask"] = [1] * len(seqs[0]["input_ids"])
    seqs[3]["completion_mask"] = [1] * len(seqs[3]["input_ids"])
    loss, n, grads = _sft_loss_and_grads(model, collate_sequences(seqs, tok.pad_token_id))
    loss_p, n_p, grads_p = _sft_loss_and_grads(model, collate_sequences(seqs, tok.pad_token_id, layout))
    assert n_p == n == sum(sum(s["completion_mask"][1:]) for s in seqs)
    assert loss_p == pytest.approx(loss, rel=1e-6)
    for k in grads:
        torch.testing.assert_close(grads_p[k], grads[k], **TOL)


@pytest.mark.parametrize("packing", ["", "rows"])
def test_sft_chunked_head_equals_full_logits(family, packing, monkeypatch):
    """SFT's loss through the chunked LM head (logits larger than one chunk) equals the full-logits
    cross-entropy, values and gradients, and never calls the model's own head."""
    base, tok = family
    model = copy.deepcopy(base)
    batch = collate_sequences(_sequences(len(tok)), tok.pad_token_id, packing)
    full = _sft_loss_and_grads(model, batch)
    assert not common.uses_chunked_head(model, batch)  # tiny logits: one chunk, the plain forward
    monkeypatch.setattr(common, "HEAD_CHUNK_ELEMENTS", 3 * model.config.vocab_size // 2)
    assert common.uses_chunked_head(model, batch)
    head_calls = []
    hook = model.lm_head.register_forward_hook(lambda *a: head_calls.append(1))
    chunked = _sft_loss_and_grads(model, batch)
    hook.remove()
    assert not head_calls
    assert chunked[1] == full[1] and chunked[0] == pytest.approx(full[0], rel=1e-6)
    for k in full[2]:
        torch.testing.assert_close(chunked[2][k], full[2][k], **TOL)


# ---- the reward model --------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["rows", "row"])
def test_rm_scores_packed_equal_padded(family, layout):
    """Each side's reward (read at its own last token) and the Bradley–Terry loss's gradients."""
    base, tok = family
    torch.manual_seed(0)
    model = ScalarHeadModel(copy.deepcopy(base).model)
    seqs = _sequences(len(tok), n=10, seed=7)
    pairs = [{"chosen_ids": s["input_ids"], "rejected_ids": t["input_ids"], "margin": 0.5}
             for s, t in zip(seqs[:5], seqs[5:])]
    got = {}
    for packing in ("", layout):
        model.zero_grad()
        c, r, m = rm._pair_scores(model, pairs, tok.pad_token_id, CPU, NO_AMP, packing)
        rm.reward_model_loss(c, r, m, 0.1)[0].backward()
        got[packing] = torch.cat([c, r]).detach(), {k: p.grad.clone() for k, p in model.named_parameters()}
    torch.testing.assert_close(got[layout][0], got[""][0], **TOL)
    for k in got[""][1]:
        torch.testing.assert_close(got[layout][1][k], got[""][1][k], **TOL)


def test_sft_run_packed_logs_what_padded_logs(tmp_path):
    """`tether sft packing=true` end to end (language modelling rows of varied lengths, held-out
    loss): every logged loss and the held-out loss match the padded run's."""
    import json
    import random

    from tether.run import read_jsonl
    from tether.trainers.sft import SFTConfig, train_sft

    make_tiny_model(tmp_path / "model", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                    intermediate_size=64)
    rng = random.Random(0)
    with open(tmp_path / "lm.jsonl", "w") as f:
        for _ in range(40):
            f.write(json.dumps({"text": "".join(rng.choice("abcdef ") for _ in range(rng.randint(3, 30)))}) + "\n")
    runs = {}
    for packing in (False, True):
        name = f"packed-{packing}"
        train_sft(SFTConfig(model=str(tmp_path / "model"), data=str(tmp_path / "lm.jsonl"), runs_dir=str(tmp_path),
                            name=name, batch_size=8, max_steps=3, log_every=1, lr=1e-3, device="cpu",
                            progress=False, num_samples=0, eval_fraction=0.2, packing=packing))
        runs[packing] = read_jsonl(tmp_path / name / "metrics.jsonl")
    keys = ("loss", "eval/loss")
    for a, b in zip(runs[False], runs[True]):
        assert a["step"] == b["step"]
        for k in keys:
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-5), (a["step"], k)
    assert sum("eval/loss" in r for r in runs[True]) == 1
