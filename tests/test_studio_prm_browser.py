"""The "Process rewards" page in headless Chromium, on a fabricated PRM study whose numbers are known
(test_studio_prm.write_study) and the repository's published benchmarks/prm summaries: one curve
per selector on a log2 axis, its ± sd band around it, the table's mean ± sd equal to the file, the
scorers' metrics and the facts; a selector hidden from the legend; the published study picked from
the list; a malformed summary's one-line error."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (the studio extra: pip install -e '.[studio]')")
pytest.importorskip("uvicorn", reason="uvicorn not installed (the studio extra: pip install -e '.[studio]')")

from studio_support import assert_no_errors, browser, make_app, open_page, serve, shot, value_of, wait_until  # noqa: E402,F401
from test_studio_prm import BENCH, NS, fabricated_summary, publish, write_study  # noqa: E402

pytestmark = pytest.mark.browser


def _points(page, key: str) -> list[dict]:
    return page.eval_on_selector_all(
        f"#selection-svg circle.point[data-key='{key}']",
        "es => es.map(e => ({n: Number(e.dataset.n), value: Number(e.dataset.value), "
        "cx: Number(e.getAttribute('cx')), cy: Number(e.getAttribute('cy'))}))")


def _cell(page, table: str, row: str, key: str, part: str = "mean") -> float | None:
    return value_of(page, f"#{table} tr[data-id='{row}'] td[data-key='{key}'] .num.{part}")


def test_prm_page(tmp_path, browser):  # noqa: F811 - the fixture
    runs = tmp_path / "runs"
    write_study(runs)
    bad = fabricated_summary()
    bad["selection"]["prm"] = bad["selection"]["prm"][:5]
    write_study(runs, "study-prm-broken", summary=bad)
    publish(runs)
    s = json.loads((runs / "study-prm" / "summary.json").read_text())
    keys = list(s["selection"])
    with serve(make_app(runs)) as url:
        page = open_page(browser, url + "/prm?run=study-prm")  # a link naming the study
        wait_until(page, lambda: page.locator("#selection-svg path.series").count() == len(keys), timeout=10,
                   what="one curve per selector")
        options = page.eval_on_selector_all("#study-pick option", "es => es.map(e => [e.value, e.textContent])")
        assert [t for _, t in options] == ["study-prm (finished)", "study-prm-broken (finished)",
                                           "benchmarks/prm/summary-smollm2.json (published)",
                                           "benchmarks/prm/summary-steps.json (published)",
                                           "benchmarks/prm/summary.json (published)"]
        assert page.text_content("#study-file") == "study-prm/summary.json"
        drawn = page.eval_on_selector_all("#selection-svg path.series", "es => es.map(e => e.dataset.key)")
        assert sorted(drawn) == sorted(keys)
        assert page.get_attribute("#selection-svg path.series[data-key='prm']", "data-name") == "PRM (min)"
        assert page.get_attribute("#selection-svg path.series[data-key='verifier_x']", "data-name") == "verifier_x"
        # the x axis is log2 n: one tick per n, evenly spaced
        assert page.eval_on_selector_all("#selection-svg text.x-tick", "es => es.map(e => e.textContent)") == [str(n) for n in NS]
        for key in keys:
            pts = _points(page, key)
            assert [p["n"] for p in pts] == NS and [p["value"] for p in pts] == s["selection"][key]
            gaps = [b["cx"] - a["cx"] for a, b in zip(pts, pts[1:])]
            assert max(gaps) - min(gaps) < 0.2
        # heights follow the values: at n = 16, a higher accuracy is drawn higher
        at16 = {k: next(p for p in _points(page, k) if p["n"] == 16) for k in keys}
        order = sorted(keys, key=lambda k: s["selection"][k][NS.index(16)])
        assert sorted(keys, key=lambda k: -at16[k]["cy"]) == order
        # a band for every selector with a spread, none for those without; it brackets its curve
        banded = page.eval_on_selector_all("#selection-svg path.band", "es => es.map(e => e.dataset.key)")
        assert sorted(banded) == sorted(k for k, d in s["selection_sd"].items() if any(d))
        box = page.eval_on_selector("#selection-svg path.band[data-key='prm']",
                                    "e => { const b = e.getBBox(); return [b.y, b.y + b.height]; }")
        cys = [p["cy"] for p in _points(page, "prm")]
        assert box[0] < min(cys) and box[1] > max(cys)

        # the table: mean ± sd per n and selector, as in the file
        j = NS.index(16)
        assert _cell(page, "selection-table", "16", "prm") == s["selection"]["prm"][j]
        assert _cell(page, "selection-table", "16", "prm", "sd") == s["selection_sd"]["prm"][j]
        assert _cell(page, "selection-table", "64", "oracle") == s["selection"]["oracle"][-1]
        assert page.locator("#selection-table tr[data-id='64'] td[data-key='oracle'] .num.sd").count() == 0  # sd 0
        assert page.locator("#selection-table tbody tr").count() == len(NS)
        headers = page.eval_on_selector_all("#selection-table th", "es => es.map(e => e.textContent)")
        assert headers[:4] == ["n", "PRM (min)", "PRM (product)", "PRM, Math-Shepherd hard (min)"]
        assert "pass@n" in headers and "majority vote" in headers

        # the scorers' step metrics with their sd; the facts
        cm, cs = s["candidate_metrics"], s["candidate_metrics_sd"]
        assert _cell(page, "candidate-metrics", "prm", "step_accuracy") == cm["prm"]["step_accuracy"]
        assert _cell(page, "candidate-metrics", "prm", "step_accuracy", "sd") == cs["prm"]["step_accuracy"]
        assert _cell(page, "candidate-metrics", "prm_ms", "error_f1") == cm["prm_ms"]["error_f1"]
        assert _cell(page, "candidate-metrics", "orm", "outcome_accuracy") == cm["orm"]["outcome_accuracy"]
        assert page.text_content("#candidate-metrics tr[data-id='orm'] td[data-key='step_accuracy']") == "–"
        assert page.text_content("#candidate-metrics tr[data-id='prm_ms_soft'] td[data-key='first_error_accuracy_wrong'] .mean") == "–"
        assert _cell(page, "eval-metrics", "prm_ms", "first_error_accuracy") == s["prm_step_metrics"]["prm_ms"]["first_error_accuracy"]
        assert page.text_content("#facts tr[data-key='policy'] td") == s["policy"]
        assert page.text_content("#facts tr[data-key='rm_seeds'] td") == "0, 1, 2"
        assert value_of(page, "#facts tr[data-key='candidates'] .num") == 64
        # the study's own figure, through the API
        wait_until(page, lambda: page.eval_on_selector("#figure", "e => e.complete && e.naturalWidth") > 0,
                   what="the figure loaded")
        assert_no_errors(page)

        # a selector unticked in the legend: its curve and band go, the others stay
        page.click("#legend input[data-key='prm']")
        wait_until(page, lambda: page.locator("#selection-svg path.series").count() == len(keys) - 1)
        assert page.locator("#selection-svg [data-key='prm']").count() == 0

        # the published study of the repository: its numbers
        steps = json.loads((BENCH / "summary-steps.json").read_text())
        value = next(v for v, text in options if text.startswith("benchmarks/prm/summary-steps.json"))
        page.select_option("#study-pick", value)
        wait_until(page, lambda: page.text_content("#study-file") == "benchmarks/prm/summary-steps.json", what="published")
        assert _cell(page, "selection-table", "16", "prm") == steps["selection"]["prm"][j]
        assert _cell(page, "selection-table", "16", "prm", "sd") == steps["selection_sd"]["prm"][j]
        assert page.locator("#selection-svg path.series").count() == len(steps["selection"])
        # a new study shows every curve again: prm's line, band and one point per n
        assert page.locator("#selection-svg [data-key='prm']").count() == 2 + len(NS)
        # a spread of float noise (pass@n's sd is 1e-16 where the seeds agree exactly) is no spread
        assert steps["selection_sd"]["oracle"][2] > 0
        assert page.locator("#selection-table tr[data-id='4'] td[data-key='oracle'] .num.sd").count() == 0
        banded = page.eval_on_selector_all("#selection-svg path.band", "es => es.map(e => e.dataset.key)")
        assert sorted(banded) == sorted(k for k, d in steps["selection_sd"].items() if max(d) > 1e-12)
        assert "oracle" not in banded and "prm" in banded
        wait_until(page, lambda: page.eval_on_selector("#figure", "e => e.complete && e.naturalWidth") > 0,
                   what="the published figure loaded")
        assert page.get_attribute("#figure", "src").endswith("published=summary-steps.json")
        assert_no_errors(page)
        shot(page, "prm", tmp_path)  # the README's picture (TETHER_STUDIO_README_IMG=1): the published study

        # a malformed summary: one line naming the file and the field, the view hidden
        page.select_option("#study-pick", next(v for v, text in options if text.startswith("study-prm-broken")))
        wait_until(page, lambda: page.is_visible("#error"), what="the error line")
        text = page.text_content("#error")
        assert text.startswith("study-prm-broken/summary.json: field 'selection.prm' has 5 values") and "\n" not in text
        assert not page.is_visible("#study-view")
