"""The labeler's pairs and its files.

Files, in `labels_dir` (the only place the studio writes):

    preferences.jsonl  {"prompt", "chosen", "rejected"}: TRL's preference format, what `tether rm`
                       and `tether dpo` read unchanged
    ties.jsonl         {"prompt", "response_a", "response_b"}: pairs labelled as ties, kept apart
    journal.jsonl      every action in order: {"id", "pair", "choice": a|b|tie|skip, "prompt",
                       "a", "b", "session", "time"} and {"undo": id, ...}; the truth the other two
                       are derived from

A label is one line appended to the journal and one to preferences.jsonl (or ties.jsonl), each a
single write() on an O_APPEND descriptor, under an exclusive flock on `.lock`: two tabs (or two
studios) labelling at once serialise there and lose nothing. Undo appends to the journal and
rewrites the TRL files from it (temporary file + rename, still under the lock), so a reader sees
the file before or after, never half of it.

Pair sources (StudioConfig.label_source):
    world      the gold-reward world's human writer, two responses to one training prompt
               (tether.tasks.preference_world); each pair knows its gold rewards
    model      two completions of `model` sampled live at two temperatures (label_temperatures),
               to the prompts of label_prompts or the world's
    <file>     a preference file (chosen and rejected shown in a seeded random order) or a
               prompt-completion file (two completions of the same prompt), loaded by tether.data
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import threading
import time
import uuid
import zlib
from contextlib import contextmanager
from pathlib import Path

from tether.errors import UserError

CHOICES = ("a", "b", "tie", "skip")


class WorldPairs:
    """Pair i: a training prompt of the world (whole shuffled passes) and two writer responses,
    redrawn while they are equal. Deterministic in (seed, i). `gold` is known for every pair."""

    def __init__(self, seed: int = 0, world=None):
        from tether.tasks.preference_world import PreferenceWorld

        self.world = world or PreferenceWorld()
        self.seed = seed
        self.name = "world"
        self._prompts = self.world.prompts(None, split="train")

    def __len__(self) -> int:
        return 1 << 30  # endless

    def pair_id(self, i: int, split: str = "train") -> str:
        return f"world-{self.seed}-{split}-{i}"

    def pair(self, i: int, split: str = "train") -> dict:
        rng = random.Random(f"{self.seed}:{split}:{i}")
        prompts = self._prompts if split == "train" else self.world.prompts(None, split=split)
        prompt = prompts[rng.randrange(len(prompts))]
        a = self.world.write(prompt, rng)
        b = self.world.write(prompt, rng)
        while b == a:
            b = self.world.write(prompt, rng)
        g = self.world.gold_reward([prompt, prompt], [a, b])
        return {"pair": self.pair_id(i, split), "index": i, "prompt": prompt, "a": a, "b": b,
                "gold_a": g[0], "gold_b": g[1]}


class FilePairs:
    """Pairs from a preference file (sides in a seeded random order, so the chosen one is not
    always A) or a prompt-completion file (consecutive completions of one prompt, in file order)."""

    def __init__(self, path: str, seed: int = 0):
        from tether.data import load_data

        rows = load_data(path, expect=("preference", "prompt-completion"))
        self.name = Path(path).name
        self.pairs = []
        if rows.format == "preference":
            rng = random.Random(seed)
            for r in rows:
                swap = rng.random() < 0.5
                a, b = (r["rejected"], r["chosen"]) if swap else (r["chosen"], r["rejected"])
                self.pairs.append((r.get("prompt", ""), a, b))
        else:
            by_prompt: dict = {}
            for r in rows:
                by_prompt.setdefault(json.dumps(r["prompt"], sort_keys=True), []).append(r)
            for group in by_prompt.values():
                for x, y in zip(group[0::2], group[1::2]):
                    self.pairs.append((x["prompt"], x["completion"], y["completion"]))
        if not self.pairs:
            raise UserError(f"studio: label_source {path}: no pairs (a preference file, or a prompt-completion "
                            f"file with two or more completions of a prompt)")

    def __len__(self) -> int:
        return len(self.pairs)

    def pair_id(self, i: int, split: str = "train") -> str:
        return f"{self.name}-{i}"

    def pair(self, i: int, split: str = "train") -> dict:
        prompt, a, b = self.pairs[i]
        return {"pair": self.pair_id(i), "index": i, "prompt": prompt, "a": a, "b": b}


class ModelPairs:
    """Pairs sampled live from `model` (tether.rollout.sample): one completion at each of two
    temperatures, on which side each lands drawn per pair, seeded by (seed, split, i, side), so a
    pair is the same whenever it is rebuilt. Prompts: a prompt-only file, else the gold-reward
    world's (then each pair carries its gold rewards and the page shows the Bayes figure)."""

    def __init__(self, model: str, temperatures, prompts: str = "", seed: int = 0):
        from tether.models import load_model, load_tokenizer

        if len(temperatures) != 2 or min(temperatures) <= 0:
            raise UserError(f"studio: label_temperatures must be two temperatures > 0, got {list(temperatures)}")
        self.tokenizer = load_tokenizer(model, padding_side="left")
        self.model = load_model(model, dtype="fp32", device="cpu").eval()
        self.temperatures, self.seed, self.name = list(temperatures), seed, f"{Path(model).name} at T={temperatures}"
        if prompts:
            from tether.data import load_data

            self._prompts = {"train": [r["prompt"] for r in load_data(prompts, expect="prompt-only")]}
        else:
            from tether.tasks.preference_world import PreferenceWorld

            self.world = PreferenceWorld()
            self._prompts = {s: self.world.prompts(None, split=s) for s in ("train", "test")}
        self.max_new_tokens = 24 if hasattr(self, "world") else 128
        self.eval_pairs = 100  # sampled live, so fewer than the world writer's 500
        self._cache: dict = {}
        self._lock = threading.Lock()  # one sampling at a time (the page's thread and the fit's)

    def __len__(self) -> int:
        return 1 << 30

    def pair_id(self, i: int, split: str = "train") -> str:
        return f"model-{self.seed}-{split}-{i}"

    def sample_seed(self, split: str, i: int, side: int) -> int:
        """The sampler's seed of pair i's completion at temperature number `side` (stable across runs)."""
        return zlib.crc32(f"{self.seed}:{split}:{i}:{side}".encode())

    def pair(self, i: int, split: str = "train") -> dict:
        from tether.rollout import sample

        key = (split, i)
        with self._lock:
            if key not in self._cache:
                prompts = self._prompts.get(split) or self._prompts["train"]
                rng = random.Random(f"{self.seed}:{split}:{i}")
                prompt = prompts[rng.randrange(len(prompts))]
                texts = [sample(self.model, self.tokenizer, [prompt], n=1, seed=self.sample_seed(split, i, k),
                                temperature=t, max_new_tokens=self.max_new_tokens).texts[0]
                         for k, t in enumerate(self.temperatures)]
                if rng.random() < 0.5:
                    texts.reverse()
                p = {"pair": self.pair_id(i, split), "index": i, "prompt": prompt, "a": texts[0], "b": texts[1]}
                if hasattr(self, "world"):
                    p["gold_a"], p["gold_b"] = self.world.gold_reward([prompt, prompt], texts)
                self._cache[key] = p
            return self._cache[key]


def make_source(cfg):
    if cfg.label_source == "world":
        return WorldPairs(seed=cfg.seed)
    if cfg.label_source == "model":
        if not cfg.model:
            raise UserError("studio: label_source=model needs model=<a policy folder>")
        return ModelPairs(cfg.model, cfg.label_temperatures, cfg.label_prompts, seed=cfg.seed)
    if not Path(cfg.label_source).is_file():
        raise UserError(f"studio: label_source must be 'world' or a file; {cfg.label_source} is neither")
    return FilePairs(cfg.label_source, seed=cfg.seed)


class LabelStore:
    """The journal and the TRL files of one labels_dir (see the module docstring)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.journal = self.dir / "journal.jsonl"
        self.preferences = self.dir / "preferences.jsonl"
        self.ties = self.dir / "ties.jsonl"
        self._lockfile = self.dir / ".lock"
        self._cursor_lock = threading.Lock()
        self._showing: dict[str, int] = {}  # session (a tab) -> the pair on its screen, not labelled yet

    @contextmanager
    def locked(self):
        fd = os.open(self._lockfile, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks: a label waits its turn, never fails
            yield
        finally:
            os.close(fd)  # drops the flock

    @staticmethod
    def _append(path: Path, row: dict) -> None:
        data = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, data)  # one write on O_APPEND: the line lands whole at the end
            os.fsync(fd)
        finally:
            os.close(fd)

    def entries(self) -> list[dict]:
        """The journal's actions (a torn last line, from a crash mid-write, is ignored)."""
        from tether.run import read_jsonl

        return read_jsonl(self.journal)

    def labels(self) -> list[dict]:
        """The labels in force: journal entries not undone, in order."""
        entries = self.entries()
        undone = {e["undo"] for e in entries if "undo" in e}
        return [e for e in entries if "choice" in e and e["id"] not in undone]

    @staticmethod
    def trl_row(label: dict) -> tuple[str, dict] | None:
        """(file kind, row) a label contributes: 'preferences' for a or b, 'ties' for tie, None for skip."""
        c = label["choice"]
        if c in ("a", "b"):
            chosen, rejected = (label["a"], label["b"]) if c == "a" else (label["b"], label["a"])
            return "preferences", {"prompt": label["prompt"], "chosen": chosen, "rejected": rejected}
        if c == "tie":
            return "ties", {"prompt": label["prompt"], "response_a": label["a"], "response_b": label["b"]}
        return None

    def add(self, pair: dict, choice: str, session: str) -> dict:
        if choice not in CHOICES:
            raise UserError(f"labeler: choice must be one of {', '.join(CHOICES)}; got {choice!r}")
        label = {"id": uuid.uuid4().hex, "pair": pair["pair"], "index": pair["index"], "choice": choice,
                 "prompt": pair["prompt"], "a": pair["a"], "b": pair["b"], "session": session,
                 "time": round(time.time(), 3)}
        with self.locked():
            self._append(self.journal, label)
            out = self.trl_row(label)
            if out is not None:
                self._append(self.preferences if out[0] == "preferences" else self.ties, out[1])
        with self._cursor_lock:
            if self._showing.get(session) == pair["index"]:
                del self._showing[session]
        return label

    def undo(self, label_id: str, session: str) -> dict:
        """Take back a label (its own tab's; any id in force works): journal + rewritten TRL files."""
        with self.locked():
            live = {e["id"]: e for e in self.labels()}
            if label_id not in live:
                raise UserError(f"labeler: no label {label_id} to undo")
            self._append(self.journal, {"undo": label_id, "session": session, "time": round(time.time(), 3)})
            rows = {"preferences": [], "ties": []}
            for e in self.labels():
                out = self.trl_row(e)
                if out is not None:
                    rows[out[0]].append(out[1])
            for kind, path in (("preferences", self.preferences), ("ties", self.ties)):
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows[kind]),
                               encoding="utf-8")
                os.replace(tmp, path)
        with self._cursor_lock:  # the undone pair is on this tab's screen again
            self._showing[session] = live[label_id]["index"]
        return live[label_id]

    def next_index(self, source, session: str) -> int | None:
        """The pair of `source` that `session` (a tab) shows: the one it already holds (a reloaded
        tab keeps its pair), else the first pair nobody labelled (skips count; a label counts for
        this source only if its pair id is this source's: a journal may hold another source's
        labels) and no other tab shows; None when every pair is done."""
        n_pairs = len(source)
        done = {e["index"] for e in self.labels() if e.get("pair") == source.pair_id(e["index"])}
        with self._cursor_lock:
            held = self._showing.get(session)
            if held is not None and held not in done:
                return held
            shown = set(self._showing.values())
            i = 0
            while i < n_pairs and (i in done or i in shown):
                i += 1
            if i >= n_pairs:
                self._showing.pop(session, None)
                return None
            self._showing[session] = i
            return i

    def mine(self, session: str) -> list[str]:
        """The ids of `session`'s labels in force, oldest first (a reloaded tab's undo stack)."""
        return [e["id"] for e in self.labels() if e.get("session") == session]
