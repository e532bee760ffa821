"""Environment messages as token ids: observation_ids is exactly the delta the chat template adds
after an assistant turn's stop token, end_of_turn_ids splits the template's end of turn into the
model's stop ids and the environment's, and templates that re-render earlier turns are refused.

The canonical tokenizer here is a byte-level BPE with merges (trained in milliseconds on a few
conversations), so a delta that tokenized differently alone than in place would show."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tether.data.chat import ChatTemplateError, encode_text, render
from tether.envs import (Episode, ObservationTemplateError, end_of_turn_ids, observation_ids, prompt_ids,
                         template_renders_tools)
from tether.models.tiny import char_tokenizer

# Qwen2.5-like: a tools header in the system turn, consecutive tool messages grouped into one user
# turn of <tool_response> blocks, "\n" after every <|im_end|>.
QWEN = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\n<tools>{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object within <tool_call></tool_call> tags.<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"  # after a block tag: trim_blocks
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Gemma-3-like: BOS, 'model' for the assistant, no tool role and no tools, a system message folded
# into the first user turn, user and model turns must alternate.
GEMMA = (
    "{{ bos_token }}{%- if messages[0].role == 'system' %}"
    "{%- set prefix = messages[0].content + '\n\n' %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set prefix = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- for m in turns %}"
    "{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ prefix if loop.first else '' }}"
    "{{ m.content | trim }}<end_of_turn>\n"
    "{% endfor %}{%- if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

# A thinking template: the reasoning of an assistant turn is dropped once a later user message
# follows it (the last user message decides which turns keep their <think> block).
THINKING = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.index0 > ns.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<bos>", "<start_of_turn>", "<end_of_turn>"]

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "First."},
                                                    "b": {"type": "integer", "description": "Second."}},
                   "required": ["a", "b"]}}}]

CONV = [{"role": "user", "content": "What is 12 + 30, then times 2?"},
        {"role": "assistant",
         "content": 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>'},
        {"role": "tool", "name": "add", "content": "42"},
        {"role": "assistant", "content": "<tool_call>\n{\"name\": \"mul\", \"arguments\": {\"a\": 42}}\n</tool_call>"
                                         "\n<tool_call>\n{\"name\": \"add\", \"arguments\": "
                                         "{\"a\": 1, \"b\": 1}}\n</tool_call>"},
        {"role": "tool", "name": "mul", "content": "error: tool 'mul' is missing argument 'b'"},
        {"role": "tool", "name": "add", "content": "2"},
        {"role": "assistant", "content": "It is 84.\n#### 84"}]


def bpe_tokenizer(template: str, metaspace: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 / Qwen pre-tokenization) with real merges, trained on the
    conversations these tests render; `metaspace`: SentencePiece-style instead, a '▁' for every
    space and one prepended to the start of a text."""
    tok = Tokenizer(models.BPE(unk_token=None))
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    corpus = [json.dumps(TOOLS), json.dumps(CONV)] + [m["content"] for m in CONV] * 3 + [
        "<tool_response>\n42\n</tool_response>\n", "assistant\nuser\nsystem\ntool\nmodel\n",
        "```tool_output\n42\n```\n```tool_code\nadd(a=1, b=2)\n```"]
    alphabet = sorted(set("".join(corpus)) | set("▁")) if metaspace else pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = template
    return fast


QWEN_TOK = bpe_tokenizer(QWEN)


def ids(tok, text):
    return encode_text(tok, text)


def test_the_canonical_tokenizer_has_merges():
    # the delta check below would be vacuous on a one-token-per-character tokenizer
    text = render(QWEN_TOK, CONV, tools=TOOLS)
    assert len(ids(QWEN_TOK, text)) < 0.6 * len(text.encode())


def test_end_of_turn_splits_stop_token_from_what_follows():
    eot = end_of_turn_ids(QWEN_TOK)
    im_end, nl = QWEN_TOK.convert_tokens_to_ids("<|im_end|>"), ids(QWEN_TOK, "\n")
    assert eot.text == "<|im_end|>\n"
    assert eot.stop == [im_end] and eot.after == nl and eot.after_text == "\n" and eot.ids == [im_end] + nl
    gem = bpe_tokenizer(GEMMA)
    eot = end_of_turn_ids(gem)
    assert eot.text == "<end_of_turn>\n" and eot.stop == [gem.convert_tokens_to_ids("<end_of_turn>")]
    # a template whose assistant turn ends in no special token leaves the model nothing to stop on
    plain = bpe_tokenizer("{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}")
    with pytest.raises(ChatTemplateError, match="holds no special token"):
        end_of_turn_ids(plain)


@pytest.mark.parametrize("with_tools", [True, False])
def test_prefix_plus_assistant_plus_observation_ids_is_the_full_render(with_tools):
    """Walk CONV as the episode loop does: prompt ids, then per assistant turn its content + stop
    ids (the model's), then the observation ids (the environment's); the concatenation must be
    the tokenization of the whole conversation rendered at once."""
    tok, tools = QWEN_TOK, (TOOLS if with_tools else None)
    eot = end_of_turn_ids(tok, tools)
    seq = prompt_ids(tok, CONV[:1], tools)
    mask = [0] * len(seq)
    i = 1
    while i < len(CONV):
        assistant = ids(tok, CONV[i]["content"]) + eot.stop       # what the sampler generated
        seq, mask = seq + assistant, mask + [1] * len(assistant)
        j = i + 1
        while j < len(CONV) and CONV[j]["role"] != "assistant":
            j += 1
        if j == len(CONV):
            break
        obs = observation_ids(tok, CONV[i + 1:j], tools)
        assert obs[:len(eot.after)] == eot.after                  # the "\n" after <|im_end|> comes first
        # the observation's own rendering, then the next generation prompt
        assert tok.decode(obs).endswith("<|im_end|>\n<|im_start|>assistant\n")
        seq, mask = seq + obs, mask + [0] * len(obs)
        i = j
    full = render(tok, CONV, tools=tools)
    assert full.endswith("<|im_end|>\n")
    assert seq + eot.after == ids(tok, full)
    # mask 1 exactly on the assistants' contents and their <|im_end|>
    trained = tok.decode([t for t, m in zip(seq, mask) if m])
    assert trained == "".join(m["content"] + "<|im_end|>" for m in CONV if m["role"] == "assistant")


def test_observation_delta_of_two_tool_messages_is_one_grouped_user_turn():
    obs = observation_ids(QWEN_TOK, CONV[4:6], TOOLS)
    assert QWEN_TOK.decode(obs) == ("\n<|im_start|>user\n<tool_response>\nerror: tool 'mul' is missing argument 'b'\n"
                                    "</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
                                    "<|im_start|>assistant\n")


def test_context_checks_against_the_real_conversation():
    obs = observation_ids(QWEN_TOK, CONV[2:3], TOOLS, context=CONV[:2])
    assert obs == observation_ids(QWEN_TOK, CONV[2:3], TOOLS)
    with pytest.raises(ValueError, match="must end with an assistant message"):
        observation_ids(QWEN_TOK, CONV[2:3], TOOLS, context=CONV[:1])


class _Adder:
    def reset(self, **row):
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        return a + b


def test_gemma_episode_tool_code_in_tool_output_out_and_the_delta_is_exact():
    tok = bpe_tokenizer(GEMMA)
    ep = Episode(_Adder(), tok)
    assert ep.format.name == "gemma" and ep.tools == []            # the template renders no tools
    start = ep.start({"prompt": "Add 2 and 3."})
    assert [m["role"] for m in start] == ["system", "user"]        # the tools, described as Python
    assert "add(a: integer, b: integer)" in start[0]["content"] and "```tool_code" in start[0]["content"]
    assert "<start_of_turn>user\nYou can call these Python functions" in render(tok, start)  # folded in
    text = "```tool_code\nadd(a=2, b=3)\n```"
    turn = ep.respond(text)
    assert turn.messages == [{"role": "user", "content": "```tool_output\n5\n```"}]
    obs = observation_ids(tok, turn.messages, ep.tools)
    assert tok.decode(obs) == "\n<start_of_turn>user\n```tool_output\n5\n```<end_of_turn>\n<start_of_turn>model\n"
    conv = start + [{"role": "assistant", "content": text}] + turn.messages
    eot = end_of_turn_ids(tok)
    assert prompt_ids(tok, start) + ids(tok, text) + eot.stop + obs == prompt_ids(tok, conv)


def test_a_template_that_re_renders_earlier_turns_is_refused():
    tok = bpe_tokenizer(THINKING)
    # a tool message leaves the last user message where it was: fine
    assert tok.decode(observation_ids(tok, [{"role": "tool", "content": "5"}])).startswith("\n<|im_start|>tool\n5")
    # a user message moves it: the earlier assistant turn loses its <think> block
    with pytest.raises(ObservationTemplateError, match="renders the earlier turns differently"):
        observation_ids(tok, [{"role": "user", "content": "Higher."}])


def test_a_prefix_space_tokenizer_gets_the_in_place_ids():
    # SentencePiece-style: a space marker is prepended to the start of a text (Llama 2, Mistral).
    # Tokenized alone, the delta would start with that marker; in place it does not.
    tok = bpe_tokenizer(QWEN, metaspace=True)
    obs = observation_ids(tok, CONV[2:3], TOOLS)
    delta_text = tok.decode(obs)
    assert ids(tok, delta_text) != obs                           # alone: an extra prefix marker
    eot = end_of_turn_ids(tok, TOOLS)
    through_stop = render(tok, CONV[:2], tools=TOOLS)[:-len(eot.after_text)]
    assert through_stop.endswith("<|im_end|>")
    assert ids(tok, through_stop) + obs == prompt_ids(tok, CONV[:3], TOOLS)


def test_templates_with_and_without_tools():
    assert template_renders_tools(QWEN_TOK)
    assert not template_renders_tools(bpe_tokenizer(GEMMA))
    assert not template_renders_tools(char_tokenizer())


def test_char_tokenizer_episode_puts_tools_in_a_system_message():
    tok = char_tokenizer()  # tether's tiny model tokenizer: '<|role|>content<|end|>', no tools support
    ep = Episode(_Adder(), tok)
    assert ep.format.name == "plain" and ep.tools == []
    assert [t["function"]["name"] for t in ep.tool_schemas] == ["add"]
    start = ep.start({"prompt": "Add 2 and 3."})
    assert [m["role"] for m in start] == ["system", "user"] and "CALL tool_name(" in start[0]["content"]
    turn = ep.respond("CALL add(a=2, b=3)")
    assert turn.messages == [{"role": "user", "content": "RESULT add: 5"}]
    eot = end_of_turn_ids(tok)
    assert tok.decode(eot.stop) == "<|end|>" and eot.after == []
    obs = observation_ids(tok, turn.messages)
    assert tok.decode(obs) == "<|user|>RESULT add: 5<|end|><|assistant|>"
    conv = start + [{"role": "assistant", "content": "CALL add(a=2, b=3)"}] + turn.messages
    assert prompt_ids(tok, start) + ids(tok, "CALL add(a=2, b=3)") + eot.stop + obs == prompt_ids(tok, conv)


def test_the_template_describes_tools_only_in_its_own_format():
    ep = Episode(_Adder(), QWEN_TOK)
    assert ep.format.name == "hermes" and [t["function"]["name"] for t in ep.tools] == ["add"]
    start = ep.start({"prompt": "Add 2 and 3."})
    assert start == [{"role": "user", "content": "Add 2 and 3."}]
    header = '<|im_start|>system\n# Tools\n\n<tools>\n{"type": "function", "function": {"name": "add"'
    assert render(QWEN_TOK, start, tools=ep.tools).startswith(header)
    ep = Episode(_Adder(), QWEN_TOK, tool_format="plain")  # Qwen's <tool_call> instructions would contradict it
    assert ep.tools == []
    start = ep.start({"prompt": "Add 2 and 3."})
    assert start[0]["role"] == "system" and "CALL tool_name(argument=value, ...)" in start[0]["content"]
