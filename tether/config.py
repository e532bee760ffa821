"""Dataclass configs: field docs, YAML loading, `key=value` overrides, strict type checking.

A config is a plain `@dataclass` whose fields each carry a docstring — a string literal on the
line after the field, the way attribute docstrings read in Sphinx:

    @dataclass
    class SFTConfig:
        lr: float = 3e-4
        "peak learning rate"

We read those strings with `ast` from the class source (so the doc sits next to the default, not
in a separate table that drifts). Values come, in increasing priority, from the defaults, a YAML
file (`--config x.yaml`) and `key=value` arguments. Nested dataclasses are addressed with dots
(`model.dtype=bf16`). Anything unknown or of the wrong type is a one-line `ConfigError` naming the
key and what is allowed (for an unknown key: its closest keys, and `tether <command> --help`) —
before any work starts.

Sections. A trainer's config is made of sections (`model`, `optim`, `run`, `data`, + the algorithm's
own), each a dataclass written once and shared. A key may be given by its last name alone
(`lr=1e-5` is `optim.lr=1e-5`) when exactly one section has it (else: an error listing the full
names), so old flat YAML files and flat keyword arguments (`GRPOConfig(model="x", lr=1e-5)`, see
:func:`flat_init`) keep working. A section that declares `PRIMARY` takes a bare value as that field
(`model=path` is `model.path=path`). A trainer sets its own defaults for a section with
`field(default_factory=lambda: OptimSection(lr=1e-6))`; a partial section in YAML or on the command
line changes only the keys it names, on top of those defaults. A number's allowed range is part of
its annotation (`lr: Positive`, tether.constraints): checked here, shown in --help.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import textwrap
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml

# ConfigError lives with the constraints (the layer below) and is re-exported from here
from tether.constraints import (ConfigError, check, check_values, constraint_text,  # noqa: F401
                                number_problem, read_config_file)


_DOC_CACHE: dict[type, dict[str, str]] = {}


def field_docs(cls: type) -> dict[str, str]:
    """Map field name -> its docstring, for `cls` and its dataclass bases."""
    if cls in _DOC_CACHE:
        return _DOC_CACHE[cls]
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):  # source not shipped: docs degrade, nothing breaks
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    _DOC_CACHE[cls] = docs
    return docs


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)  # keep Annotated constraints


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *meta = get_args(tp)
        return f"{_type_name(base)} {constraint_text(tuple(meta))}".rstrip()
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = get_args(tp)
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is dict:
        return "dict"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, checked: bool = False) -> Any:
    """Check `value` against annotation `tp`; return the (lightly converted) value or raise.
    Floats must be finite (`checked`: the caller's Range says so, with its interval)."""
    origin, bad = get_origin(tp), ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {value!r}")
    if tp is Any:
        return value
    if origin is Annotated:  # a constrained type (tether.constraints): the value, then its range
        base, *meta = get_args(tp)
        value = _coerce(value, base, key, checked=True)
        problem = check(value, tuple(meta), key)
        if problem:
            raise ConfigError(problem)
        return value
    if origin is Literal:
        if value in get_args(tp):
            return value
        if isinstance(value, bool):  # YAML 1.1 reads on/off/yes/no as booleans: `fused_adamw=on`
            for word in (("on", "yes", "true") if value else ("off", "no", "false")):
                if word in get_args(tp):
                    return word
        raise ConfigError(f"config key '{key}' must be one of "
                          f"{', '.join(repr(a) for a in get_args(tp))}; got {value!r}")
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:  # Optional[X]: X's own message (its range, say)
            return _coerce(value, rest[0], key)
        for arg in rest:
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise bad
    if origin in (list, tuple):
        if isinstance(value, str):  # `key=a,b` on the command line
            value = [v for v in value.split(",") if v]
        if isinstance(value, (int, float)):  # `betas=0.5`: a list of one (YAML read a number)
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise bad
        (elem,) = get_args(tp)[:1] or (Any,)
        return [_coerce(v, elem, key) for v in value]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise bad
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string; accept what float() does
            try:
                value = float(value)
            except ValueError:
                raise bad from None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad
        value = float(value)
        if not checked and number_problem(value, None):  # NaN / inf: never a setting
            raise ConfigError(f"config key '{key}' {number_problem(value, None)}; got {value!r}")
        return value
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `name=1` should not be an error for a string field
        raise bad
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad
        return _build(tp, route(tp, value, key + "."), prefix=key + ".")
    raise ConfigError(f"config key '{key}' has unsupported type {tp!r}")


def _section_types(cls: type) -> dict[str, type]:
    """Fields of `cls` that are sections (dataclass-typed), name -> type."""
    hints = _hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)
            if f.init and dataclasses.is_dataclass(hints[f.name])}


def _default_of(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _init_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.init]


def flat_names(cls: type) -> list[str]:
    """Every key `cls` accepts, as a user may write it (what unknown keys are matched to): a
    section's field by its last name when no other section has it, else by its full name; sections
    that take a bare value (PRIMARY) by their own name."""
    sections = _section_types(cls)
    out = [n for n in _init_names(cls) if n not in sections or getattr(sections[n], "PRIMARY", None)]
    owners: dict[str, list[str]] = {}
    for sec, tp in sections.items():
        for n in _init_names(tp):
            owners.setdefault(n, []).append(sec)
    for n, secs in owners.items():
        out += [n] if len(secs) == 1 else [f"{s}.{n}" for s in secs]
    return out


def _written_names(cls: type) -> dict[str, str]:
    """Every key a user may write for `cls` -> the full dotted key it sets: the full keys --help
    lists (a trainer's UNUSED ones left out) and the short names of `flat_names` that stand for one
    of them (a PRIMARY section's own name for its PRIMARY field)."""
    full = [row[0] for row in describe(cls)]
    out = {k: k for k in full}
    sections = _section_types(cls)
    for name in flat_names(cls):
        if name in sections:
            out[name] = f"{name}.{sections[name].PRIMARY}"
        elif name not in out:
            same = [k for k in full if k.endswith("." + name)]
            if len(same) == 1:
                out[name] = same[0]
    return out


def close_keys(cls: type, key: str, n: int = 3) -> list[str]:
    """The keys of `cls` closest to the unknown `key` (difflib.get_close_matches over every key a
    user may write, dotted section keys included), at most `n`, each key once whichever name
    matched. A dotted key's last name is matched on its own too, its match shown by its full name
    (`optim.beta` -> `grpo.beta`). Only matches within 0.1 of the best one's similarity are kept:
    a shared section prefix makes many keys similar (`grpo.bta` is 0.64 from `grpo.advantage`,
    0.94 from `grpo.beta`)."""
    names = _written_names(cls)
    key = key.lower()
    scored = [(difflib.SequenceMatcher(None, key, m).ratio(), m)
              for m in difflib.get_close_matches(key, list(names), n=10)]
    last = key.rsplit(".", 1)[-1]
    if last != key:
        scored += [(difflib.SequenceMatcher(None, last, m).ratio(), names[m])
                   for m in difflib.get_close_matches(last, list(names), n=10)]
    if not scored:
        return []
    best = max(score for score, _ in scored)
    out: dict[str, str] = {}  # full key -> the name shown
    for score, name in sorted(scored, key=lambda sm: -sm[0]):
        if score >= best - 0.1:
            out.setdefault(names[name], name)
    return list(out.values())[:n]


class UnknownKeyError(ConfigError):
    """A key no field of the config has: one line naming it, the closest keys the config has
    (`close_keys`) and where every key is listed (`tether <command> --help`; from Python,
    format_help). `route` raises it for the section it is in; `load_config` and `flat_init` raise it
    again for the whole config (`for_config`), whose keys the user writes."""

    def __init__(self, key: str, cls: type, command: str | None = None):
        self.key, self.cls, self.command = key, cls, command
        near = close_keys(cls, key)
        hint = f"; did you mean {' or '.join(repr(k) for k in near)}?" if near else ""
        where, listed = ((f"tether {command}", f"tether {command} --help") if command else
                         (cls.__name__, f"tether.config.format_help({cls.__name__})"))
        super().__init__(f"unknown key '{key}' for {where}{hint} ({listed} lists every key)")

    def for_config(self, cls: type, command: str | None = None) -> "UnknownKeyError":
        return UnknownKeyError(self.key, cls, command)


def _put(out: dict, section: str, value: Any) -> None:
    """Merge `value` (a dict of keys, or a section instance) into out[section]."""
    have = out.get(section)
    if isinstance(have, dict) and isinstance(value, dict) and have.keys() & value.keys():
        raise ConfigError(f"config key '{section}.{min(have.keys() & value.keys())}' is given "
                          "twice (by its full and its short name)")
    if have is None:
        out[section] = value
    elif dataclasses.is_dataclass(value):  # an instance, with keys given beside it on top
        out[section] = dataclasses.replace(value, **have) if isinstance(have, dict) else value
    elif dataclasses.is_dataclass(have):
        out[section] = dataclasses.replace(have, **value)
    else:
        out[section] = _merge(have, value)


def route(cls: type, tree: dict, prefix: str = "") -> dict:
    """Put every key of `tree` where it belongs in `cls`: flat names into their (unique) section,
    a bare value for a section into its PRIMARY field. Ambiguous or unknown keys are errors."""
    if not dataclasses.is_dataclass(cls):
        return tree
    names, sections = _init_names(cls), _section_types(cls)
    out: dict = {}
    for key, value in tree.items():
        if key in sections:
            tp = sections[key]
            if isinstance(value, dict):
                value = route(tp, value, f"{prefix}{key}.")
            elif not isinstance(value, tp) and getattr(tp, "PRIMARY", None):
                value = {tp.PRIMARY: value}  # `model=path` is `model.path=path`
            _put(out, key, value)
        elif key in names:
            out[key] = value
        else:
            owners = [n for n, tp in sections.items() if key in _init_names(tp)]
            if len(owners) > 1:
                raise ConfigError(f"config key '{prefix}{key}' is ambiguous; set one of "
                                  f"{', '.join(f'{prefix}{o}.{key}' for o in owners)}")
            if not owners:
                raise UnknownKeyError(f"{prefix}{key}", cls)
            _put(out, owners[0], {key: value})
    return out


def _build(cls: type, values: dict, prefix: str = "", base: Any = None) -> Any:
    """`cls` from routed `values`, every value type-checked; on top of `base` when given."""
    hints, names, sections = _hints(cls), _init_names(cls), _section_types(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise UnknownKeyError(f"{prefix}{key}", cls)
        if key in sections and isinstance(value, dict):
            kwargs[key] = _build(sections[key], value, f"{prefix}{key}.",
                                 base=getattr(base, key) if base is not None else _default_of(cls, key))
        elif key in sections and isinstance(value, sections[key]):
            kwargs[key] = value
        else:
            kwargs[key] = _coerce(value, hints[key], prefix + key)
    try:
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
    except (TypeError, ValueError) as e:  # __post_init__ checks raise ValueError with the key
        raise e if isinstance(e, ConfigError) else ConfigError(f"{cls.__name__}: {e}") from None


def flat_init(cls: type) -> type:
    """Let a sectioned config dataclass be built from flat keyword arguments, as a flat YAML file:
    `SFTConfig(model="m", data="d.jsonl", lr=1e-4)` = `SFTConfig(model=ModelSection(path="m"),
    data=..., optim=replace(<SFT's optim defaults>, lr=1e-4))`. Types are not checked here (Python
    callers get Python's rules); ranges (check_values) and the `__post_init__` checks are."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, **kwargs):
        try:
            routed = route(cls, kwargs)
        except UnknownKeyError as e:
            raise e.for_config(cls) from None
        for name in _section_types(cls):
            if isinstance(routed.get(name), dict):
                routed[name] = dataclasses.replace(_default_of(cls, name), **routed[name])
        init(self, **routed)
        check_values(self)
        _check_unused(self)

    cls.__init__ = __init__
    return cls


def _check_unused(cfg: Any) -> None:
    """A shared section can hold a key this trainer does not use (`UNUSED = {"run.eval_every":
    why}` on the config class): it is left out of --help, and setting it is an error saying why,
    not a silently ignored value."""
    for dotted, why in getattr(type(cfg), "UNUSED", {}).items():
        section, key = dotted.split(".")
        if getattr(getattr(cfg, section), key) != getattr(_default_of(type(cfg), section), key):
            raise ValueError(f"{dotted} is not used here: {why}")


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for p in parts[:-1]:
        tree = tree.setdefault(p, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"config key '{dotted}': '{p}' is not a section")
    tree[parts[-1]] = value


def parse_overrides(args: list[str]) -> dict:
    """`["lr=1e-3", "model.dtype=bf16"]` -> nested dict, values parsed as YAML scalars."""
    tree: dict = {}
    for arg in args:
        if "=" not in arg:
            raise ConfigError(f"argument '{arg}' is not key=value")
        key, raw = arg.split("=", 1)
        key = key.strip().lstrip("-").replace("-", "_")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_path(tree, key, value)
    return tree


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(cls: type, config_file: str | None = None, overrides: list[str] | dict | None = None,
                command: str | None = None):
    """Build `cls` from defaults <- YAML file <- overrides, with strict checking. `command`: the
    CLI command `cls` is read for (`tether <command>`), named by the unknown-key error."""
    try:
        values: dict = {}
        if config_file:
            values = route(cls, read_config_file(config_file))
        if overrides:
            over = overrides if isinstance(overrides, dict) else parse_overrides(overrides)
            values = _merge(values, route(cls, over))
        return _build(cls, values)
    except UnknownKeyError as e:
        raise e.for_config(cls, command) from None


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")


def describe(cls: type, prefix: str = "", base: Any = None) -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) for every field, sections flattened with dots; a section's
    defaults are the ones `cls` gives it (its default_factory), not the section class's."""
    rows, docs, hints = [], field_docs(cls), _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        if base is not None:
            default = getattr(base, f.name)
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "(required)"
        if dataclasses.is_dataclass(tp):
            hidden = {k.split(".", 1)[1] for k in getattr(cls, "UNUSED", {}) if k.startswith(f.name + ".")}
            rows.extend(r for r in describe(tp, prefix + f.name + ".", base=default)
                        if r[0].rsplit(".", 1)[1] not in hidden)
            continue
        rows.append((prefix + f.name, _type_name(tp), repr(default) if isinstance(default, str)
                     else str(default), docs.get(f.name, "")))
    return rows


def format_help(cls: type, width: int = 100) -> str:
    """Options grouped by section, each under a header line with the section's doc."""
    rows = describe(cls)
    keyw = max((len(r[0]) for r in rows), default=10)
    docs, sections = field_docs(cls), _section_types(cls)
    lines, current = [], None
    for key, tp, default, doc in rows:
        group = key.split(".", 1)[0] if "." in key and key.split(".", 1)[0] in sections else None
        if group != current and group is not None:
            lines.append(f"{group}: {docs.get(group, '')}".rstrip())
        current = group
        lines.append(f"  {key:<{keyw}}  {doc}  [{tp}; default: {default}]")
    if sections:
        lines.append("(a key may be given by its last name alone, e.g. lr=1e-5 for optim.lr, "
                     "when only one section has it)")
    return "\n".join(lines)
