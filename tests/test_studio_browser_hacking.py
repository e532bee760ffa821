"""Page 6, reward hacking, in headless Chromium: a finished over-optimization study (its β slider
dragged end to end; the gold peak, the final gains and the samples on screen equal
tether.studio.hacking's reading of the study's files), and a study still being written (the
progress bar equals study_progress; the curves appear once its summary lands, without a reload)."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (the studio extra: pip install -e '.[studio]')")
pytest.importorskip("uvicorn", reason="uvicorn not installed (the studio extra: pip install -e '.[studio]')")

from studio_pages_support import copy_study_unfinished, study_runs  # noqa: E402
from studio_support import assert_no_errors, browser, make_app, open_page, serve, shot, value_of, wait_until  # noqa: E402,F401

pytestmark = [pytest.mark.browser, pytest.mark.slow]  # slow: the default suite keeps the labeler's and runs' pages


def _shows(page, study: dict, beta: str) -> bool:
    v = study["views"][beta]
    return (page.text_content("#beta-value") == beta and value_of(page, "#peak-d") == v["peak_d"]
            and value_of(page, "#peak-gain") == v["peak_gain"] and value_of(page, "#peak-step") == v["peak_step"]
            and value_of(page, "#final-gold") == v["final_gold"] and value_of(page, "#final-proxy") == v["final_proxy"])


def test_hacking_page(tmp_path, tmp_path_factory, browser):  # noqa: F811 - the fixture
    from tether.studio.hacking import beta_view, hack_samples, load_study, study_progress

    src = study_runs(tmp_path_factory) / "overoptimization"
    runs = tmp_path / "runs"
    shutil.copytree(src, runs / "overoptimization", ignore=shutil.ignore_patterns("checkpoints", ".lock"))
    half = copy_study_unfinished(src, runs / "half-done", keep_steps=2)
    study = load_study(runs / "overoptimization")
    study["views"] = {b: beta_view(study, b) for b in study["betas"]}
    with serve(make_app(runs)) as url:
        page = open_page(browser, url + "/hacking")
        page.select_option("#study-pick", "overoptimization")
        wait_until(page, lambda: _shows(page, study, study["betas"][0]), timeout=10, what="the lowest β")
        low = hack_samples(runs / "overoptimization", study["betas"][0])
        wait_until(page, lambda: page.locator("#hack-samples tbody tr").count() == len(low["hack"]), what="hack samples")
        golds = page.eval_on_selector_all("#hack-samples td[data-key='gold'] .num", "es => es.map(e => Number(e.dataset.value))")
        assert golds == [h["gold"] for h in low["hack"]]
        assert page.locator("#optimal-samples tbody tr").count() == len(low["optimal"])
        assert value_of(page, "#bon-r2") == study["bon"]["fit_gold"]["r2"]

        box = page.locator("#beta").bounding_box()  # drag the β slider to its far end
        page.mouse.move(box["x"] + 2, box["y"] + box["height"] / 2)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] - 1, box["y"] + box["height"] / 2, steps=6)
        page.mouse.up()
        wait_until(page, lambda: _shows(page, study, study["betas"][-1]), what="the highest β")
        page.focus("#beta")
        page.keyboard.press("Home")
        wait_until(page, lambda: _shows(page, study, study["betas"][0]), what="back with the keys")
        shot(page, "hacking", tmp_path)
        page.fill("#new-name", "overoptimization")  # "run study" into a name that is taken: refused
        page.click("#start")
        wait_until(page, lambda: "already exists" in page.text_content("#status"), what="the refusal")
        page.errors[:] = [e for e in page.errors if "409 (Conflict)" not in e]  # the browser logs the refusal

        page.select_option("#study-pick", "half-done")
        want = study_progress(half)["fraction"]
        wait_until(page, lambda: page.is_visible("#progress-box") and float(page.get_attribute("#progress", "data-value")) == want,
                   what="progress of the unfinished study")
        assert f"PPO steps {study_progress(half)['ppo_steps']}/" in page.text_content("#progress-text")
        shutil.copyfile(src / "summary.json", half / "summary.json")  # the study finishes
        wait_until(page, lambda: page.is_visible("#study-view") and not page.is_visible("#progress-box"),
                   timeout=5, what="the finished study's curves, live")
        assert_no_errors(page)


def test_pages_on_an_empty_runs_dir(tmp_path, browser):  # noqa: F811 - the fixture
    """Pages 2, 4, 5, 6 with nothing to show: each says so (or works from its own inputs), no error."""
    with serve(make_app(tmp_path / "runs")) as url:
        page = open_page(browser, url + "/hacking")
        wait_until(page, lambda: page.is_visible("#empty"), what="the hacking page's empty state")
        assert not page.is_visible("#study-view")
        page.goto(url + "/stages")
        wait_until(page, lambda: page.is_visible("#empty") and page.is_disabled("#run"), what="the stages page's empty state")
        page.goto(url + "/grpo")  # hand-set rewards need no run
        wait_until(page, lambda: page.locator("#advantages-table tbody tr").count() == 8, what="a hand-set group")
        assert page.is_disabled("#source option[value='samples']") and page.is_disabled("#source option[value='live']")
        page.goto(url + "/algorithms")
        wait_until(page, lambda: page.locator("#memory-bars g.bar").count() >= 1, what="memory bars")
        assert_no_errors(page)
