"""The tables of bench/parity.py: per step and metric, tether vs TRL, the agreement rules, the
markdown written to benchmarks/parity/parity.md and the printed summary.
"""
from __future__ import annotations

import json

from parity_common import TOL


# -- table ---------------------------------------------------------------------------------------

def rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def agrees(metric: str, row: dict, c: dict) -> tuple[bool, str]:
    """Whether one step's metric agrees, and under which rule.
    - every metric: relative difference <= 1e-3;
    - DPO rewards/*: beta * (log pi - log pi_ref) is a small difference of two ~100-nat sums, so its
      relative difference is not meaningful near 0: it agrees when the absolute difference is
      <= 1e-3 * beta * |logps| (1e-3 relative on the log-probs it is made of);
    - GRPO loss: agrees when the absolute difference is <= 1e-3 * the step's max |advantage|;
    - DPO rewards/accuracies: a pair whose margin is within 1e-5 of 0 (step 1: the policy is the
      reference) counts as accurate or not by float noise; agrees when both margins are that small.
    """
    if c["rel"] <= TOL:
        return True, "rel"
    if metric.startswith("rewards/") and metric != "rewards/accuracies":
        scale = 0.1 * max(abs(row.get(k, {}).get("tether", 0.0)) for k in ("logps/chosen", "logps/rejected"))
        if c["abs"] <= TOL * scale:
            return True, "abs<=1e-3*beta*|logps|"
    if metric == "loss" and "advantages" in row:
        # GRPO: the loss is a token mean of -ratio * A terms; at a step where they nearly cancel
        # (exactly 0 in exact arithmetic) its relative difference is noise over noise
        if c["abs"] <= TOL * abs(row["advantages"]["trl"]):
            return True, "abs<=1e-3*max|A|"
    if metric == "rewards/accuracies":
        m = row.get("rewards/margins")
        if m and max(abs(m["tether"]), abs(m["trl"])) < 1e-5:
            return True, "tie (|margin| < 1e-5)"
    return False, "differs"


def table(name: str, res: dict) -> dict:
    """Per step and metric: tether, TRL, relative difference, whether it agrees; and the max per metric."""
    steps = []
    trl_by = {r["step"]: r for r in res["trl"]}
    for r in res["tether"]:
        t = trl_by.get(r["step"])
        if t is None:
            continue
        row = {"step": r["step"]}
        for ours, theirs in res["metrics"].items():
            if ours in r and theirs in t:
                row[ours] = {"tether": r[ours], "trl": t[theirs], "rel": rel(r[ours], t[theirs]),
                             "abs": abs(r[ours] - t[theirs])}
        steps.append(row)
    return judge({"trainer": name, "steps": steps, "tokens": res["tokens"], "seconds": res.get("seconds", {}),
                  "metrics": list(res["metrics"])})


def judge(t: dict) -> dict:
    """(Re)compute each step-metric's agreement and the summary fields of one trainer's table."""
    steps, metrics = t["steps"], t.get("metrics") or list(t["max_rel"])
    for s in steps:
        for m in metrics:
            if m in s:
                s[m]["ok"], s[m]["rule"] = agrees(m, s, s[m])
    t["metrics"] = metrics
    t["max_rel"] = {m: max((s[m]["rel"] for s in steps if m in s), default=float("nan")) for m in metrics}
    t["max_abs"] = {m: max((s[m]["abs"] for s in steps if m in s), default=float("nan")) for m in metrics}
    t["failures"] = [{"step": s["step"], "metric": m, **s[m]} for s in steps for m in metrics
                     if m in s and not s[m]["ok"]]
    t["exceptions"] = [{"step": s["step"], "metric": m, "rule": s[m]["rule"]} for s in steps for m in metrics
                       if m in s and s[m]["ok"] and s[m]["rule"] != "rel"]
    t["agree"] = not t["failures"] and t["tokens"]["ids_identical"] and bool(steps)
    return t


def commands(results: list[dict], meta: dict) -> str:
    """The distinct commands that produced these results (a run may redo only some trainers)."""
    seen = []
    for r in results:
        c = r.get("meta", meta)["command"]
        if c not in seen:
            seen.append(c)
    return ", ".join(f"`{c}`" for c in seen)


def markdown(results: list[dict], meta: dict) -> str:
    out = [f"# Parity with TRL {meta['trl']} on SmolLM2-135M-Instruct (CPU, fp32)", "",
           f"{meta['date']} · {meta['host']} · torch {meta['torch']} · transformers {meta['transformers']} · "
           f"{meta['threads']} thread(s) · {commands(results, meta)}", "",
           "Relative difference = |tether − TRL| / max(|tether|, |TRL|), per step.", ""]
    out += ["| trainer | steps | identical tokens | max rel. diff (metric) | agree (1e-3 or the stated rule) "
            "| seconds tether / TRL |", "|---|---|---|---|---|---|"]
    for r in results:
        tok = r["tokens"]
        ident = ("yes" if tok["identical"] else "ids yes, masks **no** (%d sequences)" % tok["n_differing"]
                 if tok["ids_identical"] else f"**no** ({tok['n_differing']} sequences)")
        mx = ", ".join(f"{m} {v:.1e}" for m, v in r["max_rel"].items())
        sec = r.get("seconds") or {}
        st = f"{sec['tether']:.0f} / {sec['trl']:.0f}" if "tether" in sec else ""
        ok = "yes" if r["agree"] else f"**no** ({len(r['failures'])} step-metrics)"
        if r["agree"] and r["exceptions"]:
            ok += f" ({len(r['exceptions'])} by the stated rule)"
        out.append(f"| {r['trainer']} | {len(r['steps'])} | {ident} | {mx} | {ok} | {st} |")
    for r in results:
        out += ["", f"## {r['trainer']}", ""]
        m = r.get("meta", meta)  # the run that produced this trainer's rows
        out += [f"Run: {m['date']} · {m['host']} · torch {m['torch']} · transformers {m['transformers']} · "
                f"TRL {m['trl']} · {m['threads']} thread(s) · `{m['command']}`", ""]
        if not r["tokens"]["identical"]:
            out.append("Token differences (first 20): `" + json.dumps(r["tokens"]["differing"][:20]) + "`")
            out.append("")
        for note in r.get("notes", []):
            out += [f"Note: {note}", ""]
        for e in r.get("exceptions", []):
            out += [f"- step {e['step']} {e['metric']}: agrees by {e['rule']}"]
        for f in r.get("failures", []):
            out += [f"- step {f['step']} {f['metric']}: **differs** (tether {f['tether']:.6g}, TRL {f['trl']:.6g})"]
        if r.get("exceptions") or r.get("failures"):
            out.append("")
        metrics = list(r["max_rel"])
        out.append("| step | " + " | ".join(f"{m} tether | TRL | rel" for m in metrics) + " |")
        out.append("|---|" + "---|---|---|" * len(metrics))
        for s in r["steps"]:
            cells = []
            for m in metrics:
                c = s.get(m)
                cells.append(f"{c['tether']:.6g} | {c['trl']:.6g} | {c['rel']:.1e}" if c else " | | ")
            out.append(f"| {s['step']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def results_section(results: list[dict], meta: dict) -> str:
    """The summary table, one row a trainer (the per-step tables are in benchmarks/parity/)."""
    lines = [f"## Parity with TRL {meta['trl']} — SmolLM2-135M-Instruct, CPU fp32, per step", "",
             f"Date: {meta['date']}. {meta['host']}, torch {meta['torch']}, transformers {meta['transformers']}, "
             f"{meta['threads']} thread(s). Commands: {commands(results, meta)}. Per-step tables: "
             "benchmarks/parity/parity.md; every difference explained in docs/parity.md.", "",
             "| trainer | steps | identical token ids | max rel. diff per metric | agree |", "|---|---:|---|---|---|"]
    for r in results:
        tok = r["tokens"]
        ident = "yes" if tok["identical"] else ("ids yes, masks no" if tok["ids_identical"] else "**no**")
        mx = ", ".join(f"{m} {v:.1e}" for m, v in r["max_rel"].items())
        ok = "yes" if r["agree"] else f"**no** ({len(r['failures'])})"
        if r["agree"] and r.get("exceptions"):
            ok += f" ({len(r['exceptions'])} step-metrics by the stated rule)"
        lines.append(f"| {r['trainer']} | {len(r['steps'])} | {ident} | {mx} | {ok} |")
    return "\n".join(lines) + "\n"
