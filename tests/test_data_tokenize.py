"""Tokenization: loss masks sit exactly on completion / assistant tokens; BOS/EOS conventions;
truncation and dropping are counted, reported and logged with file:row."""

from __future__ import annotations

import logging

import pytest

from tether.data import (DataError, encode_lm, encode_preference, encode_prompt_completion, encode_prompts,
                         encode_sft, encode_stepwise, encode_unpaired, load_data, pad_preference_batch)

try:
    from tests.test_data_utils import CHATML, FIXTURES, ZEPHYR, assert_one_line, make_tokenizer, masked_text, write_jsonl
except ImportError:
    from test_data_utils import CHATML, FIXTURES, ZEPHYR, assert_one_line, make_tokenizer, masked_text, write_jsonl

TOK = make_tokenizer()
S = {"role": "system", "content": "Be nice."}
U1 = {"role": "user", "content": "Hi there"}
A1 = {"role": "assistant", "content": "Hello! How can I help?"}
U2 = {"role": "user", "content": "2+2?"}
A2 = {"role": "assistant", "content": "4"}


def test_lm_text_bos_eos_and_mask():
    ex = encode_lm({"text": "abc"}, TOK)
    assert TOK.decode(ex["input_ids"]) == "<s>abc</s>"
    assert ex["completion_mask"] == [0, 1, 1, 1, 1]  # everything but BOS is a target
    # no double BOS / EOS when the text already carries them
    assert encode_lm({"text": "<s>abc</s>"}, TOK)["input_ids"] == ex["input_ids"]
    no_bos = make_tokenizer(bos=False)
    ex = encode_lm({"text": "abc"}, no_bos)
    assert no_bos.decode(ex["input_ids"]) == "abc</s>" and ex["completion_mask"] == [1, 1, 1, 1]


def test_prompt_completion_mask_is_exactly_completion_plus_eos():
    rows = [{"prompt": "Q: what is 2+2?\nA:", "completion": " 4, of course."}]
    (ex,), report = encode_sft(rows, TOK)
    assert masked_text(TOK, ex) == " 4, of course." + TOK.eos_token
    assert TOK.decode(ex["input_ids"]) == "<s>Q: what is 2+2?\nA: 4, of course.</s>"
    assert len(ex["input_ids"]) == len(ex["completion_mask"]) and set(ex) == {"input_ids", "completion_mask"}
    assert (report.total, report.kept, report.truncated, report.dropped) == (1, 1, 0, 0)
    full = encode_prompt_completion(rows[0], TOK, completion_only_loss=False)
    assert full["completion_mask"] == [0] + [1] * (len(full["input_ids"]) - 1)


@pytest.mark.parametrize("template, end", [(CHATML, "<|im_end|>"), (ZEPHYR, "</s>")])
def test_conversational_masks_cover_only_assistant_content(template, end):
    tok = make_tokenizer(template)
    (ex,), _ = encode_sft([{"messages": [S, U1, A1, U2, A2]}], tok)
    assert masked_text(tok, ex) == A1["content"] + end + A2["content"] + end
    # every masked run is exactly one assistant turn: content + end-of-turn, nothing else
    runs, cur = [], []
    for t, m in zip(ex["input_ids"], ex["completion_mask"]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    assert runs == [A1["content"] + end, A2["content"] + end]
    assert tok.decode(ex["input_ids"]) == tok.apply_chat_template([S, U1, A1, U2, A2], tokenize=False)


def test_conversational_prompt_completion_masks_only_the_completion():
    (ex,), _ = encode_sft([{"prompt": [U1, A1, U2], "completion": [A2]}], TOK)
    assert masked_text(TOK, ex) == "4<|im_end|>"  # A1 is context here, not a target
    (ex,), _ = encode_sft([{"prompt": [U1, A1, U2], "completion": [A2]}], TOK, completion_only_loss=False)
    assert sum(ex["completion_mask"]) == len(ex["input_ids"]) - 1


def test_messages_without_assistant_are_dropped_and_counted(caplog):
    rows = [{"messages": [U1, A1]}, {"messages": [S, U1]}]
    with caplog.at_level(logging.WARNING, logger="tether.data"):
        examples, report = encode_sft(rows, TOK, source="chats.jsonl")
    assert len(examples) == 1 and report.dropped == 1 and report.dropped_rows == [2]
    assert report.drop_reasons == {"nothing to train on": 1}
    assert any("chats.jsonl:2: dropped" in r.getMessage() for r in caplog.records)


def test_truncate_vs_drop_with_counts(tmp_path, caplog):
    rows = [{"prompt": "P" * 4, "completion": "c" * 3},      # 1 + 4 + 3 + 1 = 9 tokens: fits
            {"prompt": "P" * 4, "completion": "c" * 10},     # 16 tokens: completion cut
            {"prompt": "P" * 12, "completion": "c"},         # prompt alone 13 >= 12: dropped
            {"prompt": "P" * 2, "completion": "c" * 20}]     # completion cut
    p = write_jsonl(tmp_path / "long.jsonl", rows)
    data = load_data(str(p), expect="prompt-completion")
    with caplog.at_level(logging.WARNING, logger="tether.data"):
        examples, report = encode_sft(data, TOK, max_length=12, truncation="truncate")
    assert (report.total, report.kept, report.truncated, report.dropped) == (4, 3, 2, 1)
    assert report.truncated_rows == [2, 4] and report.dropped_rows == [3]
    assert report.kept_index == [0, 1, 3]  # examples[j] came from data[kept_index[j]]
    assert report.drop_reasons == {"prompt too long": 1}
    assert all(len(e["input_ids"]) <= 12 for e in examples)
    assert masked_text(TOK, examples[1]) == "c" * 7  # cut at the end: no EOS, it did not stop
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"{p}:2: truncated") for m in messages)
    assert any(m.startswith(f"{p}:3: dropped: prompt alone is 13 tokens") for m in messages)
    assert all("\n" not in m for m in messages)
    assert report.summary() == (f"{p}: 4 rows, 3 kept, 2 truncated (rows 2, 4), 1 dropped "
                                "(prompt too long: 1; rows 3) at max_length=12")

    examples, report = encode_sft(data, TOK, max_length=12, truncation="drop")
    assert (report.kept, report.truncated, report.dropped) == (1, 0, 3)
    assert report.dropped_rows == [2, 3, 4] and report.drop_reasons == {"too long": 3}


def test_lm_and_messages_truncation():
    (ex,), rep = encode_sft([{"text": "x" * 50}], TOK, max_length=10)
    assert len(ex["input_ids"]) == 10 and rep.truncated == 1
    long_first = {"messages": [{"role": "user", "content": "u" * 40}, A2]}
    with pytest.raises(DataError) as e:  # the only row loses its assistant turn: nothing left
        encode_sft([long_first], TOK, max_length=20, source="c.jsonl")
    assert_one_line(e.value, "c.jsonl: no rows left after tokenizing SFT data", "nothing to train on")


def test_bad_rows_fail_in_encoders_too():
    with pytest.raises(DataError) as e:
        encode_sft([{"prompt": "p", "completion": 3}], TOK, source="x.jsonl")
    assert_one_line(e.value, "x.jsonl:1:completion: expected a string")
    with pytest.raises(DataError) as e:
        encode_sft([{"prompt": "p", "chosen": "a", "rejected": "b"}], TOK, source="x.jsonl")
    assert_one_line(e.value, "x.jsonl: expected columns")


def test_missing_chat_template_is_one_line():
    with pytest.raises(DataError) as e:
        encode_sft([{"messages": [U1, A1]}], make_tokenizer(template=None), source="c.jsonl")
    assert_one_line(e.value, "c.jsonl:1:messages: conversational data needs a chat template")
    bad = make_tokenizer(template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(DataError) as e:
        encode_sft([{"messages": [U1, A1]}], bad, source="c.jsonl")
    assert_one_line(e.value, "c.jsonl:1:messages: chat template failed", "roles must alternate")


def test_preference_standard_and_truncation():
    rows = [{"prompt": "Q?", "chosen": " yes", "rejected": " no way", "margin": 2.0}]
    (ex,), _ = encode_preference(rows, TOK)
    assert TOK.decode(ex["prompt_ids"]) == "<s>Q?"
    assert TOK.decode(ex["chosen_ids"]) == " yes</s>" and TOK.decode(ex["rejected_ids"]) == " no way</s>"
    assert ex["margin"] == 2.0  # extra columns pass through
    (ex,), rep = encode_preference(rows, TOK, max_length=6)
    assert TOK.decode(ex["rejected_ids"]) == " no" and TOK.decode(ex["chosen_ids"]) == " ye"
    assert rep.truncated == 1
    short = {"prompt": "Q?", "chosen": " y", "rejected": " n"}
    examples, rep = encode_preference(rows + [short], TOK, max_length=6, truncation="drop")
    assert len(examples) == 1 and rep.dropped_rows == [1] and rep.drop_reasons == {"too long": 1}
    long_prompt = [{"prompt": "a long question?", "chosen": " y", "rejected": " n"}]
    (ex,), rep = encode_preference(long_prompt, TOK, max_prompt_length=6)
    assert TOK.decode(ex["prompt_ids"]) == "<s>tion?" and rep.truncated_rows == [1]  # keeps BOS + the end


def test_preference_conversational_hh_fixture():
    rows = load_data(str(FIXTURES / "hh_rlhf_excerpt.jsonl"), expect="preference", conversational=True)
    examples, report = encode_preference(rows, TOK)
    assert report.kept == 20
    for ex, row in zip(examples, rows):
        full = TOK.apply_chat_template(row["prompt"] + row["chosen"], tokenize=False)
        assert TOK.decode(ex["prompt_ids"] + ex["chosen_ids"]) + "\n" == full  # "\n" after the last turn trimmed
        assert TOK.decode(ex["prompt_ids"]).endswith("<|im_start|>assistant\n")
        assert TOK.decode(ex["chosen_ids"]).endswith("<|im_end|>") and TOK.decode(ex["rejected_ids"]).endswith("<|im_end|>")
    batch = pad_preference_batch(examples[:4], TOK.pad_token_id)
    assert batch["input_ids"].shape[0] == 8
    assert batch["completion_mask"][0].sum().item() == len(examples[0]["chosen_ids"])
    assert batch["completion_mask"][4].sum().item() == len(examples[0]["rejected_ids"])


def test_hh_standard_fixture_sft_and_preference():
    rows = load_data(str(FIXTURES / "hh_rlhf_excerpt.jsonl"), expect="preference")
    examples, _ = encode_preference(rows, TOK, max_length=2000)
    ex, row = examples[0], rows[0]
    assert TOK.decode(ex["prompt_ids"]) == "<s>" + row["prompt"]
    assert TOK.decode(ex["chosen_ids"]) == row["chosen"] + "</s>"


def test_unpaired_and_prompts():
    (ex,), _ = encode_unpaired([{"prompt": [U2], "completion": [A2], "label": False}], TOK)
    assert TOK.decode(ex["completion_ids"]) == "4<|im_end|>" and ex["label"] is False
    rows = load_data(str(FIXTURES / "gsm8k_excerpt.jsonl"), expect="prompt-only", rename={"question": "prompt"})
    examples, rep = encode_prompts(rows, TOK)
    assert rep.kept == 20 and examples[0]["answer"] == rows[0]["answer"]
    assert TOK.decode(examples[0]["prompt_ids"]) == "<s>" + rows[0]["prompt"]  # no EOS on prompts
    (ex,), _ = encode_prompts([{"prompt": [U2], "answer": "4"}], TOK)
    assert TOK.decode(ex["prompt_ids"]).endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    (ex,), _ = encode_prompts([{"prompt": [U2, {"role": "assistant", "content": "The answer:"}]}], TOK)
    assert TOK.decode(ex["prompt_ids"]).endswith("assistant\nThe answer:")  # prefill continued
    examples, rep = encode_prompts([{"prompt": "x" * 30}, {"prompt": "y"}], TOK, max_prompt_length=5, truncation="drop")
    assert len(examples) == 1 and rep.dropped_rows == [1]


def test_stepwise_labels_sit_on_step_ends():
    (ex,), _ = encode_stepwise([{"prompt": "Q:", "completions": ["a", "bc"], "labels": [True, False]}], TOK)
    assert TOK.decode(ex["input_ids"]) == "<s>Q:a\nbc\n"
    labelled = [(TOK.decode([t]), lab) for t, lab in zip(ex["input_ids"], ex["step_labels"]) if lab != -100]
    assert labelled == [("\n", 1), ("\n", 0)]
    (ex,), rep = encode_stepwise([{"prompt": "Q:", "completions": ["a", "bcdef"], "labels": [True, True]}],
                                 TOK, max_length=6)
    assert TOK.decode(ex["input_ids"]) == "<s>Q:a\n" and rep.truncated == 1  # whole steps only
