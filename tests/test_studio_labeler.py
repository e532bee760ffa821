"""The preference labeler's server side without a browser: TRL rows, ties apart, undo, two tabs at
once, the Bradley–Terry model and its report, pairs sampled live from a model, tether dpo's loader
reading the file."""

from __future__ import annotations

import json
import math
import threading

import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (the studio extra: pip install -e '.[studio]')")
pytest.importorskip("httpx", reason="httpx not installed (fastapi's TestClient; pip install -e '.[test]')")

from studio_support import client, make_app  # noqa: E402


# ---- the labeler ---------------------------------------------------------------------------------

def _gold_choice(world, pair):
    ga, gb = world.gold_reward([pair["prompt"]] * 2, [pair["a"], pair["b"]])
    return "a" if ga > gb else "b" if gb > ga else "tie"


def test_labels_make_trl_rows_ties_apart_and_undo(tmp_path):
    from tether.tasks.preference_world import PreferenceWorld

    world = PreferenceWorld()
    c = client(make_app(tmp_path / "runs", retrain_every=1000))
    expect_pref, expect_ties, ids = [], [], []
    for _ in range(12):
        p = c.post("/api/labeler/next", json={"session": "t"}).json()["pair"]
        assert "gold_a" not in p                                       # the person never sees gold
        ch = _gold_choice(world, p)
        ids.append(c.post("/api/labeler/label", json={"session": "t", "index": p["index"], "choice": ch}).json()["id"])
        if ch == "tie":
            expect_ties.append({"prompt": p["prompt"], "response_a": p["a"], "response_b": p["b"]})
        else:
            w, l_ = (p["a"], p["b"]) if ch == "a" else (p["b"], p["a"])
            expect_pref.append({"prompt": p["prompt"], "chosen": w, "rejected": l_})
    out = tmp_path / "runs" / "studio-labels"
    read = lambda f: [json.loads(x) for x in (out / f).read_text().splitlines()]  # noqa: E731
    assert read("preferences.jsonl") == expect_pref and read("ties.jsonl") == expect_ties
    r = c.post("/api/labeler/undo", json={"session": "t", "id": ids[-1]}).json()
    assert r["counts"]["labels"] == 11 and r["pair"]["index"] == 11   # the undone pair comes back
    assert read("preferences.jsonl") + read("ties.jsonl") != expect_pref + expect_ties
    assert len(read("preferences.jsonl")) + len(read("ties.jsonl")) == 11
    assert c.post("/api/labeler/undo", json={"session": "t", "id": ids[-1]}).status_code == 404
    assert c.post("/api/labeler/next", json={"session": "t"}).json()["pair"]["index"] == 11  # still on screen
    assert c.get("/api/labeler/mine", params={"session": "t"}).json()["ids"] == ids[:-1]
    assert c.post("/api/labeler/label", json={"session": "t", "index": 3, "choice": "maybe"}).status_code == 400


def test_concurrent_tabs_lose_no_label(tmp_path):
    c = client(make_app(tmp_path / "runs", retrain_every=1000))
    seen, errors = [], []

    def tab(name):
        try:
            for _ in range(15):
                p = c.post("/api/labeler/next", json={"session": name}).json()["pair"]
                seen.append(p["index"])
                r = c.post("/api/labeler/label", json={"session": name, "index": p["index"], "choice": "a"})
                assert r.status_code == 200
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=tab, args=(f"tab{i}",)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    assert sorted(seen) == list(range(60))                             # no pair handed to two tabs
    rows = (tmp_path / "runs" / "studio-labels" / "preferences.jsonl").read_text().splitlines()
    assert len(rows) == 60 and all(json.loads(r)["chosen"] for r in rows)


def test_bt_model_learns_the_world_and_the_report_is_reproducible(tmp_path):
    from tether.studio.labeler import rm_report, split_labels
    from tether.studio.labeler_bt import fit_bt, pair_accuracy
    from tether.studio.labeler_store import LabelStore, WorldPairs

    src, store = WorldPairs(seed=0), LabelStore(tmp_path / "labels")
    for i in range(60):
        p = src.pair(i)
        store.add(p, _gold_choice(src.world, p), "s")
    labels = store.labels()
    train, held = split_labels(labels)
    ab = [e for e in labels if e["choice"] in ("a", "b")]
    assert held == ab[4::5] and len(train) + len(held) == len(ab)
    rep = rm_report(labels, src)
    assert rep == rm_report(labels, src)                               # deterministic: a test can recompute it
    w = rep["world"]
    assert w["bayes_optimal_accuracy"] > w["expected_accuracy"] > 0.7  # learns the pattern, below the ceiling
    assert w["gold_agreement"] > 0.75
    assert 0 <= rep["held_out_accuracy"] <= 1 and rep["n_held_out"] == len(held)
    # BT fit by hand on a separable toy: "good" words win
    m = fit_bt(["good good", "good"], ["bad", "bad bad"])
    assert m.score("good") > m.score("bad") and pair_accuracy(m, ["good"], ["bad"]) == 1.0
    assert math.isnan(fit_bt([], []).train_loss)


def test_dpo_reads_the_labelers_file(tmp_path):
    from tether.studio.labeler_store import LabelStore, WorldPairs
    from tether.trainers.preference.offline import DPOConfig
    from tether.trainers.preference.data import load_offline_data

    src, store = WorldPairs(seed=3), LabelStore(tmp_path / "labels")
    n = 0
    for i in range(30):
        p = src.pair(i)
        ch = _gold_choice(src.world, p)
        store.add(p, ch, "s")
        n += ch != "tie"
    train, _, paired, _, _ = load_offline_data(
        DPOConfig(model="unused", data=str(store.preferences), eval_fraction=0.0), src.world.tokenizer())
    assert paired and len(train) == n


def test_pairs_sampled_live_from_a_model_at_two_temperatures(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from tether.models import load_model, load_tokenizer
    from tether.models.tiny import tiny_config
    from tether.rollout import sample
    from tether.studio.labeler_store import ModelPairs
    from tether.tasks.preference_world import PreferenceWorld

    world = PreferenceWorld()
    tok = world.tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(len(tok), hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                                         intermediate_size=32, max_position_embeddings=64,
                                                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                                         pad_token_id=tok.pad_token_id))
    model.save_pretrained(tmp_path / "policy")
    tok.save_pretrained(tmp_path / "policy")
    c = client(make_app(tmp_path / "runs", label_source="model", model=str(tmp_path / "policy"),
                        label_temperatures=[0.5, 2.0], retrain_every=1000))
    p = c.post("/api/labeler/next", json={"session": "s"}).json()["pair"]
    src = ModelPairs(str(tmp_path / "policy"), [0.5, 2.0])
    m, t = load_model(str(tmp_path / "policy"), dtype="fp32", device="cpu"), load_tokenizer(str(tmp_path / "policy"), padding_side="left")
    expect = {sample(m, t, [p["prompt"]], n=1, seed=src.sample_seed("train", 0, k), temperature=temp,
                     max_new_tokens=world.max_new_tokens).texts[0] for k, temp in enumerate([0.5, 2.0])}
    assert p["index"] == 0 and {p["a"], p["b"]} == expect and p["prompt"] in world.prompts(None, split="train")
    assert src.pair(0)["gold_a"] == world.gold_reward([p["prompt"]], [src.pair(0)["a"]])[0]
    c.post("/api/labeler/label", json={"session": "s", "index": 0, "choice": "b"})
    row = json.loads((tmp_path / "runs" / "studio-labels" / "preferences.jsonl").read_text())
    assert row == {"prompt": p["prompt"], "chosen": p["b"], "rejected": p["a"]}
    assert make_app(tmp_path / "r2", label_source="model") and client(make_app(tmp_path / "r2", label_source="model")) \
        .post("/api/labeler/next", json={"session": "s"}).status_code == 400  # no model= : one clear error


def test_pairs_from_a_preference_file_and_a_prompt_completion_file(tmp_path):
    from tether.studio.labeler_store import FilePairs

    pref = tmp_path / "pref.jsonl"
    pref.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": f"good{i}", "rejected": f"bad{i}"}) + "\n"
                            for i in range(40)))
    src = FilePairs(str(pref), seed=0)
    sides = [src.pair(i)["a"].startswith("good") for i in range(40)]
    assert 5 < sum(sides) < 35                                  # the chosen response is not always A
    assert all({src.pair(i)["a"], src.pair(i)["b"]} == {f"good{i}", f"bad{i}"} for i in range(40))
    pc = tmp_path / "pc.jsonl"
    rows = [{"prompt": "p1", "completion": "x"}, {"prompt": "p2", "completion": "u"}, {"prompt": "p1", "completion": "y"},
            {"prompt": "p1", "completion": "z"}, {"prompt": "p2", "completion": "v"}]
    pc.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = [(p["prompt"], p["a"], p["b"]) for p in (FilePairs(str(pc)).pair(i) for i in range(2))]
    assert got == [("p1", "x", "y"), ("p2", "u", "v")] and len(FilePairs(str(pc))) == 2  # z has no partner
    c = client(make_app(tmp_path / "runs", label_source=str(pref), retrain_every=1000))
    p = c.post("/api/labeler/next", json={"session": "s"}).json()["pair"]
    good = "a" if p["a"].startswith("good") else "b"
    c.post("/api/labeler/label", json={"session": "s", "index": p["index"], "choice": good})
    row = json.loads((tmp_path / "runs" / "studio-labels" / "preferences.jsonl").read_text())
    assert row == {"prompt": "q0", "chosen": "good0", "rejected": "bad0"}
    single = tmp_path / "single.jsonl"
    single.write_text(json.dumps({"prompt": "p", "completion": "only one"}) + "\n")
    r = client(make_app(tmp_path / "r3", label_source=str(single))).post("/api/labeler/next", json={"session": "s"})
    assert r.status_code == 400 and "no pairs" in r.json()["detail"]


def test_a_tab_keeps_its_pair_and_other_tabs_get_others(tmp_path):
    c = client(make_app(tmp_path / "runs", retrain_every=1000))
    nxt = lambda s: c.post("/api/labeler/next", json={"session": s}).json()["pair"]["index"]  # noqa: E731
    assert nxt("one") == 0 and nxt("one") == 0                        # a reload shows the same pair
    assert nxt("two") == 1 and nxt("three") == 2
    c.post("/api/labeler/label", json={"session": "two", "index": 1, "choice": "skip"})
    assert nxt("two") == 3 and nxt("one") == 0                        # skipped counts as done
    lid = c.post("/api/labeler/label", json={"session": "one", "index": 0, "choice": "a"}).json()["id"]
    assert nxt("one") == 4
    c.post("/api/labeler/undo", json={"session": "one", "id": lid})
    assert nxt("one") == 0 and nxt("four") == 4                       # 4 went back to the pool
    assert c.get("/api/labeler/mine", params={"session": "one"}).json()["ids"] == []


def test_another_sources_labels_do_not_hide_this_sources_pairs(tmp_path):
    labels = tmp_path / "labels"
    c = client(make_app(tmp_path / "runs", labels_dir=str(labels), seed=0, retrain_every=1000))
    for _ in range(3):
        p = c.post("/api/labeler/next", json={"session": "s"}).json()["pair"]
        c.post("/api/labeler/label", json={"session": "s", "index": p["index"], "choice": "a"})
    c2 = client(make_app(tmp_path / "runs", labels_dir=str(labels), seed=1, retrain_every=1000))  # other pairs
    assert c2.post("/api/labeler/next", json={"session": "s2"}).json()["pair"]["index"] == 0
    assert c2.get("/api/labeler/state").json()["counts"]["labels"] == 3   # the file keeps every label

