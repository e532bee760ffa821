"""Tool-using demonstrations for an SFT before multi-turn RL: episodes of bench/env_rl.py's
`ArithCalculator` played by a script (the right tool call in the model family's format — Hermes
blocks for SmolLM2, a ```tool_code fence for Gemma 3 —, its result, the answer line), written
as chat rows for `tether sft` (assistant-only loss: the model learns to write the call and the
answer, never the tool's output).

A model that never writes a well-formed tool call gives GRPO nothing to learn tool use from;
a few hundred of these give it a first success. The rows are played through tether's own
Episode, so the system prompt, the call's form and the tool message are exactly what the
environment shows the model in training.

    python bench/env_demos.py --model /tmp/smollm2 --out /tmp/demos.jsonl --n 400 --seed 7
    python bench/env_demos.py --model /tmp/smollm2 --out /tmp/plain.jsonl --n 400 --seed 7 --no-tools
    tether sft model=/tmp/smollm2 data=/tmp/demos.jsonl ...
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from env_rl import ArithCalculator, PlainArith  # noqa: E402
from tether.envs.episode import Episode  # noqa: E402

TOOL = {"+": "add", "-": "sub", "*": "mul"}


def demonstration(row: dict, tokenizer) -> list[dict]:
    """One scripted episode: the call for the row's operation, the tool's result, the answer."""
    a, op, b = row["prompt"].removeprefix("What is ").removesuffix("?").split()
    ep = Episode(ArithCalculator(), tokenizer)  # the family's tool format, from the chat template
    ep.start(row)
    turn = ep.respond(ep.format.call_text(TOOL[op], {"a": int(a), "b": int(b)}))
    if turn.tool_errors or turn.done:
        raise ValueError(f"the scripted call failed on {row}")
    result = re.findall(r"-?\d+(?:\.\d+)?", turn.messages[-1]["content"])[-1]  # the tool's number (gemma fences it)
    ep.respond(f"{a} {op} {b} = {result}\n#### {result}")
    return ep.messages


def plain_demonstration(row: dict, tokenizer) -> list[dict]:
    """The control: the same problem answered with no tool (`PlainArith`), the same answer lines."""
    a, op, b = row["prompt"].removeprefix("What is ").removesuffix("?").split()
    ep = Episode(PlainArith(), tokenizer)
    ep.start(row)
    ep.respond(f"{a} {op} {b} = {row['answer']}\n#### {row['answer']}")
    return ep.messages


def main() -> None:
    from transformers import AutoTokenizer
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the model whose chat template renders the episodes")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--seed", type=int, default=7, help="rows' seed (the benchmark trains on seeds 0-2)")
    ap.add_argument("--no-tools", action="store_true", help="the control: answers with no tool call")
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.model)
    with open(a.out, "w") as f:
        for row in ArithCalculator.rows(a.n, a.seed):
            play = plain_demonstration if a.no_tools else demonstration
            f.write(json.dumps({"messages": play(row, tok)}) + "\n")
    print(f"wrote {a.n} demonstrations to {a.out}")


if __name__ == "__main__":
    main()
