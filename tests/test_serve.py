"""`tether serve`: OpenAI chat completions over tether's sampler. Greedy replies and their ids equal
transformers' own generate over the chat template's render, log-probs a forward pass's, n and seed,
max_tokens, stop strings, streaming, the token ids in every response (and in save=), tool calls read
in the chat template's format (and assistant tool calls rendered back), and a 400 in OpenAI's error
shape for each bad request."""

import json

import pytest
import torch

from extras import needs
from tether.models import make_tiny_model
from tether.models.tiny import CHAT_TEMPLATE

pytestmark = needs("fastapi", "httpx")

SHAPE = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
HELLO = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me a story"}]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """A random tiny model whose replies end early (<|end|>, the template's end of turn, made
    likely), saved as a run's checkpoint; and a client of `tether serve` over the run directory."""
    from fastapi.testclient import TestClient

    from tether.serve import make_app

    model, tok = make_tiny_model(None, **SHAPE)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        model.get_output_embeddings().weight[tok.convert_tokens_to_ids("<|end|>")] *= 2.2
    run = tmp_path_factory.mktemp("serve") / "run"
    ckpt = run / "checkpoints" / "step-3"
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    (ckpt / "trainer_state.pt").write_bytes(b"")
    save = run.parent / "calls.jsonl"
    app = make_app(str(run), device="cpu", name="tiny", max_tokens=40, save=str(save))
    return model.eval(), tok, TestClient(app), save


def rendered(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def generate(model, tok, ids, max_new_tokens=40):
    """Greedy decoding by transformers' generate, to EOS or the template's end of turn."""
    end = [tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=end,
                             pad_token_id=tok.pad_token_id)
    return out[0, len(ids):].tolist()


def text(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def post(client, **body):
    r = client.post("/v1/chat/completions", json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_reply_and_its_ids_are_transformers_generate(lm):
    model, tok, client, _ = lm
    prompt = rendered(tok, HELLO)
    want = generate(model, tok, prompt)
    assert want[-1] == tok.convert_tokens_to_ids("<|end|>") and 3 < len(want) < 40  # ends on its own
    r = post(client, messages=HELLO, temperature=0)
    [c] = r["choices"]
    assert c["tether"]["prompt_token_ids"] == prompt
    assert c["tether"]["completion_token_ids"] == want
    assert c["message"] == {"role": "assistant", "content": text(tok, want)}
    assert c["finish_reason"] == "stop" and c["logprobs"] is None
    assert r["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(want),
                          "total_tokens": len(prompt) + len(want)}
    assert r["object"] == "chat.completion" and r["model"] == "tiny" and r["id"].startswith("chatcmpl-")
    # the template's render with the other roles (a developer message reads as a system message)
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": "yo"}, {"role": "tool", "content": "42"}]
    r = post(client, messages=messages, temperature=0, max_tokens=3)
    as_system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}] + messages[2:]
    assert r["choices"][0]["tether"]["prompt_token_ids"] == rendered(tok, as_system)


def test_logprobs_are_a_forward_pass_log_softmax(lm):
    model, tok, client, _ = lm
    r = post(client, messages=HELLO, temperature=0.8, seed=3, logprobs=True, top_logprobs=2)
    [c] = r["choices"]
    prompt, ids = c["tether"]["prompt_token_ids"], c["tether"]["completion_token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    want = torch.log_softmax(logits / 0.8, -1)
    at = want.gather(-1, torch.tensor(ids)[:, None])[:, 0]
    content = c["logprobs"]["content"]
    assert [e["logprob"] for e in content] == pytest.approx(at.tolist(), abs=1e-4)
    assert c["tether"]["completion_logprobs"] == pytest.approx(at.tolist(), abs=1e-4)
    assert c["tether"]["logprob_temperature"] == 0.8
    assert "".join(e["token"] for e in content) == tok.decode(ids, skip_special_tokens=False)
    top = want.topk(2, -1)
    for e, vals, idx in zip(content, top.values.tolist(), top.indices.tolist()):
        assert [t["logprob"] for t in e["top_logprobs"]] == pytest.approx(vals, abs=1e-4)
        assert [t["token"] for t in e["top_logprobs"]] == [tok.decode([i]) for i in idx]
    # greedy: log-probs at temperature 1
    c = post(client, messages=HELLO, temperature=0, logprobs=True)["choices"][0]
    ids = c["tether"]["completion_token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    at = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    assert [e["logprob"] for e in c["logprobs"]["content"]] == pytest.approx(at.tolist(), abs=1e-4)


def test_n_choices_are_reproducible_with_a_seed(lm):
    _, _, client, _ = lm
    ids = lambda r: [c["tether"]["completion_token_ids"] for c in r["choices"]]  # noqa: E731
    a = post(client, messages=HELLO, temperature=1.0, n=3, seed=7)
    b = post(client, messages=HELLO, temperature=1.0, n=3, seed=7)
    c = post(client, messages=HELLO, temperature=1.0, n=3, seed=8)
    assert [ch["index"] for ch in a["choices"]] == [0, 1, 2]
    assert ids(a) == ids(b) and len(set(map(tuple, ids(a)))) == 3
    assert ids(a) != ids(c)
    assert a["usage"]["completion_tokens"] == sum(map(len, ids(a)))


def test_max_tokens_ends_with_length(lm):
    model, tok, client, _ = lm
    prompt = rendered(tok, HELLO)
    want = generate(model, tok, prompt)
    for key in ("max_tokens", "max_completion_tokens"):
        c = post(client, messages=HELLO, temperature=0, **{key: 3})["choices"][0]
        assert c["finish_reason"] == "length" and c["tether"]["completion_token_ids"] == want[:3]
        assert c["message"]["content"] == text(tok, want[:3])


def test_stop_string_is_left_out_of_the_text_and_kept_in_the_ids(lm):
    model, tok, client, _ = lm
    want = generate(model, tok, rendered(tok, HELLO))
    full = text(tok, want)
    stop = full[3:5]
    cut = full.find(stop)
    c = post(client, messages=HELLO, temperature=0, stop=[stop, "never written"])["choices"][0]
    assert c["finish_reason"] == "stop" and c["message"]["content"] == full[:cut]
    ids = c["tether"]["completion_token_ids"]
    assert ids == want[:len(ids)] and text(tok, ids).endswith(stop)


def stream(client, **body):
    with client.stream("POST", "/v1/chat/completions", json={"stream": True, **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_stream_concatenates_to_the_reply(lm):
    _, tok, client, _ = lm
    for body in ({"temperature": 0}, {"temperature": 1.0, "n": 2, "seed": 5, "logprobs": True},
                 {"temperature": 0, "stop": "e"}, {"temperature": 0, "max_tokens": 4}):
        whole = post(client, messages=HELLO, **body)
        chunks = stream(client, messages=HELLO, stream_options={"include_usage": True}, **body)
        assert all(ch["object"] == "chat.completion.chunk" and ch["id"] == chunks[0]["id"] for ch in chunks)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
        for want in whole["choices"]:
            mine = [c for ch in chunks for c in ch["choices"] if c["index"] == want["index"]]
            assert mine[0]["delta"]["role"] == "assistant"
            assert "".join(c["delta"].get("content", "") for c in mine) == want["message"]["content"]
            pieces = [c for c in mine if c["delta"].get("content")]
            assert len(pieces) >= min(2, len(want["message"]["content"]))  # as it is sampled, not at once
            last = mine[-1]
            assert all(c["finish_reason"] is None for c in mine[:-1])
            assert last["finish_reason"] == want["finish_reason"] and last["tether"] == want["tether"]
            assert last["logprobs"] == want["logprobs"]


def test_ids_are_saved_under_the_session_header(lm):
    _, _, client, save = lm
    save.unlink(missing_ok=True)
    r = client.post("/v1/chat/completions", json={"messages": HELLO, "n": 2, "seed": 1},
                    headers={"X-Session-ID": "trace-1"}).json()
    stream(client, messages=HELLO, temperature=0)
    calls = [json.loads(line) for line in save.read_text().splitlines()]
    assert [c["session"] for c in calls] == ["trace-1", None]
    assert calls[0]["id"] == r["id"]
    assert calls[0]["prompt_token_ids"] == r["choices"][0]["tether"]["prompt_token_ids"]
    assert [c["completion_token_ids"] for c in calls[0]["choices"]] == \
        [c["tether"]["completion_token_ids"] for c in r["choices"]]


def test_models_lists_the_model(lm):
    _, _, client, _ = lm
    r = client.get("/v1/models")
    assert r.status_code == 200
    [m] = r.json()["data"]
    assert m["id"] == "tiny" and m["object"] == "model" and m["max_model_len"] == 512


@pytest.mark.parametrize("body, param, needle", [
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": None}, "messages", "got null"),
    ({"messages": "hi"}, "messages", "got a string"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "one of system"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "no content"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "got an integer"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content", "only text parts"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"max_tokens": -5}, "max_tokens", "at least 1"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
    ({"max_tokens": "10"}, "max_tokens", "must be an integer, got a string"),
    ({"max_tokens": 2.5}, "max_tokens", "must be an integer"),
    ({"temperature": "hot"}, "temperature", "must be a number"),
    ({"temperature": True}, "temperature", "must be a number, got a boolean"),
    ({"temperature": 3}, "temperature", "[0, 2]"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"n": 0}, "n", "at least 1"),
    ({"seed": "x"}, "seed", "integer"),
    ({"stop": 5}, "stop", "'stop'"),
    ({"stop": [""]}, "stop", "'stop'"),
    ({"tools": {"type": "function"}}, "tools", "'tools'"),
    ({"stream": "yes"}, "stream", "true or false"),
    ({"logprobs": 1}, "logprobs", "true or false"),
    ({"top_logprobs": 2}, "top_logprobs", "needs 'logprobs'"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs", "at most 20"),
    ({"messages": [{"role": "user", "content": "x" * 600}]}, "messages", "reads at most 512"),
])
def test_bad_requests_are_400_in_openai_error_shape(lm, body, param, needle):
    _, _, client, _ = lm
    body = {"messages": HELLO, **body}
    for streamed in (False, True):
        r = client.post("/v1/chat/completions", json={**body, "stream": streamed}
                        if "stream" not in body else body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and needle in err["message"]
        assert "\n" not in err["message"]
    assert post(client, messages=HELLO, max_tokens=2)["choices"]  # the server goes on


def test_a_template_that_rejects_the_messages_and_a_body_that_is_not_json(lm):
    _, tok, client, _ = lm
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    # a template that raises on a role order it does not take (as Gemma's and Mistral's do)
    server = client.app.state.server
    original = server.tok.chat_template
    server.tok.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must "
                                "start with a user message') }}{% endif %}" + original)
    try:
        r = client.post("/v1/chat/completions", json={"messages": HELLO})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages"
        assert "chat template rejects these messages" in err["message"] and "start with a user" in err["message"]
        assert post(client, messages=HELLO[1:], max_tokens=2)["choices"]
    finally:
        server.tok.chat_template = original


def test_tools_go_to_the_chat_template(lm):
    _, _, client, _ = lm
    server = client.app.state.server
    tok, original = server.tok, server.tok.chat_template
    server.tok.chat_template = ("{% if tools %}<|system|>{{ tools | map(attribute='function.name') | join(',') }}"
                                "<|end|>{% endif %}" + original)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    try:
        c = post(client, messages=HELLO, tools=tools, max_tokens=2)["choices"][0]
        assert c["tether"]["prompt_token_ids"] == server.tok.apply_chat_template(
            HELLO, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert text(tok, c["tether"]["prompt_token_ids"]).startswith("add")
    finally:
        server.tok.chat_template = original


# A Qwen2.5-style (hermes) template: ChatML turns, an assistant's tool calls written as <tool_call>
# blocks with their arguments through `| tojson` (an object, as HF templates expect them).
HERMES = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
          "{% for tc in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", "
          "\"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ADD = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.fixture
def hermes(lm):
    """The lm server with the hermes template (its tool-call format, read from the template)."""
    server = lm[2].app.state.server
    original = server.tok.chat_template
    server.tok.chat_template = HERMES
    yield server
    server.tok.chat_template = original


def reply(server, text, **body):
    from tether.serve import parse_request

    return server.message(parse_request({"messages": HELLO, **body}, 8), text)


def test_tool_calls_are_parsed_in_the_templates_format(hermes):
    one = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    m = reply(hermes, one, tools=ADD)
    [call] = m["tool_calls"]
    assert m["content"] == "Sure." and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    two = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>\n'
           '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call>')
    m = reply(hermes, two, tools=ADD)
    assert m["content"] is None and len(m["tool_calls"]) == 2 and m["tool_calls"][0]["id"] != m["tool_calls"][1]["id"]
    assert [json.loads(c["function"]["arguments"]) for c in m["tool_calls"]] == [{"a": 1, "b": 1}] * 2
    # a malformed block stays in the content as written, beside one that reads
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'
    m = reply(hermes, bad, tools=ADD)
    assert m == {"role": "assistant", "content": bad}
    m = reply(hermes, bad + "\n" + one, tools=ADD)
    assert m["content"] == bad + "\nSure." and [c["function"]["name"] for c in m["tool_calls"]] == ["add"]
    # without tools in the request nothing is parsed
    assert reply(hermes, one) == {"role": "assistant", "content": one}
    # the tiny model's own template has no hermes markers: the plain format, positional arguments
    # named by the tool's parameters in order
    hermes.tok.chat_template = CHAT_TEMPLATE
    m = reply(hermes, "ok\nCALL add(2, b=3)\n" + one, tools=ADD)
    assert m["content"] == "ok\n\n" + one and len(m["tool_calls"]) == 1
    assert json.loads(m["tool_calls"][0]["function"]["arguments"]) == {"a": 2, "b": 3}
    assert reply(hermes, "CALL add(1, 2, 3)", tools=ADD)["content"] == "CALL add(1, 2, 3)"  # a third: unnamed


def test_a_reply_with_tools_ends_in_one_chunk_of_the_message(lm):
    _, _, client, _ = lm
    whole = post(client, messages=HELLO, tools=ADD, temperature=0)["choices"][0]
    assert whole["finish_reason"] == "stop" and "tool_calls" not in whole["message"]
    chunks = [c for ch in stream(client, messages=HELLO, tools=ADD, temperature=0) for c in ch["choices"]]
    assert [c["delta"] for c in chunks] == [{"role": "assistant", "content": ""},
                                            {"content": whole["message"]["content"]}]
    assert chunks[-1]["finish_reason"] == "stop" and chunks[-1]["tether"] == whole["tether"]


def test_a_follow_up_with_tool_calls_and_a_tool_result_renders(hermes, lm):
    client, tok = lm[2], hermes.tok
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    messages = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    c = post(client, messages=messages, tools=ADD, max_tokens=1)["choices"][0]
    as_dicts = [messages[0], {**messages[1], "content": "", "tool_calls": [
        {**call, "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}, messages[2]]
    want = rendered(tok, as_dicts)
    assert c["tether"]["prompt_token_ids"] == want
    assert '"arguments": {"a": 2, "b": 3}}' in text(tok, want)  # an object, not a quoted string
    r = client.post("/v1/chat/completions", json={"messages": [messages[0], {**messages[1], "tool_calls": [
        {**call, "function": {"name": "add", "arguments": "{a: 2}"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


@needs("openai")
def test_the_openai_client_reads_the_responses(lm):  # pragma: no cover - runs where openai is installed
    import openai

    _, _, client, _ = lm
    oa = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    r = oa.chat.completions.create(model="tiny", messages=HELLO, temperature=0, logprobs=True)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].logprobs.content
    assert "".join(ch.choices[0].delta.content or "" for ch in oa.chat.completions.create(
        model="tiny", messages=HELLO, temperature=0, stream=True) if ch.choices) == r.choices[0].message.content


def test_the_command_loads_without_fastapi():
    """`tether --help` imports every command's module: serve.py imports fastapi only in make_app."""
    import subprocess
    import sys

    code = ("import sys; from tether.cli import load_command; cfg, fn = load_command('serve'); "
            "print(cfg.__name__, fn.__name__, 'fastapi' in sys.modules, 'uvicorn' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ServeConfig", "run_serve", "False", "False"]
