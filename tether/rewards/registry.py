"""Reward-function protocol, loading by name, and weighted composition.

A reward function has TRL's signature so that functions written for TRL's GRPOTrainer work here
unchanged::

    fn(prompts, completions, completion_ids, **columns) -> list[float | None]

`columns` are the dataset's extra columns (e.g. `answer`, `tests`), one list entry per row. For a
conversational prompt (a list of messages) `prompts[i]` is that list and `completions[i]` is
`[{"role": "assistant", "content": text}]` (as in TRL); for plain-text prompts both are strings
(:func:`as_completions`).
`None` means "not applicable to this row" (e.g. a code reward on a math row): it is skipped in the
weighted sum and in that function's mean, instead of being counted as a 0 that drags it down.
Functions may be `async def`; all async ones in a batch run concurrently on one event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import os
import sys
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from tether.errors import UserError

log = logging.getLogger(__name__)

RewardFn = Callable[..., Any]


class RewardError(UserError):
    """A reward function failed or returned something unusable; the message names it."""


def reward_name(fn: RewardFn) -> str:
    """The name used in metrics (`rewards/<name>/mean`) and in error messages."""
    name = getattr(fn, "reward_name", None) or getattr(fn, "__name__", None)
    if name is None and hasattr(fn, "func"):  # functools.partial
        name = getattr(fn.func, "__name__", None)
    return name or type(fn).__name__


def as_completions(prompts: Sequence, texts: Sequence[str]) -> list:
    """Completions as reward functions receive them, TRL's convention: for a conversational prompt
    (a list of messages) the completion is a list of one assistant message,
    `[{"role": "assistant", "content": text}]`, so `completion[0]["content"]` works; for a
    plain-text prompt, the text itself."""
    return [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
            for p, t in zip(prompts, texts)]


def builtin_rewards() -> dict[str, Callable[..., RewardFn]]:
    """Built-in name -> factory (called with keyword options, or none for the default)."""
    # Imported here so that importing the registry never pulls in the sandbox machinery; by
    # module path, since the package __init__ (which imports this module) would be a cycle.
    from tether.rewards.reasoning_gym import make_reasoning_gym
    from tether.rewards.verifiers import BUILTINS
    return {**BUILTINS, "reasoning_gym": make_reasoning_gym}


def load_reward(spec: str | RewardFn, **options) -> RewardFn:
    """A callable from a built-in name ('math', 'format', ...), 'package.module:function' (the
    working directory is on the import path, as under `python -m`) or 'path/to/file.py:function'
    (absolute, or relative to the working directory).

    `options` go to a built-in's factory (e.g. load_reward('format', pattern=r'...')).
    Errors are one line: the spec and why it cannot be used."""
    if callable(spec):
        return spec
    spec = str(spec).strip()
    builtins = builtin_rewards()
    if spec in builtins:
        try:
            return builtins[spec](**options)
        except TypeError as e:
            raise UserError(f"reward {spec!r}: bad options {sorted(options)}: {e}") from None
    if spec.startswith("rm:"):  # learned reward model(s): 'rm:<path>[,<path>...][?aggregate=min&k=1]'
        from tether.rewards.learned import LearnedReward, parse_rm_spec  # imports torch: lazily
        paths, opts = parse_rm_spec(spec)
        return LearnedReward(paths, **{**opts, **options})
    if spec.startswith("prm:"):  # a process reward model: 'prm:<path>[?aggregate=min|last|prod|mean]'
        from tether.rewards.process import ProcessReward, parse_prm_spec  # imports torch: lazily
        path, opts = parse_prm_spec(spec)
        return ProcessReward(path, **{**opts, **options})
    if ":" not in spec:
        raise UserError(f"reward {spec!r} is neither a built-in ({', '.join(sorted(builtins))}) "
                        f"nor 'module:function' / 'path/to/file.py:function'")
    if options:
        raise UserError(f"reward {spec!r}: options are only accepted by built-in rewards")
    obj = import_object(spec, what="reward")
    if not callable(obj):
        raise UserError(f"reward {spec!r}: {spec.rpartition(':')[2]!r} is a {type(obj).__name__}, "
                        "not callable")
    return obj


def import_object(spec: str, what: str) -> Any:
    """The object a 'package.module:attr' or 'path/to/file.py:attr' spec names (`attr` may be
    dotted: 'mod:Class.method'). The working directory is on the import path, as under
    `python -m`; a file path is absolute or relative to the working directory. `what` ('reward',
    'environment') starts every error message, which is one line naming the spec."""
    # rpartition: a file path may hold a ':' of its own, an attribute name never does
    module_name, _, attr = spec.rpartition(":")
    is_file = _is_file_spec(module_name)
    try:
        module = _import_file(module_name) if is_file else _import_module(module_name)
    except UserError as e:
        raise UserError(f"{what} {spec!r}: {e}") from None
    except Exception as e:  # ImportError, or the module itself raising on import
        raise UserError(f"{what} {spec!r}: cannot import {'file' if is_file else 'module'} "
                        f"{module_name!r}: {type(e).__name__}: {_one_line(e)}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _is_file_spec(module_name: str) -> bool:
    """'./reward.py', 'rewards/exact.py', '/abs/r.py': a file; 'pkg.mod': a module name."""
    return module_name.endswith(".py") or "/" in module_name or os.sep in module_name


def _import_module(module_name: str) -> types.ModuleType:
    """`importlib.import_module` with the working directory on the import path, as `python -m`
    has it: the `tether` console script's sys.path[0] is its own bin directory, so a user's
    `reward.py` next to their data would otherwise not be found. Added only here, where a user's
    module is asked for, not when tether is imported."""
    cwd = os.getcwd()
    on_path = {os.path.abspath(p or os.curdir) for p in sys.path}
    if cwd not in on_path:
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()
    return importlib.import_module(module_name)


def _import_file(path: str) -> types.ModuleType:
    """The Python file at `path` (relative to the working directory) as a module, under a name made
    from its absolute path: two files both called reward.py never collide, and loading one file
    twice (reward_funcs and eval_reward_funcs) gives the same functions."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise UserError(f"file {path!r} does not exist" if not file.exists() else f"{path!r} is not a file")
    name = "tether_user_reward_" + hashlib.sha1(str(file).encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise UserError(f"cannot load {path!r} as Python (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look a module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


@dataclass
class RewardBatch:
    total: list[float]                      # weighted sum per row (0 where every fn said None)
    per_fn: dict[str, list[float | None]]   # raw values per function, None kept
    n_all_none: int = 0                     # rows no function applied to

    def metrics(self) -> dict[str, float]:
        """`rewards/<fn>/mean` and `/std` over the rows each function applied to (TRL's names)."""
        out: dict[str, float] = {}
        for name, vals in self.per_fn.items():
            xs = [v for v in vals if v is not None]
            mean = sum(xs) / len(xs) if xs else math.nan
            var = sum((x - mean) ** 2 for x in xs) / len(xs) if xs else math.nan
            out[f"rewards/{name}/mean"] = mean
            out[f"rewards/{name}/std"] = math.sqrt(var) if xs else math.nan
        out["rewards/all_none_count"] = float(self.n_all_none)
        return out


@dataclass
class RewardSet:
    """Several reward functions with weights; `score` returns their weighted sum per row."""
    funcs: Sequence[RewardFn | str]
    weights: Sequence[float] | None = None
    names: list[str] = field(init=False)

    def __post_init__(self):
        self.funcs = [load_reward(f) for f in self.funcs]
        if not self.funcs:
            raise UserError("at least one reward function is needed")
        if self.weights is None:
            self.weights = [1.0] * len(self.funcs)
        if len(self.weights) != len(self.funcs):
            raise UserError(f"{len(self.weights)} reward weights given for "
                            f"{len(self.funcs)} reward functions")
        self.weights = [float(w) for w in self.weights]
        # Unique names: two functions with the same __name__ would overwrite each other's metrics.
        self.names, seen = [], {}
        for f in self.funcs:
            n = reward_name(f)
            seen[n] = seen.get(n, 0) + 1
            self.names.append(n if seen[n] == 1 else f"{n}_{seen[n]}")

    def score(self, prompts, completions, completion_ids=None,
              columns: dict[str, list] | None = None) -> RewardBatch:
        n = len(completions)
        columns = dict(columns or {})
        for key, vals in columns.items():
            if len(vals) != n:
                raise UserError(f"column {key!r} has {len(vals)} values for {n} completions")
        if completion_ids is None:
            completion_ids = [None] * n
        raw: dict[str, Any] = {}
        pending: dict[str, Any] = {}
        for name, fn in zip(self.names, self.funcs):
            try:
                out = fn(prompts=prompts, completions=completions,
                         completion_ids=completion_ids, **columns)
            except Exception as e:
                raise _failed(name, e) from e
            (pending if inspect.isawaitable(out) else raw)[name] = out
        if pending:
            raw.update(_run_async(pending))
        per_fn = {name: validate_reward_output(name, raw[name], n) for name in self.names}

        total, n_all_none = [], 0
        for i in range(n):
            vals = [(w, per_fn[name][i]) for name, w in zip(self.names, self.weights)]
            applied = [(w, v) for w, v in vals if v is not None]
            if not applied:
                n_all_none += 1
            total.append(float(sum(w * v for w, v in applied)))
        if n_all_none:
            # Not an error (a mixed dataset may have rows no reward covers), but worth seeing:
            # those rows get 0 and still take part in the group's advantage.
            log.warning("%d of %d completions got no reward from any function (scored 0)",
                        n_all_none, n)
        return RewardBatch(total, per_fn, n_all_none)

    __call__ = score


def compute_rewards(funcs, weights, prompts, completions, completion_ids,
                    columns: dict[str, list] | None = None):
    """(total per row, {name: per-row values}); see RewardSet.score for the all-None count."""
    batch = RewardSet(funcs, weights).score(prompts, completions, completion_ids, columns)
    return batch.total, batch.per_fn


def _failed(name: str, e: BaseException) -> RewardError:
    return RewardError(f"reward function {name!r} failed: {type(e).__name__}: {_one_line(e)}")


def _run_async(pending: dict[str, Any]) -> dict[str, Any]:
    async def gather():
        results = await asyncio.gather(*pending.values(), return_exceptions=True)
        return dict(zip(pending, results))

    try:
        asyncio.get_running_loop()
        in_loop = True
    except RuntimeError:
        in_loop = False
    if in_loop:
        # Called from inside an event loop (a notebook, an async server): asyncio.run would refuse,
        # so run the coroutines on a private loop in a helper thread.
        box: dict[str, Any] = {}
        t = threading.Thread(target=lambda: box.update(r=asyncio.run(gather())))
        t.start()
        t.join()
        results = box["r"]
    else:
        results = asyncio.run(gather())
    for name, r in results.items():
        if isinstance(r, BaseException):
            raise _failed(name, r) from r
    return results


def validate_reward_output(name: str, out: Any, n: int) -> list[float | None]:
    if isinstance(out, (str, bytes)) or not hasattr(out, "__len__"):
        raise RewardError(f"reward function {name!r} returned {type(out).__name__}, "
                          f"expected a list of {n} floats or None")
    if len(out) != n:
        raise RewardError(f"reward function {name!r} returned {len(out)} values for "
                          f"{n} completions")
    vals: list[float | None] = []
    for i, v in enumerate(out):
        if v is None:
            vals.append(None)
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise RewardError(f"reward function {name!r} returned {v!r} at row {i}, "
                              f"not a number or None") from None
        if not math.isfinite(f):  # NaN / inf would silently poison the advantages of the whole group
            raise RewardError(f"reward function {name!r} returned {'NaN' if math.isnan(f) else f} at row {i} "
                              "(return None to skip a row)")
        vals.append(f)
    return vals
