"""The episode loop (tether.envs.rollouts) over the engine: environments' replies rendered
by the chat template and fed as tokens, the transcript's ids never re-tokenized, the counts."""

import pytest
import torch

from tether.data.chat import encode_text, render
from tether.models import make_tiny_model
from tether.objectives.logprobs import token_logps
from tether.rollout import Sampler
from tether.envs.rollouts import EnvSection, episode_metrics, sample_episodes


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _turn_taker(family: str, **shape):
    """A tiny model whose turns end early: its chat template's end of turn (<|end|>) made likely."""
    model, tok = make_tiny_model(None, family=family, hidden_size=32, num_layers=2, num_heads=2,
                                 num_kv_heads=1, intermediate_size=64, **shape)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        end = tok.convert_tokens_to_ids("<|end|>")
        model.get_output_embeddings().weight[end] *= 3.0
    return model.eval(), tok


@pytest.fixture(scope="module")
def lm():
    return _turn_taker("llama")


@pytest.fixture(scope="module")
def gemma_lm():
    """Gemma 3's layout, its local layers' window (16 tokens) shorter than the episodes: keys masked
    by position across turn boundaries, where the cache holds waiting slots between a row's tokens."""
    return _turn_taker("gemma3", sliding_window=16)


class Echo:
    """Step-based: answers each turn with the row's word and the turn number; done after 3 turns."""

    def reset(self, row):
        self.word, self.k = row["word"], 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        self.k += 1
        return [{"role": "user", "content": f"{self.word} {self.k}"}], float(len(text) % 2), self.k >= 3


class Broken(Echo):
    def reset(self, row):
        if row["word"] == "bad":
            raise ValueError("no such word")
        return super().reset(row)


ROWS = [{"prompt": "say hi", "word": "apple"}, {"prompt": "count", "word": "kiwi"},
        {"prompt": "go on then", "word": "fig"}]


def _model_turns(ro, i):
    """Sequence i's model turns: the runs of its completion mask."""
    turns, cur = [], []
    for t, model, real in zip(ro.completion_ids[i].tolist(), ro.completion_mask[i].tolist(),
                              ro.token_mask[i].tolist()):
        if model:
            cur.append(t)
        elif real and cur:
            turns.append(cur)
            cur = []
    return turns + ([cur] if cur else [])


@pytest.mark.parametrize("family", ["lm", "gemma_lm"])
def test_transcript_ids_are_the_prompt_the_samples_and_the_rendered_replies(family, request):
    model, tok = request.getfixturevalue(family)
    section = EnvSection(max_turns=5)
    # the host checks every 4 steps, as on a GPU: a turn that ends between checks leaves waiting slots
    # in the cache between the row's tokens
    ro, kept = sample_episodes(Sampler(model, tok, max_new_tokens=200, temperature=1.0, sync_every=4), tok,
                               Echo, ROWS, n=6, section=section, seed=0)
    assert kept == [0, 1, 2] and len(ro) == 18
    checked = 0
    for i, ep in enumerate(ro.episodes):
        ids = ro.prompt_ids[i] + ro.completion_ids[i][ro.token_mask[i]].tolist()
        assert ep["turns"] == sum(1 for m in ep["messages"] if m["role"] == "assistant")
        if ro.finish_reasons[i] == "done":
            assert ep["turns"] == 3 and ep["turn_rewards"] and ep["env_reward"] == sum(ep["turn_rewards"])
            # The transcript rendered again by the chat template and tokenized is the sequence trained
            # on: no drift. (The messages hold each turn's text with special tokens dropped, as an
            # environment reads it; the check puts back what the model wrote, specials included.)
            turns = _model_turns(ro, i)
            messages = [dict(m) for m in ep["messages"]]
            for m in (m for m in messages if m["role"] == "assistant"):
                m["content"] = tok.decode(turns.pop(0)[:-1], skip_special_tokens=False)
            assert encode_text(tok, render(tok, messages)) == ids, i
            checked += 1
    assert checked >= 3
    m = episode_metrics(ro)
    assert m["env/turns"] == sum(e["turns"] for e in ro.episodes) / 18
    assert m["env/episode_tokens"] == float(ro.token_mask.sum(-1).float().mean())
    b = ro.training_batch()
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits
    lp = token_logps(logits, b["input_ids"], ro.logprob_temperature)
    mk = b["completion_mask"].bool()
    assert (lp[mk] - b["logprobs"][mk]).abs().max() <= 1e-4


def test_a_reset_that_raises_skips_its_row_and_is_counted(lm):
    model, tok = lm
    rows = ROWS[:1] + [{"prompt": "x", "word": "bad"}] + ROWS[1:]
    ro, kept = sample_episodes(Sampler(model, tok, max_new_tokens=60, temperature=1.0), tok, Broken, rows,
                               n=2, section=EnvSection(), seed=1)
    assert kept == [0, 2, 3] and len(ro) == 6
    assert episode_metrics(ro)["env/reset_errors"] == 1.0
    assert torch.equal(ro.group, torch.tensor([0, 0, 1, 1, 2, 2]))


def test_max_turns_ends_the_episode(lm):
    model, tok = lm
    ro, _ = sample_episodes(Sampler(model, tok, max_new_tokens=200, temperature=1.0), tok, Echo, ROWS,
                            n=2, section=EnvSection(max_turns=2), seed=2)
    assert max(e["turns"] for e in ro.episodes) <= 2
    assert "turns" in ro.finish_reasons


class Said:
    """Class-based, no tools: the reward is the length of the last assistant message's text."""

    def reset(self, prompt, word):
        return prompt

    def reward(self, completion):
        return float(len(completion))


def test_a_turn_cut_off_by_the_token_budget_is_the_transcripts_last_message(lm):
    model, tok = lm
    ro, _ = sample_episodes(Sampler(model, tok, max_new_tokens=6, temperature=1.0), tok, Said, ROWS,
                            n=4, section=EnvSection(max_turns=3), seed=3)
    cut = [i for i, r in enumerate(ro.finish_reasons) if r == "length"]
    assert cut
    for i in cut:
        ep, last = ro.episodes[i], _model_turns(ro, i)[-1]
        text = tok.decode(last, skip_special_tokens=True)
        assert text and ep["messages"][-1] == {"role": "assistant", "content": text}
        assert ep["turns"] == 1 and ep["env_reward"] == float(len(text))


class Parity:
    """One turn: reward 1 when the model's reply has an even number of characters."""

    def reset(self, row):
        return row["prompt"]

    def step(self, text):
        return [], float(len(text) % 2 == 0), True

    @classmethod
    def rows(cls, size, seed=0):
        return [{"prompt": f"row {seed}-{i}"} for i in range(size)]


def test_eval_gives_pass_at_k_of_episodes(lm, tmp_path):
    from tether.evaluation.command import EvalConfig, run_eval
    from tether.evaluation.estimators import pass_at_k

    model, tok = lm
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    out = run_eval(EvalConfig(model=str(tmp_path / "m"), env="tests.test_env_rollouts:Parity", data="env",
                              eval_rows=6, n=4, k=[1, 2, 4], max_new_tokens=40, device="cpu",
                              out=str(tmp_path / "ev"), table=False))
    import json
    records = [json.loads(line) for line in (tmp_path / "ev" / "completions.jsonl").read_text().splitlines()]
    sampled = [r for r in records if r["decoding"] == "sampled"]
    assert len(sampled) == 24 and {r["prompt_index"] for r in sampled} == set(range(6))
    for r in sampled:
        assert r["passed"] == (r["reward"] == 1.0)
    for k in (1, 2, 4):
        want = sum(pass_at_k(4, sum(r["passed"] for r in sampled if r["prompt_index"] == i), k)
                   for i in range(6)) / 6
        assert out["metrics"][f"sampled/pass@{k}"] == pytest.approx(want)
    assert 0 < out["metrics"]["sampled/pass@1"] < 1  # a random model passes some and fails some
    assert out["metrics"]["greedy/episodes"] == 6


def test_the_training_forward_puts_no_loss_on_the_environments_tokens(lm):
    """The trainers' log-prob forward (models.logprobs.completion_token_logps) over an episode
    batch: non-zero, and equal to the sampler's, exactly on the model's tokens; 0 with no gradient
    on the environment's (they are in the input, attended, and out of every loss)."""
    import contextlib

    from tether.models.logprobs import completion_token_logps

    model, tok = lm
    ro, _ = sample_episodes(Sampler(model, tok, max_new_tokens=120, temperature=1.0), tok, Echo, ROWS,
                            n=2, section=EnvSection(), seed=5)
    assert ro.observation_mask.any()
    b = ro.training_batch()
    model.train()
    logps, _ = completion_token_logps(model, b, ro.logprob_temperature, contextlib.nullcontext())
    model.eval()
    P = ro.prompt_width
    env, own = ro.observation_mask, ro.completion_mask
    assert (logps[:, P:][env] == 0).all() and (logps[:, P:][own] != 0).all()
    assert (logps[:, P:][own] - ro.logprobs[own]).abs().max() <= 1e-4
