"""The Episodes page in headless Chromium, on a fabricated run whose segments are known
(test_studio_episodes.write_episode_run): the trained and masked segments drawn in order with
their classes and texts, per turn and as one piece; the tool call marked; the per-turn rewards,
the finish reason, the counts; another sample, another step; the Runs page's link to the page."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (the studio extra: pip install -e '.[studio]')")
pytest.importorskip("uvicorn", reason="uvicorn not installed (the studio extra: pip install -e '.[studio]')")

from studio_support import assert_no_errors, browser, make_app, open_page, serve, shot, value_of, wait_until  # noqa: E402,F401
from test_studio_episodes import CALL, CUT, ERROR_REPLY, GUESS, MISSING, SOLVED, write_episode_run  # noqa: E402

pytestmark = pytest.mark.browser


def _segments(page, selector: str) -> list[tuple[str, str]]:
    """(class of the segment: trained / masked, its text) of every segment under `selector`, in order."""
    return page.eval_on_selector_all(
        f"{selector} .seg", "els => els.map(e => [e.classList.contains('trained') ? 'trained' "
                            ": e.classList.contains('masked') ? 'masked' : '?', e.textContent])")


def _as_drawn(segments) -> list[list[str]]:
    return [["trained" if kind == "model" else "masked", text] for kind, text in segments]


def test_episodes_page(tmp_path, browser):  # noqa: F811 - the fixture
    runs = tmp_path / "runs"
    write_episode_run(runs)
    with serve(make_app(runs)) as url:
        page = open_page(browser, url + "/episodes")
        wait_until(page, lambda: page.locator("#stream .seg").count() == 3, what="the newest step's first episode")
        assert page.input_value("#run-pick") == "calc" and page.input_value("#step-pick") == "3"
        assert page.locator("#episodes tbody tr").count() == 2
        assert page.locator("#episodes tbody tr.selected").get_attribute("data-id") == "0"

        # the completion as trained, in order: trained, masked, trained
        assert _segments(page, "#stream") == _as_drawn(SOLVED["segments"])
        # turn by turn: the model's tokens then the environment's, beside the transcript
        assert page.locator("#turns .turn").count() == 2
        assert _segments(page, "#turns .turn[data-turn='1'] pre.tokens") == _as_drawn(SOLVED["segments"][:2])
        assert _segments(page, "#turns .turn[data-turn='2'] pre.tokens") == _as_drawn(SOLVED["segments"][2:])
        assert page.text_content("#turns .turn[data-turn='1'] mark.call") == CALL
        assert page.text_content("#turns .turn[data-turn='1'] ul.calls") == 'mul(a=17, b=23)'
        assert page.text_content("#turns .turn[data-turn='1'] .msg.tool .role") == "tool · mul"
        assert page.text_content("#turns .turn[data-turn='1'] .msg.tool .content") == "391"
        assert page.text_content("#context .msg.user .content") == SOLVED["prompt"]
        # a trained segment looks different from a masked one
        trained_bg = page.eval_on_selector("#stream .seg.trained", "e => getComputedStyle(e).backgroundColor")
        masked_bg = page.eval_on_selector("#stream .seg.masked", "e => getComputedStyle(e).backgroundColor")
        assert trained_bg != masked_bg
        assert page.locator("#legend .seg.trained").count() == 1 and page.locator("#legend .seg.masked").count() == 1

        # rewards, advantage, finish reason, counts
        assert value_of(page, "#turn-reward-1") == 0.0 and value_of(page, "#turn-reward-2") == 1.0
        listed = page.eval_on_selector_all("#ep-turn-rewards .turn-reward", "es => es.map(e => e.dataset.value)")
        assert [float(v) for v in listed] == [0.0, 1.0]
        assert value_of(page, "#ep-reward") == SOLVED["reward"] and value_of(page, "#ep-advantage") == SOLVED["advantage"]
        assert value_of(page, "#ep-env-reward") == 1.0 and value_of(page, ".fn-reward[data-fn='env_reward']") == 1.0
        assert page.text_content("#ep-finish") == "done"
        assert page.text_content("#ep-finish-why") == "the environment ended the episode"
        assert [value_of(page, s) for s in ("#ep-turns", "#ep-tool-calls", "#ep-tool-errors")] == [2, 1, 0]
        shot(page, "episodes", tmp_path)
        assert (tmp_path / "episodes.png").stat().st_size > 10_000

        # the second sample: a failed call, then a turn the token budget cut
        page.click("#episodes tbody tr[data-id='1']")
        wait_until(page, lambda: page.text_content("#ep-finish") == "length", what="the cut episode")
        assert _segments(page, "#stream") == _as_drawn(CUT["segments"])
        assert _segments(page, "#turns .turn[data-turn='2'] pre.tokens") == [["trained", "Let me think about 17"]]
        assert page.locator("#turns .turn[data-turn='2'] .cut").count() == 1
        assert page.text_content("#turns .turn[data-turn='1'] .msg.tool .content") == MISSING
        assert ERROR_REPLY in page.text_content("#turns .turn[data-turn='1'] .seg.masked")
        assert value_of(page, "#ep-tool-errors") == 1 and value_of(page, "#ep-advantage") == CUT["advantage"]
        assert page.text_content("#ep-turn-rewards") == "none" and page.locator("#turns .turn-reward-at").count() == 0

        # step 1 by the ‹ button: one reward for two turns, listed but placed on no turn
        page.click("#step-prev")
        wait_until(page, lambda: page.input_value("#step-pick") == "1" and page.locator("#episodes tbody tr").count() == 1,
                   what="step 1")
        assert _segments(page, "#stream") == _as_drawn(GUESS["segments"])
        assert value_of(page, "#ep-turn-rewards .turn-reward") == 0.2
        assert page.locator("#turns .turn-reward-at").count() == 0
        assert page.is_disabled("#step-prev") and not page.is_disabled("#step-next")
        assert "step=1" in page.url and "run=calc" in page.url
        assert_no_errors(page)

        # the Runs page links a run of episodes here, at the step it shows
        runs_page = open_page(browser, url + "/runs")
        runs_page.click("#runs tbody tr[data-id='calc'] td[data-key='id']")
        runs_page.wait_for_selector("#episodes-link:not([hidden])", timeout=5000)
        runs_page.select_option("#step-filter", "3")
        wait_until(runs_page, lambda: runs_page.get_attribute("#episodes-link", "href").endswith("step=3"), what="link at step 3")
        runs_page.click("#episodes-link")
        wait_until(runs_page, lambda: runs_page.locator("#stream .seg").count() == 3
                   and runs_page.input_value("#step-pick") == "3", what="the Episodes page from the link")
        assert _segments(runs_page, "#stream") == _as_drawn(SOLVED["segments"])
        runs_page.click("#nav-runs")
        runs_page.click("#runs tbody tr[data-id='single-turn'] td[data-key='id']")
        wait_until(runs_page, lambda: runs_page.text_content("#samples-count") == "1 samples", what="the single-turn run")
        assert runs_page.is_hidden("#episodes-link")
        assert_no_errors(runs_page)

        # a run without episodes named in the URL: said so, nothing drawn
        empty = open_page(browser, url + "/episodes?run=single-turn")
        wait_until(empty, lambda: empty.text_content("#step-count") == "no episodes logged", what="no episodes")
        assert empty.is_hidden("#episode") and empty.locator("#stream .seg").count() == 0
        assert_no_errors(empty)
