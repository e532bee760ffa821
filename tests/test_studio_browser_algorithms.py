"""Page 5, algorithms & memory, in headless Chromium: size buttons, option switches, a card click;
the peak and every bar on screen equal tether.studio.algorithms.explore (= `tether memory`, pinned
to the CLI in test_studio_pages.py) for the same choices."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (the studio extra: pip install -e '.[studio]')")
pytest.importorskip("uvicorn", reason="uvicorn not installed (the studio extra: pip install -e '.[studio]')")

from studio_support import assert_no_errors, browser, make_app, open_page, serve, shot, value_of, wait_until  # noqa: E402,F401

pytestmark = pytest.mark.browser


def _check(page, opts: dict, size: str):
    from tether.studio.algorithms import explore

    want = explore(size, options=opts)
    wait_until(page, lambda: value_of(page, "#peak-gb") == want["peak_gb"], what=f"peak for {opts}")
    bars = page.locator("#memory-bars g.bar")
    assert bars.count() == len(want["bars"])
    for i, b in enumerate(want["bars"]):
        assert bars.nth(i).get_attribute("data-label") == b["label"]
        assert float(bars.nth(i).get_attribute("data-value")) == pytest.approx(b["total_gb"], rel=1e-12)
    for m, fits in want["fits"].items():
        assert ("✓" in page.text_content(f"#headline span[data-gb='{m}']")) == fits


def test_algorithms_page(tmp_path, browser):  # noqa: F811 - the fixture
    with serve(make_app(tmp_path / "runs")) as url:
        page = open_page(browser, url + "/algorithms")
        base = {"algo": "grpo", "lora": False, "gradient_checkpointing": False, "gpus": 1}
        _check(page, base, "7B")
        assert page.locator("#card-ppo ul.models li").count() == 4  # policy, reference, RM, value

        page.click("#size-70B")
        page.check("#lora")
        page.check("#ckpt")
        _check(page, {**base, "lora": True, "gradient_checkpointing": True}, "70B")
        # LoRA: the reference is the base model with adapters off, so no card lists a reference copy
        assert "reference" not in page.text_content("#card-dpo ul.models")

        page.select_option("#gpus", "4")
        wait_until(page, lambda: page.is_visible("#sharding-label"), what="sharding choice")
        _check(page, {**base, "lora": True, "gradient_checkpointing": True, "gpus": 4, "sharding": "fsdp"}, "70B")

        page.click("#card-dpo")  # a card click picks its algorithm
        assert page.input_value("#algo") == "dpo"
        _check(page, {**base, "algo": "dpo", "lora": True, "gradient_checkpointing": True, "gpus": 4,
                      "sharding": "fsdp"}, "70B")
        page.fill("#size", "0.5B")
        page.press("#size", "Enter")
        _check(page, {**base, "algo": "dpo", "lora": True, "gradient_checkpointing": True, "gpus": 4,
                      "sharding": "fsdp"}, "0.5B")
        page.click("#size-7B")
        page.uncheck("#lora")
        page.select_option("#gpus", "1")
        page.click("#card-ppo")
        _check(page, {**base, "algo": "ppo", "gradient_checkpointing": True}, "7B")
        assert page.text_content("#command") == "tether memory model=7B algo=ppo lora=false gradient_checkpointing=true gpus=1"
        shot(page, "algorithms", tmp_path)
        assert_no_errors(page)
