"""Formats: detection, expected-format checks, validation errors (one line: file, row, field),
implicit-prompt extraction (HH-RLHF) and load_data."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tether.data import (DataError, check_format, detect_format, detect_style, extract_shared_messages,
                         extract_shared_prompt, hh_to_messages, load_data, load_rows, prepare, validate)

try:
    from tests.test_data_utils import FIXTURES, assert_one_line, write_jsonl
except ImportError:
    from test_data_utils import FIXTURES, assert_one_line, write_jsonl

U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "hello"}
B = {"role": "assistant", "content": "go away"}

# format -> (standard row, conversational row)
EXAMPLES = {
    "language-modeling": ({"text": "some text"}, {"messages": [U, A]}),
    "prompt-only": ({"prompt": "2+2=", "answer": "4"}, {"prompt": [U], "answer": "4"}),
    "prompt-completion": ({"prompt": "2+2=", "completion": " 4"}, {"prompt": [U], "completion": [A]}),
    "preference": ({"prompt": "p", "chosen": " good", "rejected": " bad"},
                   {"prompt": [U], "chosen": [A], "rejected": [B]}),
    "implicit-preference": ({"chosen": "Q: p A: good", "rejected": "Q: p A: bad"},
                            {"chosen": [U, A], "rejected": [U, B]}),
    "unpaired-preference": ({"prompt": "p", "completion": " c", "label": True},
                            {"prompt": [U], "completion": [A], "label": False}),
    "stepwise": ({"prompt": "p", "completions": ["s1", "s2"], "labels": [True, False]}, None),
}


@pytest.mark.parametrize("fmt", list(EXAMPLES))
@pytest.mark.parametrize("style", ["standard", "conversational"])
def test_detect_and_validate_every_format(fmt, style):
    row = EXAMPLES[fmt][style == "conversational"]
    if row is None:
        pytest.skip("stepwise data is standard only")
    assert detect_format(row) == fmt
    assert detect_style(row, fmt) == style
    validate([row, row], fmt, source="mem.jsonl")
    validate([row], None, source="mem.jsonl")


def test_detect_format_unknown_columns_is_one_line():
    with pytest.raises(DataError) as e:
        detect_format(["question", "answer"], source="g.jsonl")
    assert_one_line(e.value, "g.jsonl: cannot tell the data format from columns question, answer",
                    "prompt, completion (prompt-completion)")


def test_expected_format_mismatch_message():
    with pytest.raises(DataError) as e:
        check_format(["text"], "prompt-completion", "data/x.jsonl")
    assert str(e.value) == "data/x.jsonl: expected columns prompt, completion for prompt-completion data; found text"
    with pytest.raises(DataError) as e:  # SFT must not silently train on KTO's unpaired rows
        check_format(["prompt", "completion", "label"], ("language-modeling", "prompt-completion"), "k.jsonl")
    assert_one_line(e.value, "expected columns messages or text for language-modeling data, or prompt, "
                    "completion for prompt-completion data; found prompt, completion, label")
    # prompt-only accepts any data with a prompt; preference accepts implicit-prompt pairs
    assert check_format(["prompt", "chosen", "rejected"], "prompt-only") == "prompt-only"
    assert check_format(["chosen", "rejected"], "preference") == "implicit-preference"
    assert check_format(["prompt", "completion"], ("language-modeling", "prompt-completion")) == "prompt-completion"


BAD = [  # (format, rows, row number, field, message part)
    ("prompt-completion", [{"prompt": "a", "completion": "b"}, {"prompt": "a"}], 2, "completion", "missing column"),
    ("prompt-completion", [{"prompt": "a", "completion": 42}], 1, "completion", "expected a string, got int 42"),
    ("prompt-completion", [{"prompt": "a", "completion": None}], 1, "completion", "is null"),
    ("prompt-completion", [{"prompt": "", "completion": "b"}], 1, "prompt", "empty string"),
    ("language-modeling", [{"text": "x"}, {"text": ""}], 2, "text", "empty string"),
    ("unpaired-preference", [{"prompt": "p", "completion": "c", "label": 1}], 1, "label",
     "expected a bool (true/false), got int 1"),
    ("unpaired-preference", [{"prompt": "p", "completion": "c", "label": "true"}], 1, "label", "got str"),
    ("language-modeling", [{"messages": "hi"}], 1, "messages", "expected a list of {role, content} messages"),
    ("language-modeling", [{"messages": [U, {"role": "bot", "content": "x"}]}], 1, "messages[1].role",
     "role 'bot' is not one of system, user, assistant, tool"),
    ("language-modeling", [{"messages": [{"role": "user"}]}], 1, "messages[0]", "no 'content' key"),
    ("language-modeling", [{"messages": [U, {"role": "assistant", "content": 3}]}], 1, "messages[1].content",
     "expected a string, got int"),
    ("language-modeling", [{"messages": [{"role": "user", "content": ""}, A]}], 1, "messages[0].content",
     "empty string in a user message"),
    ("language-modeling", [{"messages": []}], 1, "messages", "empty list of messages"),
    ("prompt-completion", [{"prompt": [U], "completion": "plain"}], 1, "completion",
     "this dataset is conversational"),
    ("prompt-completion", [{"prompt": "a", "completion": "b"}, {"prompt": [U], "completion": [A]}], 2, "prompt",
     "this dataset is standard"),
    ("prompt-completion", [{"prompt": [U], "completion": [U]}], 1, "completion", "no assistant message"),
    ("preference", [{"prompt": "p", "chosen": "c", "rejected": ["r"]}], 1, "rejected",
     "expected a string, got list ['r']"),
    ("preference", [{"prompt": "p", "chosen": "c", "rejected": [B]}], 1, "rejected", "this dataset is standard"),
    ("stepwise", [{"prompt": "p", "completions": ["a", ""], "labels": [True, True]}], 1, "completions[1]",
     "empty string"),
    ("stepwise", [{"prompt": "p", "completions": ["a", "b"], "labels": [True, 0]}], 1, "labels[1]", "bool"),
    ("stepwise", [{"prompt": "p", "completions": ["a", "b"], "labels": [True]}], 1, "labels",
     "1 labels for 2 completions"),
]


@pytest.mark.parametrize("fmt, rows, row, field, what", BAD)
def test_validation_errors_name_file_row_field(tmp_path, fmt, rows, row, field, what):
    p = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError) as e:
        load_data(str(p), expect=fmt)
    assert_one_line(e.value, f"{p}:{row}:{field}: ", what)
    assert (e.value.source, e.value.row, e.value.field) == (str(p), row, field)


def test_row_numbers_are_file_lines(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a"}\n\n{"text": "b"}\n{"text": 7}\n', encoding="utf-8")
    with pytest.raises(DataError) as e:
        load_data(str(p))
    assert str(e.value).startswith(f"{p}:4:text: expected a string, got int 7")


def test_empty_dataset(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text("\n", encoding="utf-8")
    with pytest.raises(DataError) as e:
        load_data(str(p), expect="prompt-completion")
    assert str(e.value) == f"{p}: dataset is empty (0 rows)"
    with pytest.raises(DataError) as e:
        validate([], "language-modeling", source="mem")
    assert str(e.value) == "mem: dataset is empty (0 rows)"
    with pytest.raises(DataError):
        load_data(str(p), streaming=True)


def test_long_values_are_shortened_in_messages():
    with pytest.raises(DataError) as e:
        validate([{"prompt": "p", "completion": ["line1\nline2" * 50]}], "prompt-completion", "m")
    assert_one_line(e.value, "m:1:completion:")
    assert len(str(e.value)) < 200


def test_tool_calls_and_content_parts_are_accepted():
    msgs = [{"role": "system", "content": "s"}, U,
            {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": {}}]},
            {"role": "tool", "content": "42"}, {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
            {"role": "assistant", "content": ""}]
    validate([{"messages": msgs}], "language-modeling", "m")


def test_extract_shared_prompt_hh_and_generic():
    c = "\n\nHuman: hi\n\nAssistant: Hello!\n\nHuman: joke?\n\nAssistant: Sure: knock knock"
    r = "\n\nHuman: hi\n\nAssistant: Hello!\n\nHuman: joke?\n\nAssistant: No."
    p, cc, rc = extract_shared_prompt(c, r)
    assert p == "\n\nHuman: hi\n\nAssistant: Hello!\n\nHuman: joke?\n\nAssistant:"
    assert (cc, rc) == (" Sure: knock knock", " No.")
    # responses that start alike still split at the last shared marker, not mid-response
    assert extract_shared_prompt("\n\nHuman: q\n\nAssistant: Yes a", "\n\nHuman: q\n\nAssistant: Yes b")[1] == " Yes a"
    assert extract_shared_prompt("The answer is 52", "The answer is 57") == ("The answer is", " 52", " 57")
    with pytest.raises(ValueError):
        extract_shared_prompt("abc", "xyz")
    assert extract_shared_messages([U, A], [U, B]) == ([U], [A], [B])
    with pytest.raises(ValueError):
        extract_shared_messages([A], [B])


def test_hh_fixture_extraction_every_row():
    raw = load_rows(str(FIXTURES / "hh_rlhf_excerpt.jsonl"))
    rows = load_data(str(FIXTURES / "hh_rlhf_excerpt.jsonl"), expect="preference")
    assert rows.format == "preference" and len(rows) == len(raw) == 20
    for r, o in zip(rows, raw):
        assert r["prompt"].endswith("\n\nAssistant:") and r["prompt"].startswith("\n\nHuman:")
        assert r["prompt"] + r["chosen"] == o["chosen"] and r["prompt"] + r["rejected"] == o["rejected"]
        assert r["chosen"] != r["rejected"]
    first = rows[0]
    assert first["prompt"].count("\n\nAssistant:") == 3
    assert first["chosen"].startswith(" No, sorry!")


def test_hh_fixture_conversational():
    rows = load_data(str(FIXTURES / "hh_rlhf_excerpt.jsonl"), expect="preference", conversational=True)
    assert detect_style(rows[0], "preference") == "conversational"
    p = rows[0]["prompt"]
    assert [m["role"] for m in p] == ["user", "assistant", "user", "assistant", "user"]
    assert p[0]["content"] == "what are some pranks with a pen i can do?"
    assert rows[0]["chosen"][0]["content"].startswith("No, sorry!")
    assert hh_to_messages("\n\nHuman: a \n\nAssistant: b") == [{"role": "user", "content": "a"},
                                                                 {"role": "assistant", "content": "b"}]


def test_gsm8k_fixture_with_rename():
    rows = load_data(str(FIXTURES / "gsm8k_excerpt.jsonl"), expect="prompt-only", rename={"question": "prompt"})
    assert rows.format == "prompt-only" and set(rows[0]) == {"prompt", "answer"}
    assert "#### 72" in rows[0]["answer"]
    with pytest.raises(DataError) as e:
        load_data(str(FIXTURES / "gsm8k_excerpt.jsonl"), expect="prompt-only")
    assert_one_line(e.value, "gsm8k_excerpt.jsonl: expected columns prompt for prompt-only data; "
                    "found question, answer")


def test_streaming_validation_is_lazy_but_prechecked(tmp_path):
    good = [{"prompt": "p", "completion": "c"}] * 3
    p = write_jsonl(tmp_path / "s.jsonl", good + [{"prompt": "p", "completion": ""}])
    with pytest.raises(DataError) as e:  # within the up-front window
        load_data(str(p), streaming=True)
    assert_one_line(e.value, f"{p}:4:completion: empty string")
    import tether.data.pipeline as prep
    old, prep.STREAM_PRECHECK_ROWS = prep.STREAM_PRECHECK_ROWS, 2
    try:
        rows = load_data(str(p), streaming=True)  # bad row beyond the window: found when read
        assert rows.format == "prompt-completion"
        with pytest.raises(DataError) as e:
            list(rows)
        assert_one_line(e.value, f"{p}:4:completion: empty string")
    finally:
        prep.STREAM_PRECHECK_ROWS = old


def test_prepare_accepts_in_memory_rows():
    rows = prepare([{"chosen": "Q: p A: good", "rejected": "Q: p A: bad"}], "preference", source="mem")
    assert rows[0] == {"prompt": "Q: p A:", "chosen": " good", "rejected": " bad"}
    with pytest.raises(DataError) as e:
        prepare([{"chosen": "abc", "rejected": "xyz"}], "preference", source="mem")
    assert_one_line(e.value, "mem:1:chosen: cannot extract the shared prompt")


HH_REAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"


@pytest.mark.slow
@pytest.mark.skipif(not HH_REAL.exists(), reason="needs ../shared/data (not in a fresh clone)")
def test_hh_real_file_every_row():
    rows = load_data(str(HH_REAL), expect="preference")
    with gzip.open(HH_REAL, "rt", encoding="utf-8") as f:
        raw = [json.loads(line) for line in f]
    assert len(rows) == len(raw) == 2312
    for r, o in zip(rows, raw):
        assert r["prompt"].endswith("\n\nAssistant:")
        assert r["prompt"] + r["chosen"] == o["chosen"] and r["prompt"] + r["rejected"] == o["rejected"]
    assert len(load_data(str(HH_REAL), expect="preference", conversational=True)) == 2312
