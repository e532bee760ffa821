"""eval.json, completions.jsonl and the printed table of `tether eval`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def clean(value):
    """JSON-safe: NaN / inf become null (json.dumps would write bare NaN, which is not JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def _atomic(path: Path, text: str) -> None:
    """Write via a temporary file and rename: a reader never sees half an eval.json."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_eval(out_dir: Path, result: dict, records: list[dict]) -> None:
    """`eval.json` (everything but the completions) and `completions.jsonl` (one line each; an old
    file is replaced, so it always belongs to this eval.json)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _atomic(out_dir / "eval.json", json.dumps(clean(result), indent=2) + "\n")
    (out_dir / "completions.jsonl").unlink(missing_ok=True)
    if records:
        _atomic(out_dir / "completions.jsonl",
                "".join(json.dumps(clean(r), ensure_ascii=False) + "\n" for r in records))


def _fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if not math.isfinite(v) else f"{v:.4f}" if abs(v) < 1e4 else f"{v:.4g}"
    return str(v)


def table(result: dict) -> str:
    """Plain aligned text (as `tether memory` prints): a header, then one metric per line."""
    model = result["model"]
    what = model["rm"] or (f"policy {model['policy'] or model['path']} vs ref {model['ref']}" if model["ref"]
                           else model["path"])
    data = result["data"]
    lines = [f"tether eval: {result['mode']} ({result['kind']})", f"  model  {what}",
             f"  data   {data['path']} ({data['format']}, {data['rows']} rows)"]
    metrics = result["metrics"]
    width = max((len(k) for k in metrics), default=0)
    lines += [""] + [f"  {k:<{width}}  {_fmt(v):>12}" for k, v in metrics.items()]
    return "\n".join(lines)


def print_table(result: dict, where: Path) -> None:
    print(table(result))
    print(f"\nwritten: {where}")
