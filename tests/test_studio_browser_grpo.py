"""Page 4, the GRPO explorer, in headless Chromium: group-size buttons, a reward slider dragged
with the mouse and one moved with the arrow keys, the ratio slider, a logged group from a run's
samples and a live group sampled from a checkpoint. Every advantage and surrogate on screen equals
tether.studio.grpo.advantages / surrogate (the training registry) for the rewards on screen."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (the studio extra: pip install -e '.[studio]')")
pytest.importorskip("uvicorn", reason="uvicorn not installed (the studio extra: pip install -e '.[studio]')")

from studio_pages_support import quickstart_runs  # noqa: E402
from studio_support import assert_no_errors, browser, make_app, open_page, serve, shot, value_of, wait_until  # noqa: E402,F401

pytestmark = [pytest.mark.browser, pytest.mark.slow]  # slow: the default suite keeps the labeler's and runs' pages
ROWS = "#advantages-table tbody tr"


def _rewards(page) -> list[float]:
    return [float(page.input_value(f"#reward-{i}")) for i in range(page.locator(ROWS).count())]


def _on_screen(page, key: str) -> list[float]:
    return [value_of(page, f"{ROWS}[data-id='{i + 1}'] td[data-key='{key}'] .num")
            for i in range(page.locator(ROWS).count())]


def _lengths(page):
    cells = [page.text_content(f"{ROWS}[data-id='{i + 1}'] td[data-key='length']") for i in range(page.locator(ROWS).count())]
    return None if all(c in ("–", "") for c in cells) else [int(c) for c in cells]


def _matches(page) -> bool:
    from tether.studio.grpo import ESTIMATORS, advantages, surrogate

    want = advantages(_rewards(page), _lengths(page), float(page.input_value("#greedy")), page.input_value("#scale"))
    if any(_on_screen(page, e) != want[e] for e in ESTIMATORS):
        return False
    est = page.input_value("#estimator")
    s = surrogate(want[est], float(page.input_value("#ratio")), float(page.input_value("#eps-low")),
                  float(page.input_value("#eps-high")), _lengths(page))
    return (_on_screen(page, "loss") == [r["loss"] for r in s["rows"]]
            and value_of(page, "#policy-loss") == s["policy_loss"]
            and value_of(page, "#clip-high") == s["clip_ratio"]["high_mean"])


def _drag(page, selector: str, fraction: float):
    box = page.locator(selector).bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] / 2, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * fraction, y, steps=5)
    page.mouse.up()


def test_grpo_page(tmp_path, tmp_path_factory, browser):  # noqa: F811 - the fixture
    runs = quickstart_runs(tmp_path_factory)
    with serve(make_app(runs)) as url:
        page = open_page(browser, url + "/grpo")
        wait_until(page, lambda: page.locator(ROWS).count() == 8, what="a group of 8")
        wait_until(page, lambda: _matches(page), what="advantages of the starting group")
        page.click("#g-4")
        wait_until(page, lambda: page.locator(ROWS).count() == 4 and _matches(page), what="G = 4")

        _drag(page, "#reward-1", 1.0)  # the mouse: completion 2's reward to the slider's top
        assert _rewards(page)[1] == 2.0
        page.focus("#reward-2")
        for _ in range(4):
            page.keyboard.press("ArrowLeft")  # the keys: 1 -> 0.8
        assert _rewards(page)[2] == pytest.approx(0.8)
        wait_until(page, lambda: _matches(page), what="advantages after the drags")

        page.select_option("#estimator", "rloo")
        page.focus("#ratio")
        for _ in range(20):
            page.keyboard.press("ArrowRight")  # 1.1 -> 1.3: the clip binds for A > 0
        wait_until(page, lambda: _matches(page), what="surrogate at r = 1.3")
        assert page.locator(f"{ROWS} td.clip-high").count() == sum(a > 0 for a in _on_screen(page, "rloo"))
        page.select_option("#scale", "none")
        _drag(page, "#greedy", 0.75)  # ReMax's baseline to 1.0
        wait_until(page, lambda: _matches(page), what="scale and ReMax baseline")

        # a logged group from the RL run's samples
        page.select_option("#source", "samples")
        page.select_option("#run-pick", "quickstart/rl")
        wait_until(page, lambda: page.locator("#group-pick option").count() > 0
                   and page.locator(f"{ROWS} td[data-key='completion'] pre").count() > 0, timeout=15, what="logged group")
        wait_until(page, lambda: _matches(page), what="advantages of the logged group")

        # live: 8 completions from the SFT checkpoint of a carry problem (the quickstart's SFT imitates
        # the annotator's slip on most: with the full quickstart 3 of 8 are right, greedy is not)
        from tether.tasks.arithmetic import check_answer

        page.select_option("#source", "live")
        page.click("#g-8")
        ckpt = next(o for o in page.eval_on_selector_all("#ckpt-pick option", "os => os.map(o => o.value)")
                    if o.startswith("quickstart/sft/"))
        page.select_option("#ckpt-pick", ckpt)
        page.fill("#prompt", "What is 49 + 1?")
        page.fill("#answer", "50")
        page.click("#sample")
        wait_until(page, lambda: page.locator(f"{ROWS} td[data-key='completion'] pre").count() == 8, timeout=30,
                   what="live group")
        texts = [page.text_content(f"{ROWS}[data-id='{i + 1}'] td[data-key='completion'] pre") for i in range(8)]
        assert _rewards(page) == [check_answer(t, 50) for t in texts]
        wait_until(page, lambda: _matches(page), what="advantages of the live group")
        page.click(f"{ROWS}[data-id='2']")
        wait_until(page, lambda: "completion 2" in page.text_content("#surrogate-chart"), what="row 2's curve")
        shot(page, "grpo", tmp_path)
        assert_no_errors(page)
