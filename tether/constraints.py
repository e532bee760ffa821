"""Allowed values of a config number, declared once, in the field's annotation:

    lr: Positive = 2e-5                       # Annotated[float, Range(gt=0)]
    "peak learning rate"
    label_smoothing: Annotated[float, Range(ge=0, lt=0.5)] = 0.0
    "..."

tether.config reads the `Range` both to check a value (a one-line ConfigError naming the key, on
the command line, in YAML and for Python callers of a `@flat_init` config) and to show it in
`--help` (`[float > 0; default: 2e-05]`), so the check and its documentation cannot drift.

Every float must be finite, with or without a Range: NaN and inf are never a sensible setting
(a NaN β silently skips every step, an infinite lr writes NaN into every weight).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional, get_args, get_origin


class ConfigError(ValueError):
    """A bad config key or value; its message is one line naming the key."""


@dataclass(frozen=True)
class Range:
    """An interval: any of ge (>=), gt (>), le (<=), lt (<)."""
    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None

    def holds(self, v: float) -> bool:
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))

    def text(self) -> str:
        lo = (f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}"
              if self.gt is not None else None)
        hi = (f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})"
              if self.lt is not None else None)
        if lo and hi:
            return f"in {lo}, {hi}"
        if lo:
            return f"{'>=' if self.ge is not None else '>'} {lo[1:]}"
        if hi:
            return f"{'<=' if self.le is not None else '<'} {hi[:-1]}"
        return ""


@dataclass(frozen=True)
class Directory:
    """A path that is a directory or can become one (no existing file in the way), checked when
    the config is read, so a run fails before writing anything rather than when it saves."""

    def problem(self, value: Any) -> Optional[str]:
        p = Path(str(value))
        for q in (p, *p.parents):
            if q.exists():
                return None if q.is_dir() else f"must be a directory, but '{q}' is a file"
        return None

    def text(self) -> str:
        return "(a directory)"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


# The common ranges by name (each field still says which one it takes).
Positive = Annotated[float, Range(gt=0)]
NonNegative = Annotated[float, Range(ge=0)]
Fraction = Annotated[float, Range(ge=0, le=1)]
PositiveInt = Annotated[int, Range(ge=1)]
NonNegativeInt = Annotated[int, Range(ge=0)]
Seed = Annotated[int, Range(ge=0, lt=2**32)]  # numpy's seed range
DirPath = Annotated[str, Directory()]


def number_problem(value: Any, rng: Optional[Range]) -> Optional[str]:
    """What is wrong with a number under `rng` (+ finiteness for floats), as 'must be ...', or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    finite = not isinstance(value, float) or math.isfinite(value)
    if finite and (rng is None or rng.holds(value)):
        return None
    want = rng.text() if rng is not None else ""
    if isinstance(value, float):
        want = f"{want} and finite" if want else "finite"
    return f"must be {want}"


def constraint_text(meta: tuple) -> str:
    """The constraints of an Annotated type as shown in --help ('> 0', 'in [0, 1)')."""
    return " ".join(m.text() for m in meta if isinstance(m, (Range, Directory)))


def check(value: Any, meta: tuple, key: str) -> Optional[str]:
    """One line saying why `value` breaks the constraints in `meta`, or None when it is fine."""
    for m in meta:
        if isinstance(m, Range):
            problem = number_problem(value, m)
        elif isinstance(m, Directory):
            problem = m.problem(value)
        else:
            continue
        if problem:
            return f"config key '{key}' {problem}; got {value!r}"
    return None


def check_values(cfg: Any, prefix: str = "") -> None:
    """Every number of `cfg` (sections included) against its field's Range, floats finite: the
    checks `load_config` makes, for configs built in Python. A one-line ConfigError naming the key."""
    hints = typing.get_type_hints(type(cfg), include_extras=True)
    for f in dataclasses.fields(cfg):
        value, tp, key = getattr(cfg, f.name), hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(value):
            check_values(value, key + ".")
            continue
        meta: tuple = ()
        while True:  # unwrap Optional[...] / Annotated[...] / list[...] down to the element type
            origin, args = get_origin(tp), get_args(tp)
            if origin is Annotated:
                tp, meta = args[0], meta + tuple(args[1:])
            elif origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
                tp = args[0] if args[1] is type(None) else args[1]
            elif origin in (list, tuple) and args:
                tp = args[0]
            else:
                break
        for v in value if isinstance(value, (list, tuple)) else [value]:
            problem = check(v, meta, key) or (number_problem(v, None) and
                                              f"config key '{key}' {number_problem(v, None)}; got {v!r}")
            if problem:
                raise ConfigError(problem)


def _strict_loader():
    import yaml

    class StrictLoader(yaml.SafeLoader):
        """safe_load, but a key given twice in one mapping is an error naming the key and both lines
        (PyYAML keeps the last silently: a forgotten earlier `lr:` would win without a word)."""

        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # SafeLoader itself refuses an unhashable key, with its line
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key '{key}' given twice (lines {seen[key]} and {line})",
                        key_node.start_mark)
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def read_config_file(config_file: str) -> dict:
    """A YAML config file as a dict (yaml.safe_load, duplicate keys refused); ConfigError naming
    the file and line otherwise."""
    import yaml

    path = Path(config_file)
    if not path.is_file():
        raise ConfigError(f"config file '{config_file}' does not exist")
    try:
        loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=_strict_loader()) or {}  # noqa: S506
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file '{config_file}' cannot be read: {e}") from None
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f":{line + 1}" if line is not None else ""
        problem = getattr(e, "problem", None)
        what = problem if problem and "given twice" in problem else f"invalid YAML ({problem or e})"
        raise ConfigError(f"{config_file}{where}: {what}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{config_file}: top level must be a mapping of key: value")
    return loaded


def fsdp_conflict(fsdp: bool, offload: bool, reduce: str, defer_sync: bool) -> Optional[tuple[str, str]]:
    """FSDP2 options that do not go together, refused alike by the trainers' `model` section and
    by `tether memory` (fsdp = FSDP2 sharding, not replication): (the key, why) or None."""
    if offload and not fsdp:  # replication has no shards to offload: refuse, not ignore
        return "fsdp_offload", ("fsdp_offload=true offloads FSDP2's shards and needs fsdp=true (sharding=fsdp); "
                                "replicated, every GPU holds the whole model, its gradients and optimizer state")
    if fsdp and reduce == "bf16" and defer_sync:  # FSDP2 keeps no fp32 accumulator then
        return "fsdp_reduce", ("fsdp_reduce=bf16 with fsdp_defer_sync=true would add the deferred micro-batches' "
                               "gradients in bf16 (FSDP2 keeps no fp32 accumulator when the reduce dtype is the "
                               "compute dtype); use one of the two")
    return None
