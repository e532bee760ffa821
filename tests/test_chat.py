"""`tether chat`: replies streamed from tether's sampler, the conversation kept as token ids (the
template's deltas after the sampled ids, never re-tokenized), /reset and /system, a run directory
as model=, plain completion, and an environment's tool calls run by its episode."""

import io
import json
import subprocess
import sys

import pytest
import torch

from tether.chat import Chat, ChatConfig, resolve_model_path
from tether.cli import main
from tether.data.chat import encode_text, render, special_ids
from tether.envs.render import observation_ids, prompt_ids
from tether.errors import UserError
from tether.models import make_tiny_model
from tether.models.tiny import char_tokenizer
from tether.rollout import Sampler

SHAPE = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def lm():
    """A random tiny model whose messages end early (<|end|>, the template's end of turn, made
    likely) and hold special tokens (<|system|> made likely): text without them re-tokenizes to
    other ids than the model wrote."""
    model, tok = make_tiny_model(None, **SHAPE)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        head = model.get_output_embeddings().weight
        head[tok.convert_tokens_to_ids("<|end|>")] *= 2.2
        head[tok.convert_tokens_to_ids("<|system|>")] *= 1.5
    return model.eval(), tok


def greedy(model, tok, ids, max_new_tokens=40, chat=True):
    """Greedy decoding of `ids` by transformers' own generate, to EOS or (chat) the template's end of turn."""
    end = [tok.eos_token_id] + ([tok.convert_tokens_to_ids("<|end|>")] if chat else [])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=end,
                             pad_token_id=tok.pad_token_id)
    return out[0, len(ids):].tolist()


def shown(tok, ids):
    """A message as the chat writes it: its text without the end of turn and special tokens."""
    end = tok.convert_tokens_to_ids("<|end|>")
    ids = ids[:-1] if ids and ids[-1] == end else ids
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# -- the sampler's stream hook -----------------------------------------------------------------------

@pytest.mark.parametrize("graphs", [False, True])
def test_stream_hands_out_each_completion_as_it_is_sampled(lm, graphs):
    model, tok = lm
    prompts = [prompt_ids(tok, [{"role": "user", "content": t}]) for t in ("hi", "what?", "tell me", "ok")]
    sampler = Sampler(model, tok, max_new_tokens=30, temperature=1.0, sync_every=3, max_batch_size=3)
    sampler._emulate_graphs = graphs  # the CUDA-graph code path, replayed eagerly on CPU
    free = sampler.sample(prompts, n=2, seed=5)
    stop = free.texts[0][4]  # a stop string that cuts the first completion short
    got: dict[int, list[int]] = {}
    calls = []
    ro = sampler.sample(prompts, n=2, seed=5, stop=[stop],
                        stream=lambda i, ids: (got.setdefault(i, []).extend(ids), calls.append(i)))
    assert ro.finish_reasons[0] == "stop" and "eos" in ro.finish_reasons
    assert [got.get(i, []) for i in range(len(ro))] == ro.completion_lists()  # waves: 3 + 3 + 2
    assert len(calls) > len(ro)  # in pieces, while decoding: not once at the end
    with pytest.raises(ValueError, match="single-turn"):
        sampler.sample(prompts, episodes=object(), stream=lambda i, ids: None)


# -- through a pipe ------------------------------------------------------------------------------------

def test_chat_through_a_pipe(lm, tmp_path):
    """A run directory as model=, greedy replies equal to transformers' generate over the ids the
    conversation holds, /system and /reset, and the history saved as the sampled ids."""
    model, tok = lm
    run = tmp_path / "runs" / "x"
    other, _ = make_tiny_model(None, **SHAPE)  # an earlier checkpoint: other replies
    for step, m in ((1, other), (3, model)):  # the run's latest checkpoint is the one chatted with
        ckpt = run / "checkpoints" / f"step-{step}"
        m.save_pretrained(ckpt)
        tok.save_pretrained(ckpt)
        (ckpt / "trainer_state.pt").write_bytes(b"")
    save = tmp_path / "chat.json"
    lines = ["tell me a story", "/system be brief", "tell me a story", "/reset", "tell me a story", "what?"]
    r = subprocess.run([sys.executable, "-m", "tether", "chat", f"model={run}", "device=cpu", "temperature=0",
                        "max_new_tokens=40", f"save={save}"], input="\n".join(lines) + "\n",
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "(system prompt set; new conversation)" in r.stderr and "(new conversation)" in r.stderr

    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    end = [tok.convert_tokens_to_ids("<|end|>")]
    closed = lambda ids: ids if ids[-1:] == end else ids + end  # noqa: E731
    system = [{"role": "system", "content": "be brief"}]
    p1 = prompt_ids(tok, [user("tell me a story")])
    r1 = greedy(model, tok, p1)
    p2 = prompt_ids(tok, system + [user("tell me a story")])
    r2 = greedy(model, tok, p2)
    r3 = r2  # /reset keeps the system prompt: the same prompt again
    history = p2 + closed(r3) + observation_ids(tok, [user("what?")])
    r4 = greedy(model, tok, history)
    assert r1 != r2, "the system prompt should change the reply"
    assert r.stdout == "".join(shown(tok, x) + "\n" for x in (r1, r2, r3, r4))

    saved = json.loads(save.read_text())
    assert saved["ids"] == history + closed(r4)  # the template's delta after the sampled ids, as sampled
    assert [m["role"] for m in saved["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    # The text of the conversation, rendered and tokenized again, is not what the model read: the
    # sampled special tokens are kept in the ids, not in the text.
    assert any(t in special_ids(tok) and t not in end for t in r3)
    assert encode_text(tok, render(tok, saved["messages"])) != saved["ids"]


def test_resolve_model_path(tmp_path, lm):
    model, tok = lm
    run = tmp_path / "run"
    for step in (2, 10, 9):
        (run / "checkpoints" / f"step-{step}").mkdir(parents=True)
        (run / "checkpoints" / f"step-{step}" / "trainer_state.pt").write_bytes(b"")
    (run / "checkpoints" / "step-11").mkdir()  # cut short: no trainer state
    assert resolve_model_path(str(run)) == str(run / "checkpoints" / "step-10")
    model.save_pretrained(tmp_path / "m")
    assert resolve_model_path(str(tmp_path / "m")) == str(tmp_path / "m")
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="neither a model"):
        resolve_model_path(str(tmp_path / "empty"))


def test_help_lists_the_sampling_options(capsys):
    assert main(["chat", "--help"]) == 0
    out = capsys.readouterr().out
    for key in ("temperature", "top_p", "max_new_tokens", "system", "env", "save"):
        line = next(x for x in out.splitlines() if x.strip().startswith(key + " "))
        assert "[" in line and line.split(key, 1)[1].strip()[0] != "[", line  # a doc, then type and default


def test_ctrl_c_keeps_what_was_written_and_the_chat_goes_on(lm):
    model, tok = lm

    class Interrupting(io.StringIO):
        """Ctrl-C while the third piece of the first message is written out."""
        pieces = 0

        def write(self, text):
            Interrupting.pieces += 1
            if Interrupting.pieces == 3:
                raise KeyboardInterrupt
            return super().write(text)

    out = Interrupting()
    chat = Chat(model, tok, ChatConfig(model="m", temperature=0, max_new_tokens=40), out=out, note=lambda _: None)
    start = chat.user("be brief")
    chat.reply()
    full = greedy(model, tok, start)
    end = [tok.convert_tokens_to_ids("<|end|>")]
    cut = chat.ids[len(start):-1]
    assert chat.ids[-1:] == end and 0 < len(cut) < len(full) and full[:len(cut)] == cut  # closed where it stopped
    chat.reset()
    chat.user("be brief")
    chat.reply()
    assert chat.ids == start + full  # the sampler works as before


# -- plain completion ----------------------------------------------------------------------------------

def test_plain_completion_appends_each_line_to_the_text(lm):
    model, tok = lm
    tok = char_tokenizer()  # the same vocabulary, without a chat template: a base model's
    tok.chat_template = None
    out = io.StringIO()
    chat = Chat(model, tok, ChatConfig(model="m", temperature=0, max_new_tokens=12), out=out, note=lambda _: None)
    assert chat.plain
    first = chat.user("Once")
    assert first == [tok.bos_token_id] + encode_text(tok, "Once")
    chat.reply()
    r1 = greedy(model, tok, first, 12, chat=False)
    eos = [tok.eos_token_id]
    kept = r1[:-1] if r1[-1:] == eos else r1
    assert chat.ids == first + kept
    sep = "" if tok.decode(kept[-1:]).endswith("\n") else "\n"
    second = chat.user("upon")
    assert second == encode_text(tok, sep + "upon")
    chat.reply()
    r2 = greedy(model, tok, first + kept + second, 12, chat=False)
    assert out.getvalue() == "".join(shown(tok, x) + "\n" for x in (r1, r2))


# -- an environment's tools ------------------------------------------------------------------------------

ENV = '''
from pathlib import Path

LOG = Path({log!r})


class AddEnv:
    def reset(self, prompt):
        return prompt

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        with LOG.open("a") as f:
            f.write(f"{{a}} {{b}}\\n")
        return a + b
'''


def _env(tmp_path) -> str:
    path = tmp_path / "add_env.py"
    path.write_text(ENV.format(log=str(tmp_path / "calls.log")))
    return f"{path}:AddEnv"


def test_a_tool_call_is_run_and_its_result_appended(lm, tmp_path):
    """The seam between sampling and the environment: a message's ids with a call -> the episode
    runs it -> the result's ids (the template's delta) follow the sampled ids; a message without
    one gives the floor back and is kept as it is."""
    model, tok = lm
    spec = _env(tmp_path)
    from tether.envs import load_env
    from tether.envs.rollouts import EpisodeBatch

    chat = Chat(model, tok, ChatConfig(model="m", env=spec), factory=load_env(spec), note=lambda _: None)
    start = chat.user("add 2 and 3")
    assert start == prompt_ids(tok, chat.messages, chat.tools) and chat.messages[0]["role"] == "system"
    assert "add(a: integer, b: integer)" in chat.messages[0]["content"]  # the tools, described in the prompt
    end = tok.convert_tokens_to_ids("<|end|>")
    call = encode_text(tok, "CALL add(a=2, b=3)") + [end]
    batch = EpisodeBatch([chat.episode], tok, 8)
    results = chat.take(call, batch)
    assert results == [{"role": "user", "content": "RESULT add: 5"}]
    assert (tmp_path / "calls.log").read_text() == "2 3\n"
    assert chat.ids == start + call + observation_ids(tok, results, chat.tools)
    answer = encode_text(tok, "#### 5") + [end]
    assert chat.take(answer, batch) is None
    assert chat.ids == start + call + observation_ids(tok, results, chat.tools) + answer
    # the next message of the user continues the same episode
    more = chat.user("and 4 and 4?")
    assert more == observation_ids(tok, [{"role": "user", "content": "and 4 and 4?"}], chat.tools)
    assert chat.take(encode_text(tok, "CALL add(a=4, b=4)") + [end], batch) == [
        {"role": "user", "content": "RESULT add: 8"}]


def test_chat_runs_the_tools_a_model_calls(tmp_path, monkeypatch, capsys):
    """End to end with a model that has learned one tool-using exchange: it calls the tool, the
    environment runs it, the result is appended, and the model answers from it."""
    model, tok = make_tiny_model(None, **SHAPE)
    spec = _env(tmp_path)
    from tether.envs import load_env
    from tether.envs.rollouts import EpisodeBatch

    # the exchange's ids, built as the chat builds them
    chat = Chat(model, tok, ChatConfig(model="m", env=spec), factory=load_env(spec), note=lambda _: None)
    start = chat.user("add 2 and 3")
    end = tok.convert_tokens_to_ids("<|end|>")
    call, answer = encode_text(tok, "CALL add(a=2, b=3)") + [end], encode_text(tok, "#### 5") + [end]
    batch = EpisodeBatch([chat.episode], tok, 8)
    chat.take(call, batch)
    chat.take(answer, batch)
    ids = chat.ids
    targets = [0] * len(start) + [1] * len(call)
    targets += [0] * (len(ids) - len(targets) - len(answer)) + [1] * len(answer)
    _memorize(model, ids, targets)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    (tmp_path / "calls.log").unlink()

    monkeypatch.setattr(sys, "stdin", io.StringIO("add 2 and 3\n"))
    save = tmp_path / "chat.json"
    assert main(["chat", f"model={tmp_path / 'm'}", f"env={spec}", "device=cpu", "temperature=0",
                 f"save={save}"]) == 0
    out = capsys.readouterr().out
    assert out == "CALL add(a=2, b=3)\n[tool] RESULT add: 5\n#### 5\n"
    assert (tmp_path / "calls.log").read_text() == "2 3\n"  # run by the environment, in the chat
    assert json.loads(save.read_text())["ids"] == ids


def _memorize(model, ids, targets, steps=400):
    """Train `model` until greedy decoding reproduces the target tokens of `ids`, with a margin."""
    x = torch.tensor([ids])
    labels = torch.tensor([[t if m else -100 for t, m in zip(ids, targets)]])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    want = labels[0, 1:]
    margin = 20  # steps past the first where every target token is the likeliest: no near-ties left
    for _ in range(steps):
        out = model(input_ids=x, labels=labels)
        if (out.logits[0, :-1].argmax(-1)[want >= 0] == want[want >= 0]).all():
            margin -= 1
            if not margin:
                break
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    model.eval()


# -- on a GPU: the CUDA-graph decode loop streams, and the chat runs on it --------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sync_every", [0, 1])
def test_stream_and_chat_on_cuda(lm, tmp_path, sync_every):
    model, tok = lm
    gpu = __import__("copy").deepcopy(model).to("cuda")
    prompts = [prompt_ids(tok, [{"role": "user", "content": t}]) for t in ("hi", "what?", "tell me", "ok")]
    sampler = Sampler(gpu, tok, max_new_tokens=40, temperature=1.0, sync_every=sync_every)
    got: dict[int, list[int]] = {}
    ro = sampler.sample(prompts, n=3, seed=1, stream=lambda i, ids: got.setdefault(i, []).extend(ids))
    assert sampler.graphs  # the decode steps were CUDA graphs
    assert [got.get(i, []) for i in range(len(ro))] == ro.completion_lists()

    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    save = tmp_path / "chat.json"
    r = subprocess.run([sys.executable, "-m", "tether", "chat", f"model={tmp_path / 'm'}", "device=cuda",
                        "dtype=fp32", "temperature=0", "max_new_tokens=40", f"save={save}"],
                       input="tell me a story\nwhat?\n", capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    eager = Sampler(gpu, tok, max_new_tokens=40, temperature=0, cuda_graphs=False,
                    stop_token_ids=[tok.convert_tokens_to_ids("<|end|>")])
    end = [tok.convert_tokens_to_ids("<|end|>")]
    history = prompt_ids(tok, [{"role": "user", "content": "tell me a story"}])
    replies = []
    for text in (None, "what?"):
        if text:
            history += observation_ids(tok, [{"role": "user", "content": text}])
        reply = eager.sample([history]).completion_lists()[0]
        replies.append(reply)
        history += reply if reply[-1:] == end else reply + end
    assert r.stdout == "".join(shown(tok, x) + "\n" for x in replies)
    assert json.loads(save.read_text())["ids"] == history
