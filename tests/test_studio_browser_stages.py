"""Page 2, training stages, in headless Chromium: pick the quickstart, type how many problems,
answer; each stage's bar equals tether.studio.stages.answer (the quickstart's own scoring) on the
same held-out problems; a click on a bar lists that stage's answers, a click on a second diffs them."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (the studio extra: pip install -e '.[studio]')")
pytest.importorskip("uvicorn", reason="uvicorn not installed (the studio extra: pip install -e '.[studio]')")

from studio_pages_support import quickstart_runs  # noqa: E402
from studio_support import assert_no_errors, browser, make_app, open_page, serve, shot, value_of, wait_until  # noqa: E402,F401

pytestmark = pytest.mark.browser


def test_stages_page(tmp_path, tmp_path_factory, browser):  # noqa: F811 - the fixture
    from tether.studio.stages import answer, held_out, quickstart_chain

    runs = quickstart_runs(tmp_path_factory)
    chain = quickstart_chain(runs / "quickstart")
    problems = held_out(chain["split"], 10)
    want = {s["stage"]: answer(str(s["checkpoint"]), problems, chain["max_new_tokens"]) for s in chain["stages"]}
    with serve(make_app(runs)) as url:
        page = open_page(browser, url + "/stages")
        wait_until(page, lambda: page.input_value("#chain-pick") == "quickstart", what="the quickstart chain")
        page.fill("#count", "")
        page.type("#count", "10")
        page.click("#run")
        bars = "#stage-bars g.bar"
        wait_until(page, lambda: page.locator(bars).count() == 3 and "3 stages" in page.text_content("#progress"),
                   timeout=60, what="three stages answered")
        for stage, out in want.items():
            assert float(page.get_attribute(f"{bars}[data-label='{stage}']", "data-value")) == out["accuracy"]
            assert value_of(page, f"#stage-table tr[data-id='{stage}'] td[data-key='accuracy'] .num") == out["accuracy"]

        page.click(f"{bars}[data-label='sft']")
        wait_until(page, lambda: page.locator("#answers-table tbody tr").count() == 10, what="sft's answers")
        shown = page.eval_on_selector_all("#answers-table tbody td[data-key='completion'] pre", "es => es.map(e => e.textContent)")
        assert shown == [a["completion"] for a in want["sft"]["answers"]]

        # a second stage: the diff (its name under the bar: a 0-accuracy bar has no height to click)
        page.locator(f"{bars}[data-label='pretrain'] text").first.click()
        wait_until(page, lambda: page.locator("#diff-table tbody tr").count() == 10, what="the diff")
        assert "sft → pretrain" in page.text_content("#detail-title")
        changed = sum(a["completion"] != b["completion"] for a, b in zip(want["sft"]["answers"], want["pretrain"]["answers"]))
        assert page.locator("#diff-table pre.diff:has(del), #diff-table pre.diff:has(ins)").count() == changed
        for stage in want:  # next to it, what the quickstart itself recorded on all its problems
            assert value_of(page, f"#stage-table tr[data-id='{stage}'] td[data-key='recorded'] .num") == next(
                s["accuracy"] for s in chain["stages"] if s["stage"] == stage)
        shot(page, "stages", tmp_path)

        # a chain the user lists: the rl and sft checkpoints, on the quickstart's default split
        from tether.studio.stages import default_split

        ids = page.eval_on_selector_all("#ckpt-pick option", "os => os.map(o => o.value)")
        mine = [next(i for i in ids if i.startswith(f"quickstart/{s}/")) for s in ("rl", "sft")]
        page.select_option("#chain-pick", "__custom__")
        for ckpt in mine:
            page.select_option("#ckpt-pick", ckpt)
            page.click("#ckpt-add")
        assert page.text_content("#chain-list") == " → ".join(mine)
        page.fill("#count", "5")
        page.click("#run")
        wait_until(page, lambda: page.locator(bars).count() == 2 and "2 stages" in page.text_content("#progress"),
                   timeout=60, what="the listed chain")
        problems = held_out(default_split(), 5)
        for ckpt in mine:
            path = runs / "quickstart" / ckpt.split("/")[1] / "checkpoints" / ckpt.split("/")[2]
            assert float(page.get_attribute(f"{bars}[data-label='{ckpt}']", "data-value")) == answer(str(path), problems)["accuracy"]
        assert_no_errors(page)
