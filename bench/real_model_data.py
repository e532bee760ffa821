"""Data for bench/real_model_rl.py: verifiable two-digit arithmetic for a real instruct model (SmolLM2-135M-Instruct).

Problems are the arithmetic task's level 3 (two-digit ± two-digit, two-digit × one-digit:
tether.tasks.arithmetic), asked as a conversation with the answer-line convention spelled out,
because an instruct model has never seen our "#### n" line and must be told it:

    user: What is 37 + 48? Give the final answer on its own last line as "#### <number>".

Writes <out>/train.jsonl (prompt-only rows + `answer`, for `tether grpo` and TRL's GRPOTrainer)
and <out>/heldout.jsonl (400 problems disjoint from train), both conversational (`prompt` is a
list of messages), the format both libraries read.

    python bench/real_model_data.py --out /tmp/arith [--n-train 20000] [--n-test 400] [--seed 0]
    python bench/real_model_data.py --out /tmp/gsm8k --gsm8k DIR   # GSM8K (DIR/train.jsonl, test.jsonl)

With --gsm8k the rows are GSM8K's (OpenAI's `question` / `answer` files, the answer's '#### n'
line is the target): every train row, and the first --n-test test rows as held-out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tether.tasks.arithmetic import make_splits

INSTRUCTION = 'Give the final answer on its own last line as "#### <number>".'


def row(p) -> dict:
    # ASCII operators: the instruct model reads 'x' and '*' far more often than '×'
    question = f"What is {p.a} {'*' if p.op == '×' else p.op} {p.b}?"
    return {"prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}], "answer": str(p.answer)}


def gsm8k_row(r: dict) -> dict:
    answer = r["answer"].split("####")[-1].strip().replace(",", "")
    return {"prompt": [{"role": "user", "content": f"{r['question']} {INSTRUCTION}"}], "answer": answer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-train", type=int, default=20000)
    ap.add_argument("--n-test", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gsm8k", default="", help="a folder with GSM8K's train.jsonl and test.jsonl")
    a = ap.parse_args()
    if a.gsm8k:
        def read(name):
            return [json.loads(x) for x in open(Path(a.gsm8k) / name) if x.strip()]
        train, test = [gsm8k_row(r) for r in read("train.jsonl")], [gsm8k_row(r) for r in read("test.jsonl")[:a.n_test]]
    else:
        problems = make_splits(a.n_train, a.n_test, level=3, seed=a.seed)
        train, test = ([row(p) for p in part] for part in problems)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("heldout", test)):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{out}/train.jsonl: {len(train)} rows; {out}/heldout.jsonl: {len(test)} rows")


if __name__ == "__main__":
    main()
