"""The studio's pages 2, 4, 5, 6 through their API (no browser): training stages, GRPO explorer,
algorithms & memory, reward hacking. Numbers are checked against hand computations, against the
CLI (`tether memory`), and against what the runs themselves recorded (the quickstart's accuracies,
the study's fits)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (the studio extra: pip install -e '.[studio]')")
pytest.importorskip("httpx", reason="httpx not installed (fastapi's TestClient; pip install -e '.[test]')")

from studio_pages_support import copy_study_unfinished, quickstart_runs, study_runs  # noqa: E402
from studio_support import client, make_app  # noqa: E402


def wait(c, url: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = c.get(url).json()
        if job["state"] in ("done", "error") or time.monotonic() > deadline:
            return job
        time.sleep(0.05)


@pytest.fixture(scope="module")
def qs_client(tmp_path_factory):
    return client(make_app(quickstart_runs(tmp_path_factory)))


@pytest.fixture(scope="module")
def study_dir(tmp_path_factory):
    return study_runs(tmp_path_factory)


# ---- empty runs directory: every page answers ----------------------------------------------------

def test_every_page_answers_on_an_empty_runs_dir(tmp_path):
    c = client(make_app(tmp_path / "runs"))
    for page in ("stages", "grpo", "algorithms", "hacking"):
        assert c.get(f"/{page}").status_code == 200
    assert c.get("/api/stages/sources").json()["quickstarts"] == []
    src = c.get("/api/grpo/sources").json()
    assert src["runs"] == [] and src["checkpoints"] == []
    assert c.get("/api/hacking/studies").json()["studies"] == []
    assert c.post("/api/algorithms/explore", json={"size": "1B"}).status_code == 200
    # a run with no files yet, and one with a corrupt samples line
    (tmp_path / "runs" / "fresh").mkdir()
    (tmp_path / "runs" / "fresh" / "config.yaml").write_text("lr: 0.1\n")
    (tmp_path / "runs" / "fresh" / "samples.jsonl").write_text('{"step": 1, "prompt": "p", "completion": "c", "reward": 1}\n{"step": 1, "pro')
    c = client(make_app(tmp_path / "runs"))
    assert c.get("/api/grpo/groups", params={"run": "fresh"}).json()["groups"][0]["rewards"] == [1.0]
    assert c.get("/api/hacking/study", params={"run": "fresh"}).status_code == 404
    assert c.get("/api/stages/sources").json()["quickstarts"] == []


# ---- page 4: GRPO explorer -----------------------------------------------------------------------

def test_grpo_advantages_by_hand(tmp_path):
    c = client(make_app(tmp_path / "runs"))
    r = c.post("/api/grpo/advantages", json={"rewards": [1, 0, 0, 1], "lengths": [3, 1, 1, 1],
                                             "greedy_reward": 0.25}).json()["advantages"]
    a = 0.5 / (0.5 + 1e-6)  # (r - mean) / (population std + eps)
    assert r["grpo"] == pytest.approx([a, -a, -a, a], abs=1e-6)
    assert r["dr_grpo"] == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert r["rloo"] == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], abs=1e-6)  # r_i - mean of the other three
    assert r["remax"] == pytest.approx([0.75, -0.25, -0.25, 0.75])
    # REINFORCE++ whitens the 6 tokens (1,1,1,0,0,1): mean 2/3, population std sqrt(2/9)
    sd = math.sqrt(2 / 9)
    assert r["reinforce_pp"] == pytest.approx([(1 / 3) / sd, -(2 / 3) / sd, -(2 / 3) / sd, (1 / 3) / sd], abs=1e-5)
    scaled = c.post("/api/grpo/advantages", json={"rewards": [1, 0, 0, 1], "scale": "none"}).json()["advantages"]
    assert scaled["grpo"] == pytest.approx([0.5, -0.5, -0.5, 0.5])
    assert c.post("/api/grpo/advantages", json={"rewards": [1, 0], "scale": "bogus"}).status_code == 400


@pytest.mark.parametrize("g", [4, 8, 16, 32])
def test_grpo_advantages_are_the_registry(tmp_path, g):
    """Every group size: the page's numbers are the training registry's, called as a trainer does."""
    import torch

    from tether.objectives import ADVANTAGE_ESTIMATORS, compute_advantages
    from tether.studio.grpo import advantages

    rng = np.random.default_rng(g)
    rewards, lengths = rng.normal(size=g).round(3).tolist(), rng.integers(1, 20, size=g).tolist()
    got = advantages(rewards, lengths, greedy_reward=0.1)
    r = torch.tensor(rewards)
    mask = torch.arange(max(lengths)).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    assert got["grpo"] == compute_advantages("grpo", r, torch.zeros(g, dtype=torch.long), scale="group").tolist()
    assert got["rloo"] == compute_advantages("rloo", r, torch.zeros(g, dtype=torch.long)).tolist()
    assert got["remax"] == compute_advantages("remax", r, None, greedy_rewards=torch.full((g,), 0.1)).tolist()
    tok = ADVANTAGE_ESTIMATORS["reinforce_pp"](r, None, mask)
    assert got["reinforce_pp"] == pytest.approx([float(tok[i, 0]) for i in range(g)], abs=1e-6)
    for i in range(g):  # sequence rewards: every token of a completion has its advantage
        assert torch.allclose(tok[i, :lengths[i]], tok[i, 0])


def test_grpo_surrogate_by_hand(tmp_path):
    c = client(make_app(tmp_path / "runs"))
    s = c.post("/api/grpo/surrogate", json={"advantages": [1, -1], "lengths": [2, 1], "ratio": 1.3,
                                            "eps_low": 0.2}).json()
    assert [row["loss"] for row in s["rows"]] == pytest.approx([-1.2, 1.3])  # -min(rA, clip(r)A)
    assert [(row["clipped_low"], row["clipped_high"]) for row in s["rows"]] == [(False, True), (False, False)]
    assert s["policy_loss"] == pytest.approx((2 * -1.2 + 1.3) / 3)  # token-mean over 3 tokens
    assert s["clip_ratio"]["high_mean"] == pytest.approx(2 / 3) and s["clip_ratio"]["low_mean"] == 0
    s = c.post("/api/grpo/surrogate", json={"advantages": [1, -1], "ratio": 0.7, "eps_low": 0.2, "eps_high": 0.28,
                                            "curve_advantage": -1.0}).json()
    assert [row["loss"] for row in s["rows"]] == pytest.approx([-0.7, 0.8])
    assert [row["clipped_low"] for row in s["rows"]] == [False, True]
    curve = s["curve"]
    for r, obj, clipped in zip(curve["ratio"], curve["objective"], curve["clipped"]):
        assert obj == pytest.approx(min(-r, -min(max(r, 0.8), 1.28)), abs=1e-6)
        assert clipped == (r < 0.8)  # A < 0: the clip binds below 1 - eps_low only
    assert c.post("/api/grpo/surrogate", json={"advantages": [1], "ratio": 0}).status_code == 422


def test_grpo_groups_from_a_run_and_live(qs_client, tmp_path_factory):
    from tether.models import load_model, load_tokenizer
    from tether.rollout import sample
    from tether.run import read_jsonl
    from tether.tasks.arithmetic import check_answer

    c = qs_client
    runs = quickstart_runs(tmp_path_factory)
    src = c.get("/api/grpo/sources").json()
    assert "quickstart/rl" in src["runs"]
    out = c.get("/api/grpo/groups", params={"run": "quickstart/rl"}).json()
    rows = read_jsonl(runs / "quickstart" / "rl" / "samples.jsonl")
    assert sum(len(g["rewards"]) for g in out["groups"]) == len(rows)
    tok = load_tokenizer(str(next((runs / "quickstart" / "rl" / "checkpoints").glob("step-*"))))
    for g in out["groups"]:
        mine = [r for r in rows if r["step"] == g["step"] and r["prompt"] == g["prompt"]]
        assert g["completions"] == [r["completion"] for r in mine] and g["rewards"] == [r["reward"] for r in mine]
        assert g["lengths"] == [len(tok(t, add_special_tokens=False)["input_ids"]) for t in g["completions"]]

    ckpt = next(k for k in src["checkpoints"] if k.startswith("quickstart/sft/"))
    job = c.post("/api/grpo/sample", json={"checkpoint": ckpt, "prompt": "What is 8 - 7?", "answer": "1", "n": 4,
                                           "seed": 3, "max_new_tokens": 32}).json()
    got = wait(c, f"/api/grpo/job/{job['id']}")["result"]
    path = runs / "quickstart" / "sft" / "checkpoints" / ckpt.rsplit("/", 1)[1]
    model, tok = load_model(str(path), dtype="fp32", device="cpu"), load_tokenizer(str(path))
    ro = sample(model, tok, ["What is 8 - 7?"], n=4, seed=3, temperature=1.0, max_new_tokens=32)
    assert got["completions"] == ro.texts
    assert got["rewards"] == [check_answer(t, 1) for t in ro.texts]
    assert got["lengths"] == ro.completion_mask.sum(-1).tolist()
    for bad in ("../../etc", "/etc/passwd", "quickstart/sft/../../x"):
        assert c.post("/api/grpo/sample", json={"checkpoint": bad, "prompt": "x", "answer": "1"}).status_code == 404
        assert c.get("/api/grpo/groups", params={"run": bad}).status_code == 404


# ---- page 5: algorithms and memory ---------------------------------------------------------------

def _cli_memory(*args) -> dict:
    from tether.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["memory", *args, "format=json"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("body,args", [
    ({"size": "7B", "algo": "ppo"}, ["model=7B", "algo=ppo"]),
    ({"size": "70B", "algo": "grpo", "lora": True, "gradient_checkpointing": True},
     ["model=70B", "algo=grpo", "lora=true", "gradient_checkpointing=true"]),
    ({"size": "13B", "algo": "dpo", "gpus": 4}, ["model=13B", "algo=dpo", "gpus=4"]),
    ({"size": "1B", "algo": "kto", "gpus": 2, "sharding": "replicate"}, ["model=1B", "algo=kto", "gpus=2", "sharding=replicate"]),
    ({"size": "7B", "algo": "simpo", "gpus": 8}, ["model=7B", "algo=simpo", "gpus=8", "sharding=fsdp", "grad_accum=2"]),
])
def test_memory_equals_the_cli(tmp_path, body, args):
    c = client(make_app(tmp_path / "runs"))
    r = c.post("/api/algorithms/explore", json=body).json()
    assert r["estimate"] == _cli_memory(*args)
    assert _cli_memory(*r["command"].split()[2:]) == r["estimate"]  # the command the page prints
    for bar in r["bars"]:
        assert bar["adds_up"]
        assert bar["total_gb"] == r["estimate"]["totals_bytes"][bar["total_key"]] / 1e9
    assert r["peak_gb"] == r["estimate"]["totals_gb"]["peak"]
    assert r["fits"] == {str(m): r["peak_gb"] <= m for m in (12, 24, 40, 80, 141)}


def test_memory_from_a_pasted_hf_config_equals_the_cli(tmp_path):
    config = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 6,
              "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000, "tie_word_embeddings": False}
    d = tmp_path / "cfg"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    c = client(make_app(tmp_path / "runs"))
    r = c.post("/api/algorithms/explore", json={"hf_config": json.dumps(config), "algo": "dpo", "lora": True}).json()
    cli = _cli_memory(f"model={d}", "algo=dpo", "lora=true")
    for est in (r["estimate"], cli):
        est.pop("model"), est["config"].pop("model")
    assert r["estimate"] == cli
    bad = c.post("/api/algorithms/explore", json={"hf_config": "{not json"})
    assert bad.status_code == 400 and "not JSON" in bad.json()["detail"]


def test_memory_bars_add_up_for_every_algorithm_and_option():
    from tether.studio.algorithms import explore

    for algo in ("sft", "rm", "dpo", "kto", "simpo", "orpo", "ppo", "grpo", "rloo"):
        for opts in ({}, {"lora": True}, {"gradient_checkpointing": True, "gpus": 4},
                     {"gpus": 2, "sharding": "replicate"}):
            out = explore("7B", options={"algo": algo, **opts})
            assert all(b["adds_up"] for b in out["bars"]), (algo, opts)
            assert max(b["total_gb"] for b in out["bars"]) == pytest.approx(out["peak_gb"]), (algo, opts)


def test_algorithm_cards(tmp_path):
    c = client(make_app(tmp_path / "runs"))
    cards = {k["algo"]: k for k in c.post("/api/algorithms/explore", json={"size": "7B"}).json()["cards"]}
    assert list(cards) == ["ppo", "dpo", "grpo", "kto", "simpo", "orpo"]
    held = {a: [(m["name"], m["trained"]) for m in k["models"]] for a, k in cards.items()}
    assert held["ppo"] == [("policy", True), ("reference", False), ("reward model", False), ("value model", True)]
    assert held["dpo"] == held["kto"] == [("policy", True), ("reference", False)]
    assert held["simpo"] == held["orpo"] == [("policy", True)]
    assert {a for a, k in cards.items() if k["online"]} == {"ppo", "grpo"}
    assert cards["dpo"]["data"] == [{"format": "preference", "columns": ["prompt", "chosen", "rejected"]}]
    assert cards["kto"]["data"][0]["columns"] == ["prompt", "completion", "label"]
    assert "Ethayarajh et al. 2024" in cards["kto"]["objectives"][0]["summary"]
    lora = {k["algo"]: k for k in c.post("/api/algorithms/explore", json={"size": "7B", "lora": True}).json()["cards"]}
    assert [m["name"] for m in lora["dpo"]["models"]] == ["policy"]  # the reference is the base, adapters off
    assert c.post("/api/algorithms/explore", json={"size": "../../etc"}).status_code == 400


# ---- page 6: reward hacking ----------------------------------------------------------------------

def test_gao_curves_reproduce_the_studys_fits():
    """The committed study (benchmarks/overoptimization): the page's fitted curves, evaluated at the
    study's own points, give back the R² the study fitted."""
    from pathlib import Path

    from tether.studio.hacking import gao_curve

    s = json.loads((Path(__file__).parents[1] / "benchmarks" / "overoptimization" / "summary.json").read_text())

    def r2(y, pred):
        y, pred = np.asarray(y), np.asarray(pred)
        return 1 - ((y - pred) ** 2).sum() / ((y - y.mean()) ** 2).sum()

    for c in s["ppo"].values():
        assert r2(c["gold"], gao_curve(c["fit"], c["d"])) == pytest.approx(c["fit"]["r2"], abs=1e-9)
    b = s["bon"]
    assert r2(b["gold"], gao_curve(b["fit_gold"], b["d"])) == pytest.approx(b["fit_gold"]["r2"], abs=1e-9)
    assert r2(b["proxy"], gao_curve(b["fit_proxy"], b["d"])) == pytest.approx(b["fit_proxy"]["r2"], abs=1e-9)


def test_hacking_study_view_and_samples(study_dir):
    from tether.run import read_jsonl
    from tether.tasks.preference_world import PreferenceWorld

    c = client(make_app(study_dir))
    assert {"run": "overoptimization", "state": "done"} in c.get("/api/hacking/studies").json()["studies"]
    s = c.get("/api/hacking/study", params={"run": "overoptimization"}).json()
    summary = json.loads((study_dir / "overoptimization" / "summary.json").read_text())
    assert s["betas"] == sorted(summary["ppo"], key=float)
    for b, view in s["views"].items():
        p = summary["ppo"][b]
        assert (view["peak_d"], view["peak_gain"], view["peak_step"]) == (p["gold_peak_d"], p["gold_peak_gain"], p["gold_peak_step"])
        assert (view["final_gold"], view["final_proxy"]) == (p["gold_final_gain"], p["proxy_final_gain"])
        assert s["ppo"][b]["d"] == p["d"] and s["ppo"][b]["gold"] == p["gold"]
    assert s["best_beta"] == max(summary["ppo"], key=lambda b: summary["ppo"][b]["gold_peak_gain"])

    world = PreferenceWorld(**summary["world"])
    low = s["betas"][0]
    out = c.get("/api/hacking/samples", params={"run": "overoptimization"}).json()
    rows = read_jsonl(study_dir / "overoptimization" / f"ppo_beta{low}" / "samples.jsonl")
    last = max(r["step"] for r in rows)
    assert out["beta"] == low and out["hack_step"] == last
    assert [h["completion"] for h in out["hack"]] == [r["completion"] for r in rows if r["step"] == last][:8]
    for h in out["hack"] + out["optimal"]:
        assert h["gold"] == world.gold_reward([h["prompt"]], [h["completion"]])[0]
        assert h["length"] == len(h["completion"].split())
    assert c.get("/api/hacking/samples", params={"run": "overoptimization", "beta": "../x"}).status_code == 404
    assert c.get("/api/hacking/study", params={"run": "overoptimization/rm"}).status_code == 404


def test_hacking_progress_of_an_unfinished_study(study_dir, tmp_path):
    import yaml

    runs = tmp_path / "runs"
    copy_study_unfinished(study_dir / "overoptimization", runs / "half", keep_steps=2)
    c = client(make_app(runs))
    s = c.get("/api/hacking/study", params={"run": "half"}).json()
    summary = json.loads((study_dir / "overoptimization" / "summary.json").read_text())
    steps = yaml.safe_load((runs / "half" / "config.yaml").read_text())["ppo_steps"]
    assert s["status"] == "running" and s["state"] == "stopped"  # nobody is writing it
    assert s["progress"]["ppo_steps"] == steps * (len(summary["ppo"]) - 1) + 2
    assert s["progress"]["world"] and s["progress"]["rm"] and 0 < s["progress"]["fraction"] < 1


@pytest.mark.slow
def test_hacking_runs_a_study_from_the_page(tmp_path):
    c = client(make_app(tmp_path / "runs"))
    r = c.post("/api/hacking/start", json={"name": "mine", "n_pairs": 40, "betas": [0.01], "ppo_steps": 2,
                                           "bon_max_n": 2})
    assert r.status_code == 200
    assert c.post("/api/hacking/start", json={"name": "mine"}).status_code == 409
    deadline, seen = time.monotonic() + 600, set()
    while time.monotonic() < deadline:
        s = c.get("/api/hacking/study", params={"run": "mine"}).json()
        seen.add(s["status"])
        if s["status"] == "done" or s["state"] == "failed":
            break
        time.sleep(1)
    assert s["status"] == "done" and "running" in seen
    assert s["betas"] == ["0.01"]


# ---- page 2: training stages ---------------------------------------------------------------------

def test_stages_accuracy_is_the_quickstarts(qs_client, tmp_path_factory):
    """Every held-out problem, each stage: the page's accuracy is the one the quickstart printed."""
    c = qs_client
    runs = quickstart_runs(tmp_path_factory)
    summary = json.loads((runs / "quickstart" / "summary.json").read_text())
    src = c.get("/api/stages/sources").json()
    q = next(x for x in src["quickstarts"] if x["run"] == "quickstart")
    assert [s["stage"] for s in q["stages"]] == ["pretrain", "sft", "rl"]
    n = summary["n_test"]
    job = c.post("/api/stages/answer", json={"checkpoints": [s["checkpoint"] for s in q["stages"]],
                                             "labels": [s["stage"] for s in q["stages"]], "run": "quickstart",
                                             "count": n}).json()
    job = wait(c, f"/api/stages/job/{job['id']}", timeout=300)
    assert job["state"] == "done", job["error"]
    for stage in job["partial"]:
        assert stage["accuracy"] == summary["stages"][stage["stage"]]["accuracy"]
        assert stage["misses"] == summary["stages"][stage["stage"]]["misses"]
        assert stage["accuracy"] == sum(a["correct"] for a in stage["answers"]) / n


def test_stages_answers_and_diff(qs_client, tmp_path_factory):
    import yaml

    from tether.tasks.arithmetic import check_answer, make_splits

    c = qs_client
    runs = quickstart_runs(tmp_path_factory)
    cfg = yaml.safe_load((runs / "quickstart" / "config.yaml").read_text())
    test = make_splits(cfg["n_train"], cfg["n_test"], cfg["level"], cfg["seed"])[1][:5]
    q = c.get("/api/stages/sources").json()["quickstarts"][0]
    a, b = q["stages"][0]["checkpoint"], q["stages"][1]["checkpoint"]
    job = wait(c, "/api/stages/job/" + c.post("/api/stages/answer", json={"checkpoints": [a, b], "run": "quickstart",
                                                                           "count": 5}).json()["id"])
    first, second = job["partial"]
    assert [x["prompt"] for x in first["answers"]] == [p.prompt for p in test]
    assert [x["correct"] for x in second["answers"]] == [bool(check_answer(x["completion"], p.answer))
                                                          for x, p in zip(second["answers"], test)]
    d = c.post("/api/stages/diff", json={"checkpoint": a, "other": b, "run": "quickstart", "count": 5}).json()
    for row, x, y in zip(d["rows"], first["answers"], second["answers"]):
        # the diff's equal + delete segments are stage a's words, equal + insert stage b's
        assert " ".join(s["text"] for s in row["diff"] if s["op"] != "insert") == x["completion"]
        assert " ".join(s["text"] for s in row["diff"] if s["op"] != "delete") == y["completion"]
    assert c.post("/api/stages/answer", json={"checkpoints": [a], "run": "quickstart/sft"}).status_code == 404
    assert c.post("/api/stages/answer", json={"checkpoints": ["/etc"]}).status_code == 404


def test_diff_words_by_hand():
    from tether.studio.stages import diff_words

    assert diff_words("a b c", "a x c") == [{"op": "equal", "text": "a"}, {"op": "delete", "text": "b"},
                                            {"op": "insert", "text": "x"}, {"op": "equal", "text": "c"}]
    assert diff_words("same", "same") == [{"op": "equal", "text": "same"}]


def test_the_studios_model_is_a_checkpoint_to_sample(tmp_path, tmp_path_factory):
    """`tether studio model=<dir>`: the live pages offer it as "model" (and never a path from a request)."""
    runs = quickstart_runs(tmp_path_factory)
    sft = sorted((runs / "quickstart" / "sft" / "checkpoints").glob("step-*"))[-1]
    c = client(make_app(tmp_path / "runs", model=str(sft)))
    assert c.get("/api/grpo/sources").json()["checkpoints"] == ["model"]
    assert c.get("/api/stages/sources").json()["checkpoints"] == ["model"]
    job = c.post("/api/grpo/sample", json={"checkpoint": "model", "prompt": "What is 8 - 7?", "answer": "1", "n": 2,
                                           "max_new_tokens": 8}).json()
    assert wait(c, f"/api/grpo/job/{job['id']}")["state"] == "done"
    assert c.post("/api/grpo/sample", json={"checkpoint": str(sft), "prompt": "x", "answer": "1"}).status_code == 404
