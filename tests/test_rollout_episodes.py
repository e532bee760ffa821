"""Multi-turn sampling in the engine (Sampler.sample(episodes=...)): the environment's replies are
fed as tokens into the same KV cache between the model's turns. These tests pin what a training
forward relies on: the model's log-probs in an episode equal one forward over the whole transcript
(observations attended, not trained), the reply lands right after the turn's end token, and the
waiting steps between a turn's end and the host's check leave no trace (positions, cache)."""

import pytest
import torch

from tether.models import make_tiny_model
from tether.objectives.logprobs import token_logps
from tether.rollout import Sampler
import tether.rollout.engine as engine
from tether.rollout.engine import Episodes

PROMPTS = ["2+3=", "hello world, this is", "x", "The quick brown fox jumps", "ab"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def eosy_model():
    """A tiny Llama with random weights sharpened so sequences end early at varied lengths (turns of
    varied length), and its tokenizer."""
    model, tok = make_tiny_model(None, family="llama", hidden_size=32, num_layers=2, num_heads=2,
                                 num_kv_heads=1, intermediate_size=64)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        model.get_output_embeddings().weight[tok.eos_token_id] *= 3.0
    return model.eval(), tok


@pytest.fixture(scope="module")
def eosy():
    return eosy_model()


class Replies(Episodes):
    """Replies to each turn with a fixed, sequence-dependent run of tokens, for `turns` turns."""

    def __init__(self, tok, turns=3):
        self.tok, self.turns = tok, turns
        self.seen: dict[int, list[list[int]]] = {}
        self.cut: set[int] = set()

    def reply(self, seq, k):
        return self.tok(f"<{seq}:{k}> ok", add_special_tokens=False).input_ids

    def turn_ended(self, seq, ids):
        got = self.seen.setdefault(seq, [])
        got.append(ids)
        return self.reply(seq, len(got)) if len(got) < self.turns else None

    def truncated(self, seq):
        self.cut.add(seq)

    def finish_reason(self, seq):
        return "length" if seq in self.cut or len(self.seen.get(seq, [])) < self.turns else "done"


def _train_logps(model, ro):
    b = ro.training_batch()
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits
    return b, token_logps(logits, b["input_ids"], ro.logprob_temperature)


def _transcript(ro, i, replies, eos):
    """The completion rebuilt from the recorded turns and the replies: turn, reply, turn, ..."""
    out = []
    for k, turn in enumerate(replies.seen[i]):
        assert turn[-1] == eos  # a turn ends with the model's end token
        out += turn
        if k + 1 < replies.turns and i not in replies.cut:
            out += replies.reply(i, k + 1)
    return out


@pytest.mark.parametrize("backend,sync_every,graphs,overlap", [
    ("native", 1, False, False), ("native", 5, False, False), ("native", 3, True, False), ("hf", 4, False, False),
    ("native", 5, False, True), ("native", 3, True, True), ("hf", 4, False, True)])
def test_episode_logprobs_equal_one_forward_over_the_transcript(eosy, backend, sync_every, graphs, overlap,
                                                                monkeypatch):
    monkeypatch.setattr(engine, "OVERLAP_TURNS", overlap)  # one more step while the host answers
    model, tok = eosy
    replies = Replies(tok)
    s = Sampler(model, tok, max_new_tokens=120, temperature=0.9, backend=backend, sync_every=sync_every)
    s._emulate_graphs = graphs
    ro = s.sample(PROMPTS, n=2, seed=3, episodes=replies)
    done = 0
    for i in range(len(ro)):
        real = ro.token_mask[i]
        ids = ro.completion_ids[i][real].tolist()
        model_ids = ro.completion_ids[i][ro.completion_mask[i]].tolist()
        assert model_ids == sum(replies.seen[i], [])[:len(model_ids)]  # the model's tokens, as sampled
        if ro.finish_reasons[i] == "done":
            done += 1
            assert ids == _transcript(ro, i, replies, tok.eos_token_id)
            assert int(ro.observation_mask[i].sum()) == sum(len(replies.reply(i, k)) for k in (1, 2))
        assert not (ro.completion_mask[i] & ro.observation_mask[i]).any()
        assert (ro.logprobs[i][ro.observation_mask[i]] == 0).all()
    assert done >= 6  # most episodes run all their turns within the budget
    b, lp = _train_logps(model, ro)
    m = b["completion_mask"].bool()
    assert (lp[m] - b["logprobs"][m]).abs().max() <= 1e-4
    assert not b["completion_mask"][:, ro.prompt_width:][ro.observation_mask].any()  # no loss on replies
    assert b["attention_mask"][:, ro.prompt_width:][ro.observation_mask].all()  # but attended


def test_waiting_steps_between_turns_change_nothing(eosy):
    """Greedy episodes are the same token for token whether the host checks every step (the reply
    follows the end token at once) or every 7 (the row waits up to 6 steps, in masked slots)."""
    model, tok = eosy
    out = []
    for sync_every in (1, 7):
        r = Replies(tok)
        ro = Sampler(model, tok, max_new_tokens=100, temperature=0, sync_every=sync_every).sample(
            PROMPTS, n=1, episodes=r)
        out.append(([ro.completion_ids[i][ro.token_mask[i]].tolist() for i in range(len(ro))], r.seen))
    assert out[0] == out[1]


class UnevenReplies(Replies):
    """Sequence i's episode runs 1 + i % 3 turns: episodes end at different steps, so the batch
    compacts while other rows are between turns."""

    def turn_ended(self, seq, ids):
        got = self.seen.setdefault(seq, [])
        got.append(ids)
        return self.reply(seq, len(got)) if len(got) < 1 + seq % 3 else None


@pytest.mark.parametrize("graphs", [False, True])
def test_overlapped_boundaries_change_no_greedy_episode(eosy, graphs, monkeypatch):
    """With OVERLAP_TURNS a row whose turn ended waits one step more (the step the GPU runs while the
    host asks the environment), and a turn that ends in that step is answered at the next check;
    greedy episodes are the same token for token, turn for turn, batch compaction included."""
    model, tok = eosy
    out = []
    for overlap in (False, True):
        monkeypatch.setattr(engine, "OVERLAP_TURNS", overlap)
        r = UnevenReplies(tok)
        s = Sampler(model, tok, max_new_tokens=100, temperature=0, sync_every=3)
        s._emulate_graphs = graphs
        ro = s.sample(PROMPTS * 3, n=1, episodes=r)
        out.append(([ro.completion_ids[i][ro.token_mask[i]].tolist() for i in range(len(ro))], r.seen,
                    list(ro.finish_reasons)))
        if overlap:
            b, lp = _train_logps(model, ro)
            m = b["completion_mask"].bool()
            assert (lp[m] - b["logprobs"][m]).abs().max() <= 1e-4
    assert out[0] == out[1]
    assert sum(len(v) for v in out[1][1].values()) > len(PROMPTS) * 3  # episodes of several turns ran


def test_budget_cuts_an_episode_and_a_reply_that_does_not_fit(eosy):
    model, tok = eosy
    r = Replies(tok, turns=50)
    ro = Sampler(model, tok, max_new_tokens=40, temperature=0.9).sample(PROMPTS, n=2, seed=0, episodes=r)
    assert all(reason == "length" for reason in ro.finish_reasons)
    assert int(ro.token_mask.sum(-1).max()) <= 40
    b, lp = _train_logps(model, ro)
    m = b["completion_mask"].bool()
    assert (lp[m] - b["logprobs"][m]).abs().max() <= 1e-4


def test_single_turn_calls_are_unchanged(eosy):
    model, tok = eosy
    s = Sampler(model, tok, max_new_tokens=30, temperature=0.9)
    a = s.sample(PROMPTS, n=2, seed=5)
    assert a.observation_mask is None and torch.equal(a.token_mask, a.completion_mask)
    one = Replies(tok, turns=1)  # an episode of one turn is a single-turn rollout
    b = s.sample(PROMPTS, n=2, seed=5, episodes=one)
    assert a.texts == b.texts and torch.equal(a.completion_ids, b.completion_ids)
    assert torch.allclose(a.logprobs, b.logprobs)
