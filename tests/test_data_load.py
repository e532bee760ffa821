"""Loading: every local source kind, row numbering, streaming, and one-line load errors."""

from __future__ import annotations

import csv
import gzip
import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tether.data import DataError, Rows, StreamingRows, load_rows
from tether.data.load import parse_split

try:
    from tests.test_data_utils import FIXTURES, assert_one_line, write_jsonl
except ImportError:  # tests/ is not a package
    from test_data_utils import FIXTURES, assert_one_line, write_jsonl

ROWS = [{"prompt": "2+2=", "completion": " 4"}, {"prompt": "é?", "completion": "ü"},
        {"prompt": "q", "completion": "a"}]


def test_jsonl_rows_and_line_numbers(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"text": "a"}\n\n   \n{"text": "b"}\n{"text": "c"}', encoding="utf-8")  # no final newline
    rows = load_rows(str(p))
    assert isinstance(rows, Rows) and rows.source == str(p)
    assert [r["text"] for r in rows] == ["a", "b", "c"]
    assert [rows.row_number(i) for i in range(3)] == [1, 4, 5]  # blank lines count
    assert rows.where(1) == f"{p}:4"
    assert rows.columns == ["text"]


def test_jsonl_gz_and_bom(tmp_path):
    p = tmp_path / "x.jsonl.gz"
    with gzip.open(p, "wb") as f:
        f.write(b'\xef\xbb\xbf{"text": "a"}\n{"text": "b"}\n')
    assert [r["text"] for r in load_rows(str(p))] == ["a", "b"]


def test_json_array_and_json_lines_named_json(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('[\n  {"text": "a"},\n  {"text":\n "b"}\n]\n', encoding="utf-8")
    rows = load_rows(str(p))
    assert [r["text"] for r in rows] == ["a", "b"]
    assert [rows.row_number(i) for i in range(2)] == [2, 3]  # line where each object starts
    q = tmp_path / "l.json"
    write_jsonl(q, ROWS)
    assert load_rows(str(q)).to_list() == ROWS
    e = tmp_path / "e.json"
    e.write_text("[]", encoding="utf-8")
    assert len(load_rows(str(e))) == 0


def test_parquet_round_trip(tmp_path):
    p = tmp_path / "x.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), p)
    rows = load_rows(str(p))
    assert rows.to_list() == ROWS and rows.row_number(2) == 3
    streamed = load_rows(str(p), streaming=True)
    assert isinstance(streamed, StreamingRows) and list(streamed) == ROWS


def test_csv_round_trip_types_and_line_numbers(tmp_path):
    p = tmp_path / "x.csv"
    with open(p, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "completion", "label", "answer"])
        w.writerow(["multi\nline", "yes", "true", "042"])
        w.writerow(["b", "no", "False", "7"])
        w.writerow([json.dumps([{"role": "user", "content": "hi"}]), "x", "0", "1"])
    rows = load_rows(str(p))
    assert rows[0] == {"prompt": "multi\nline", "completion": "yes", "label": True, "answer": "042"}
    assert rows[1]["label"] is False and rows[1]["answer"] == "7"  # other columns stay strings
    assert rows[2]["prompt"] == [{"role": "user", "content": "hi"}]  # JSON cells for conversations
    assert [rows.row_number(i) for i in range(3)] == [2, 4, 5]  # record start lines


def test_csv_wrong_field_count(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("text,other\na,b\nc\n", encoding="utf-8")
    with pytest.raises(DataError) as e:
        load_rows(str(p))
    assert_one_line(e.value, f"{p}:3:", "expected 2 fields")


def test_save_to_disk_dataset_and_dict(tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "single"))
    rows = load_rows(str(tmp_path / "single"))
    assert rows.to_list() == ROWS and rows.row_number(0) == 1
    dd = datasets.DatasetDict({"train": ds, "test": ds.select([0])})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert len(load_rows(str(tmp_path / "dict"))) == 3
    test = load_rows(str(tmp_path / "dict"), split="test")
    assert test.to_list() == ROWS[:1] and test.source.endswith("[test]")
    assert list(load_rows(str(tmp_path / "dict"), streaming=True)) == ROWS
    with pytest.raises(DataError) as e:
        load_rows(str(tmp_path / "dict"), split="validation")
    assert_one_line(e.value, "no split 'validation'", "available: train, test")


def test_directory_of_split_files(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "test.jsonl", ROWS[:1])
    assert len(load_rows(str(tmp_path))) == 3
    rows = load_rows(str(tmp_path), split="test")
    assert len(rows) == 1 and rows.where(0).endswith("test.jsonl:1")


def test_split_slices(tmp_path):
    p = write_jsonl(tmp_path / "x.jsonl", [{"text": str(i)} for i in range(10)])
    rows = load_rows(str(p), split="train[2:5]")
    assert [r["text"] for r in rows] == ["2", "3", "4"] and rows.row_number(0) == 3
    assert [r["text"] for r in load_rows(str(p), split="train[:2]", streaming=True)] == ["0", "1"]
    assert [r["text"] for r in load_rows(str(p), split="[-1:]")] == ["9"]
    assert parse_split("test") == ("test", None)
    with pytest.raises(DataError):
        load_rows(str(p), split="test")  # a single file has one split


def test_streaming_is_lazy_and_reiterable(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"text": "a"}\n{"text": "b"}\n{oops\n', encoding="utf-8")
    rows = load_rows(str(p), streaming=True)  # nothing read yet: no error
    it = rows.numbered()
    assert next(it) == (1, {"text": "a"})
    assert [r["text"] for r in rows.take(0, 2)] == ["a", "b"]  # a second, independent pass
    with pytest.raises(DataError) as e:
        list(it)
    assert_one_line(e.value, f"{p}:3:", "malformed JSON")
    assert [r["text"] for r in rows.take(0, 2).shard(1, 2)] == ["b"]


def test_invalid_utf8_jsonl_names_file_line_field(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"prompt": "ok", "completion": "fine"}\n{"prompt": "ok", "completion": "caf\xe9 \xff"}\n')
    with pytest.raises(DataError) as e:
        load_rows(str(p))
    msg = assert_one_line(e.value, f"{p}:2:completion:", "invalid UTF-8", "0xe9")
    assert f"byte offset {p.read_bytes().index(bytes([0xE9]))} " in msg


def test_invalid_utf8_in_nested_field_json_and_csv(tmp_path):
    p = tmp_path / "bad.json"
    p.write_bytes(b'[{"messages": [{"role": "user", "content": "hi"},\n'
                  b' {"role": "assistant", "content": "\xc3("}]}]')
    with pytest.raises(DataError) as e:
        load_rows(str(p))
    assert_one_line(e.value, f"{p}:2:messages[1].content:", "invalid UTF-8")
    c = tmp_path / "bad.csv"
    c.write_bytes(b"text,extra\nfine,x\nbro\x80ken,y\n")
    with pytest.raises(DataError) as e:
        load_rows(str(c))
    assert_one_line(e.value, f"{c}:3:text:", "invalid UTF-8")


@pytest.mark.parametrize("content, line, what", [
    ('{"text": "a"}\n{"text": "b",}\n', 2, "malformed JSON"),
    ('{"text": "a"}\n["not", "an", "object"]\n', 2, "expected a JSON object"),
    ('{"text": "a"\n', 1, "malformed JSON"),
])
def test_malformed_json_lines(tmp_path, content, line, what):
    p = tmp_path / "m.jsonl"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(DataError) as e:
        load_rows(str(p))
    assert_one_line(e.value, f"{p}:{line}:", what)


def test_malformed_json_array(tmp_path):
    p = tmp_path / "m.json"
    p.write_text('[\n {"text": "a"},\n {"text": "b"}\n {"text": "c"}\n]', encoding="utf-8")
    with pytest.raises(DataError) as e:
        load_rows(str(p))
    assert_one_line(e.value, f"{p}:4:", "malformed JSON", "expected ',' or ']'")  # where it is noticed


def test_json_array_trailing_data_and_bad_bytes_outside_strings(tmp_path):
    p = tmp_path / "two.json"
    p.write_text('[{"text": "a"}]\n[{"text": "b"}]\n', encoding="utf-8")
    with pytest.raises(DataError) as e:
        load_rows(str(p))
    assert_one_line(e.value, f"{p}:2:", "extra data after the array")
    q = tmp_path / "bytes.json"
    q.write_bytes(b'[{"text": "a"},\n \xff{"text": "b"}]')
    with pytest.raises(DataError) as e:
        load_rows(str(q))
    assert_one_line(e.value, f"{q}:2:", "invalid UTF-8: byte 0xff at byte offset 17")


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(DataError) as e:
        load_rows(str(tmp_path / "nope.jsonl"))
    assert_one_line(e.value, "cannot load", "nope.jsonl", "no such file")
    t = tmp_path / "x.txt"
    t.write_text("hello")
    with pytest.raises(DataError) as e:
        load_rows(str(t))
    assert_one_line(e.value, "unsupported file type")
    g = tmp_path / "broken.jsonl.gz"
    g.write_bytes(b"not gzip at all")
    with pytest.raises(DataError) as e:
        load_rows(str(g))
    assert_one_line(e.value, str(g), "cannot read file")


def test_hub_failure_is_one_line(monkeypatch):
    def fail(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub\nretry later")

    monkeypatch.setattr(datasets, "load_dataset", fail)
    with pytest.raises(DataError) as e:
        load_rows("someorg/somedata", split="train")
    msg = assert_one_line(e.value)
    assert msg == ("cannot load 'someorg/somedata': not a local file/dir and hub load failed: "
                   "ConnectionError: Couldn't reach the Hub")


def test_hub_success_path_is_thin(monkeypatch):
    seen = {}

    def fake(name, split=None, streaming=False):
        seen.update(name=name, split=split, streaming=streaming)
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake)
    rows = load_rows("org/data", split="test[:2]")
    assert seen == {"name": "org/data", "split": "test", "streaming": False}
    assert rows.to_list() == ROWS[:2] and rows.where(1) == "org/data[test]:2"


def test_fixtures_load():
    hh = load_rows(str(FIXTURES / "hh_rlhf_excerpt.jsonl"))
    gsm = load_rows(str(FIXTURES / "gsm8k_excerpt.jsonl"))
    assert len(hh) == 20 and hh.columns == ["chosen", "rejected"]
    assert len(gsm) == 20 and gsm.columns == ["question", "answer"]
