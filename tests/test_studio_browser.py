"""The Runs page and the preference labeler driven in headless Chromium as a person would: clicks,
keys, the smoothing slider; what is on screen is checked against the Python functions' outputs
(series.ema / downsample, runs.headline, labeler.rm_report), the files the labeler writes are read
by tether dpo's data loader, and a run written in the background shows up live. One Chromium for
the module (studio_support.browser)."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (the studio extra: pip install -e '.[studio]')")
pytest.importorskip("uvicorn", reason="uvicorn not installed (the studio extra: pip install -e '.[studio]')")

from studio_support import (assert_no_errors, browser, make_app, open_page, serve, shot,  # noqa: E402,F401
                            value_of, wait_until)

pytestmark = pytest.mark.browser


def _write_run(d, rows, summary=None, samples=(), extra=""):
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("lr: 0.001\n")
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))
    if samples:
        (d / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))


def test_runs_page(tmp_path, browser):  # noqa: F811 - the fixture
    import torch

    from tether.config import save_config
    from tether.objectives import compute_advantages
    from tether.run import RunDir
    from tether.studio import series
    from tether.trainers.grpo import GRPOConfig

    runs = tmp_path / "runs"
    rng = np.random.default_rng(0)
    steps = list(range(1, 301))
    reward = np.cumsum(rng.normal(0.01, 0.1, size=300))
    kl = np.abs(rng.normal(0.02, 0.01, size=300))
    rows = [{"step": s, "time": s * 0.1, "reward": float(r), "kl": float(k), "loss": float(-r),
             "entropy": 1.5 - s / 400, "lr": 1e-5 * min(1.0, s / 30), "grad_norm": float(abs(r) + 0.5)}
            for s, r, k in zip(steps, reward, kl)]
    samples = []
    for s in (100, 200, 300):  # one group of 5 completions per logged step, with grpo's advantages
        right = rng.random(5) < 0.6
        fmt = rng.random(5) < 0.8
        total = torch.tensor(right * 1.0 + fmt * 0.2)
        adv = compute_advantages("grpo", total, torch.zeros(5, dtype=torch.long))
        samples += [{"step": s, "prompt": f"What is 17 + {s}?", "completion": f" 17 + {s} = {17 + s if ok else 16 + s}",
                     "reward": float(total[i]), "rewards/verifier": float(right[i]), "rewards/format": 0.2 * float(fmt[i]),
                     "advantage": float(adv[i])} for i, ok in enumerate(right)]
    _write_run(runs / "grpo-a", rows, summary={"done": True}, samples=samples)
    _write_run(runs / "grpo-b", rows[:150], extra='{"step": 151, "rew\n')       # failed, a corrupt last line
    for name in ("grpo-a", "grpo-b"):  # the resolved config a grpo run writes: the page names the command
        save_config(GRPOConfig(model="runs/sft/checkpoints/step-200", data="prompts.jsonl"), runs / name / "config.yaml")
    (runs / "no-metrics").mkdir()
    (runs / "no-metrics" / "config.yaml").write_text("lr: 0.1\n")
    _write_run(runs / "custom", [{"step": 1, "my/metric": 3.5}, {"step": 2, "my/metric": 4.25}])  # none of the usual curves
    live = RunDir(runs / "live")                                                # running: holds its lock
    live.log(1, {"reward": 0.0})

    app = make_app(runs)
    with serve(app) as url:
        page = open_page(browser, url + "/runs")
        page.wait_for_selector("#runs tbody tr >> nth=4")
        assert page.locator("#runs tbody tr").count() == 5
        status = {r: page.text_content(f"tr[data-id='{r}'] td[data-key=status]") for r in ("grpo-a", "grpo-b", "no-metrics", "live")}
        assert status == {"grpo-a": "finished", "grpo-b": "failed", "no-metrics": "failed", "live": "running"}
        assert value_of(page, "tr[data-id='grpo-a'] td[data-key=headline] .num") == rows[-1]["reward"]
        assert page.text_content("tr[data-id='grpo-a'] td[data-key=command]") == "grpo"
        assert page.text_content("tr[data-id='grpo-b'] td[data-key=bad_lines]") == "1"  # skipped and counted

        # a run with no metrics yet
        page.click("tr[data-id='no-metrics'] td[data-key=id]")
        page.wait_for_selector("#no-metrics")
        page.click("tr[data-id='custom'] td[data-key=id]")                     # only metrics of its own
        wait_until(page, lambda: value_of(page, ".chart-box[data-metric='my/metric'] .last .num") == 4.25, what="custom")

        # open a run: its curves, last values equal to the file's
        page.click("tr[data-id='grpo-a'] td[data-key=id]")
        page.wait_for_selector(".chart-box[data-metric=reward] svg path.series")
        last = ".chart-box[data-metric=reward] .last[data-run='grpo-a'] .num"
        assert value_of(page, last) == rows[-1]["reward"]
        assert value_of(page, ".chart-box[data-metric=kl] .last .num") == rows[-1]["kl"]
        page.click("#run-detail summary")                                       # its summary.json
        assert page.text_content("#summary td[data-key=key]") == "done"

        # smoothing slider dragged by the mouse to its end (0.99): the server's EMA is what is drawn
        page.locator("#smooth").scroll_into_view_if_needed()
        box = page.locator("#smooth").bounding_box()
        page.mouse.move(box["x"] + 4, box["y"] + box["height"] / 2)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] + 40, box["y"] + box["height"] / 2, steps=8)
        page.mouse.up()
        expect = float(series.ema(reward, 0.99)[-1])
        wait_until(page, lambda: value_of(page, last) == expect,
                   what=f"smoothed curve ({page.input_value('#smooth')}, {value_of(page, last)} vs {expect})")
        assert page.text_content("#smooth-value") == "0.99"
        page.focus("#smooth")
        page.keyboard.press("ArrowLeft")                                         # one step down: 0.98
        wait_until(page, lambda: value_of(page, last) == float(series.ema(reward, 0.98)[-1]), what="0.98")
        page.keyboard.press("Home")
        wait_until(page, lambda: value_of(page, last) == rows[-1]["reward"], what="raw curve again")

        # overlay: tick a second run; every shared curve has one line per run
        page.check("input.pick[data-run='grpo-b']")
        page.wait_for_selector(".chart-box[data-metric=reward] path.series[data-name='grpo-b']")
        assert page.locator(".chart-box[data-metric=reward] path.series").count() == 2
        assert value_of(page, ".chart-box[data-metric=reward] .last[data-run='grpo-b'] .num") == rows[149]["reward"]

        # samples: filter by step, sort by reward (descending on the first click)
        page.select_option("#samples-run", "grpo-a")
        page.wait_for_selector("#samples tbody tr")
        page.select_option("#step-filter", "200")
        wait_until(page, lambda: page.locator("#samples tbody tr").count() == 5, what="step filter")
        assert {page.text_content(c) for c in ["#samples td[data-key=step] >> nth=" + str(i) for i in range(5)]} == {"200"}
        page.click("#samples th[data-key=reward]")
        shown = [float(x) for x in page.eval_on_selector_all("#samples td[data-key=reward] .num", "es => es.map(e => e.dataset.value)")]
        assert shown == sorted((s["reward"] for s in samples if s["step"] == 200), reverse=True)
        shot(page, "runs", tmp_path)

        # live: a run being written shows its new metrics without a reload, within 3 s
        page.click("#runs th[data-key=last_step]")                               # sorted: most steps first
        page.click("tr[data-id='live'] td[data-key=id]")
        page.wait_for_selector(".chart-box[data-metric=reward] .last[data-run='live']")

        def writer():
            for k in range(2, 12):
                live.log(k, {"reward": k / 10, "kl": 0.01 * k})
                time.sleep(0.1)
        th = threading.Thread(target=writer)
        th.start()
        th.join()
        live_last = ".chart-box[data-metric=reward] .last[data-run='live'] .num"
        wait_until(page, lambda: value_of(page, live_last) == 1.1, timeout=3.0, what="live metrics")
        wait_until(page, lambda: page.text_content("tr[data-id='live'] td[data-key=last_step]") == "11", timeout=3.0,
                   what="live last step")
        live.close()
        order = page.eval_on_selector_all("#runs tbody tr", "trs => trs.map(t => t.dataset.id)")
        assert order == ["grpo-a", "grpo-b", "live", "custom", "no-metrics"]     # the sort survived the redraws
        assert_no_errors(page)

        empty = make_app(tmp_path / "empty-runs")
    with serve(empty) as url:
        page = open_page(browser, url + "/runs")
        page.wait_for_selector("#no-runs")
        assert_no_errors(page)


def _gold_key(world, prompt, a, b) -> str:
    ga, gb = world.gold_reward([prompt] * 2, [a, b])
    return "a" if ga > gb else "b" if gb > ga else "s"  # a gold tie is skipped: not a preference


def test_labeler_page(tmp_path, browser):  # noqa: F811 - the fixture
    from tether.studio.labeler import rm_report
    from tether.studio.labeler_store import LabelStore, WorldPairs
    from tether.tasks.preference_world import PreferenceWorld
    from tether.trainers.preference.offline import DPOConfig
    from tether.trainers.preference.data import load_offline_data

    world = PreferenceWorld()
    labels_dir = tmp_path / "labels"
    app = make_app(tmp_path / "runs", labels_dir=str(labels_dir), retrain_every=5)
    with serve(app) as url:
        tab1 = open_page(browser, url + "/labeler")
        tab2 = tab1.context.new_page()  # a second tab of the same browser, labelling at the same time
        tab2.errors = []
        tab2.on("pageerror", lambda e: tab2.errors.append(str(e)))
        tab2.goto(url + "/labeler")
        for tab in (tab1, tab2):
            wait_until(tab, lambda: tab.get_attribute("main", "data-pair-index") not in (None, ""), what="first pair")

        def label(tab, by_click=False):
            idx = tab.get_attribute("main", "data-pair-index")
            key = _gold_key(world, tab.text_content("#prompt"), tab.text_content("#response-a"),
                            tab.text_content("#response-b"))
            if by_click:
                tab.click({"a": "#btn-a", "b": "#btn-b", "s": "#btn-skip"}[key])
            else:
                tab.keyboard.press(key)
            wait_until(tab, lambda: tab.get_attribute("main", "data-pair-index") != idx, what="next pair")
            return key

        assert tab1.get_attribute("main", "data-pair-index") != tab2.get_attribute("main", "data-pair-index")
        # undo: the pair comes back, its label leaves the file
        first = tab1.get_attribute("main", "data-pair-index")
        label(tab1)
        tab1.keyboard.press("u")
        wait_until(tab1, lambda: tab1.get_attribute("main", "data-pair-index") == first, what="undone pair back")
        wait_until(tab1, lambda: value_of(tab1, "#count-labels") == 0, what="count after undo")
        assert (labels_dir / "preferences.jsonl").read_text() == ""

        # a reload keeps the tab's pair and its undo stack (sessionStorage)
        label(tab1)
        shown = tab1.get_attribute("main", "data-pair-index")
        tab1.reload()
        wait_until(tab1, lambda: tab1.get_attribute("main", "data-pair-index") == shown, what="same pair after reload")
        wait_until(tab1, lambda: value_of(tab1, "#count-labels") == 1, what="count after reload")
        tab1.keyboard.press("u")
        wait_until(tab1, lambda: tab1.get_attribute("main", "data-pair-index") == first, what="undo after reload")
        wait_until(tab1, lambda: value_of(tab1, "#count-labels") == 0, what="count after undo")

        n_ab, k = 0, 0
        while n_ab < 20:
            tab = (tab1, tab2)[k % 2]
            n_ab += label(tab, by_click=k % 3 == 0) != "s"
            k += 1
        rows = [json.loads(x) for x in (labels_dir / "preferences.jsonl").read_text().splitlines()]
        assert len(rows) == 20 and all(set(r) == {"prompt", "chosen", "rejected"} for r in rows)
        for r in rows:  # labelled by the gold reward through the browser
            assert world.gold_reward([r["prompt"]] * 2, [r["chosen"], r["rejected"]]) == sorted(
                world.gold_reward([r["prompt"]] * 2, [r["chosen"], r["rejected"]]), reverse=True)
        train, _, paired, _, _ = load_offline_data(
            DPOConfig(model="unused", data=str(labels_dir / "preferences.jsonl"), eval_fraction=0.0), world.tokenizer())
        assert paired and len(train) == 20

        # the background reward model, fitted on the 20 labels: the page shows rm_report's numbers
        wait_until(tab1, lambda: value_of(tab1, "#rm-n-labels") == 20, timeout=30, what="RM fitted on 20 labels")
        expect = rm_report(LabelStore(labels_dir).labels(), WorldPairs(seed=0))
        assert value_of(tab1, "#rm-expected-acc") == expect["world"]["expected_accuracy"]
        assert value_of(tab1, "#rm-bayes-acc") == expect["world"]["bayes_optimal_accuracy"]
        assert value_of(tab1, "#rm-gold-agree") == expect["world"]["gold_agreement"]
        assert value_of(tab1, "#rm-held-acc") == expect["held_out_accuracy"]
        assert tab1.locator("#unseen-table tbody tr").count() == len(expect["unseen"])
        shown = [float(x) for x in tab1.eval_on_selector_all("#unseen-table td[data-key=score_a] .num",
                                                              "es => es.map(e => e.dataset.value)")]
        assert shown == [u["score_a"] for u in expect["unseen"]]
        shot(tab1, "labeler", tmp_path)
        assert_no_errors(tab1)
        assert tab2.errors == []


def test_token_in_the_printed_url_lets_the_browser_in(tmp_path, browser):  # noqa: F811 - the fixture
    app = make_app(tmp_path / "runs", token="t0ken-xyz")
    with serve(app) as url:
        page = open_page(browser, url + "/runs?token=t0ken-xyz")  # the URL `tether studio host=...` prints
        page.wait_for_selector("#no-runs")                         # the page's own API calls carried the cookie
        page.click("#nav-labeler")
        page.wait_for_selector("#response-a:not(:empty)")
        assert_no_errors(page)
        other = open_page(browser, url + "/runs")                  # another browser profile, no token
        assert "missing or wrong token" in other.text_content("body")
