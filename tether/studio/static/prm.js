// Process rewards: a PRM study's best-of-n selection curves (± sd over reward-model seeds), their
// table, the scorers' step metrics, the run's facts and the study's own figure.
"use strict";
(function () {
  const T = window.tether, $ = id => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";
  // colour and dash of each selector (as the study's figure draws them: tether.studies.prm.CURVES)
  const STYLE = {
    prm: ["#1f77b4", null], prm_prod: ["#1f77b4", "6 3"], prm_ms: ["#9467bd", null], prm_ms_prod: ["#9467bd", "6 3"],
    prm_ms_soft: ["#8c564b", null], prm_ms_soft_prod: ["#8c564b", "6 3"], orm: ["#ff7f0e", null],
    majority: ["#2ca02c", null], random: ["#7f7f7f", null], oracle: ["#222222", "2 3"],
  };
  let list = [], study = null, hidden = new Set();

  function style(key, i) { return STYLE[key] || [T.PALETTE[i % T.PALETTE.length], "4 2"]; }
  const given = x => x !== null && x !== undefined && isFinite(x);
  // an sd worth showing: above float noise (identical values averaged over seeds leave ~1e-16)
  const spread = d => given(d) && d > 1e-12;

  function svg(tag, attrs, ...children) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) if (v !== undefined && v !== null) e.setAttribute(k, v);
    for (const c of children) if (c !== null && c !== undefined) e.append(c);
    return e;
  }

  // mean ± sd as two T.num spans (the sd only where the file has one above float noise)
  function pm(mean, sd) {
    const out = T.el("span", {}, T.num(mean, {class: "num mean"}));
    if (spread(sd)) out.append(" ± ", T.num(sd, {class: "num sd"}));
    return out;
  }

  // The selection chart: accuracy vs n on a log2 axis, one path per shown selector, its ± sd band
  // shaded underneath (paths: class "series", bands: class "band", both data-key = the selector).
  function drawChart() {
    const ns = study.ns, shown = study.selectors.filter(s => !hidden.has(s.key));
    const W = 640, H = 380, m = {l: 56, r: 16, t: 28, b: 44};
    const lx = ns.map(n => Math.log2(n));
    let x0 = Math.min(...lx), x1 = Math.max(...lx);
    if (x1 === x0) { x0 -= 0.5; x1 += 0.5; }
    let lo = Infinity, hi = -Infinity;
    for (const s of shown) s.values.forEach((v, j) => {
      if (!given(v)) return;
      const d = s.sd && given(s.sd[j]) ? s.sd[j] : 0;
      lo = Math.min(lo, v - d); hi = Math.max(hi, v + d);
    });
    let y0 = 0, y1 = 1;  // accuracies: the whole [0, 1] unless something lies outside it
    if (lo < 0 || hi > 1) { const p = 0.05 * ((hi - lo) || 1); y0 = lo - p; y1 = hi + p; }
    const X = v => m.l + (v - x0) / (x1 - x0) * (W - m.l - m.r);
    const Y = v => H - m.b - (v - y0) / (y1 - y0) * (H - m.t - m.b);
    const root = svg("svg", {viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "chart", id: "selection-svg"});
    root.append(svg("text", {x: m.l, y: 16, class: "title"}, "pass@1 of the selected solution" +
      (study.seeds > 1 ? ` (mean ± sd over ${study.seeds} reward-model seeds)` : "")));
    for (const t of T.ticks(y0, y1, 5)) {
      root.append(svg("line", {x1: m.l, x2: W - m.r, y1: Y(t), y2: Y(t), class: "grid"}),
                  svg("text", {x: m.l - 4, y: Y(t) + 4, class: "tick", "text-anchor": "end"}, T.fmt(t)));
    }
    ns.forEach((n, j) => root.append(
      svg("line", {x1: X(lx[j]), x2: X(lx[j]), y1: H - m.b, y2: H - m.b + 4, class: "axis"}),
      svg("text", {x: X(lx[j]), y: H - m.b + 16, class: "tick x-tick", "text-anchor": "middle"}, String(n))));
    root.append(svg("line", {x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b, class: "axis"}),
                svg("line", {x1: m.l, x2: m.l, y1: m.t, y2: H - m.b, class: "axis"}),
                svg("text", {x: (m.l + W - m.r) / 2, y: H - 6, class: "label", "text-anchor": "middle"},
                    "n (solutions sampled per problem, log scale)"),
                svg("text", {x: 12, y: (m.t + H - m.b) / 2, class: "label", "text-anchor": "middle",
                             transform: `rotate(-90 12 ${(m.t + H - m.b) / 2})`}, "pass@1"));
    const bands = svg("g", {class: "bands"}), lines = svg("g", {class: "lines"});
    study.selectors.forEach((s, i) => {
      if (hidden.has(s.key)) return;
      const [color, dash] = style(s.key, i);
      // the band: runs of consecutive points with a mean and an sd, upper edge then lower edge back
      if (s.sd && s.sd.some(spread)) {
        let run = [], d = "";
        const flush = () => {
          if (run.length > 1) d += "M" + run.map(j => `${X(lx[j]).toFixed(1)} ${Y(s.values[j] + s.sd[j]).toFixed(1)}`).join("L") +
            "L" + run.slice().reverse().map(j => `${X(lx[j]).toFixed(1)} ${Y(s.values[j] - s.sd[j]).toFixed(1)}`).join("L") + "Z";
          run = [];
        };
        ns.forEach((_, j) => { if (given(s.values[j]) && given(s.sd[j])) run.push(j); else flush(); });
        flush();
        if (d) bands.append(svg("path", {d, fill: color, "fill-opacity": 0.14, class: "band", "data-key": s.key}));
      }
      let d = "", pen = false;
      ns.forEach((_, j) => {
        const v = s.values[j];
        if (!given(v)) { pen = false; return; }
        d += (pen ? "L" : "M") + X(lx[j]).toFixed(1) + " " + Y(v).toFixed(1);
        pen = true;
      });
      lines.append(svg("path", {d, fill: "none", stroke: color, "stroke-width": 1.8, "stroke-dasharray": dash,
                                class: "series", "data-key": s.key, "data-name": s.label}));
      ns.forEach((n, j) => {
        if (given(s.values[j])) lines.append(svg("circle", {cx: X(lx[j]), cy: Y(s.values[j]), r: 2.5, fill: color,
          class: "point", "data-key": s.key, "data-n": String(n), "data-value": String(s.values[j])},
          svg("title", {}, `${s.label}, n = ${n}: ${T.fmt(s.values[j])}` +
                           (s.sd && spread(s.sd[j]) ? ` ± ${T.fmt(s.sd[j])}` : ""))));
      });
    });
    root.append(bands, lines);
    $("selection-chart").replaceChildren(root);
  }

  // The legend: one checkbox per selector (unticked: its curve is not drawn).
  function drawLegend() {
    $("legend").replaceChildren(...study.selectors.map((s, i) => {
      const [color, dash] = style(s.key, i);
      const box = T.el("input", {type: "checkbox", "data-key": s.key, checked: !hidden.has(s.key)});
      box.addEventListener("change", () => { if (box.checked) hidden.delete(s.key); else hidden.add(s.key); drawChart(); });
      return T.el("label", {}, box,
        T.el("span", {class: "swatch", style: `border-top-color: ${color}; border-top-style: ${dash ? "dashed" : "solid"}`}),
        s.label);
    }));
  }

  function drawTables() {
    const rows = study.ns.map((n, j) => ({n, j}));
    T.table($("selection-box"), rows, [{key: "n", label: "n", numeric: true},
      ...study.selectors.map(s => ({key: s.key, label: s.label, numeric: true,
                                   format: (_, r) => pm(s.values[r.j], s.sd ? s.sd[r.j] : null)}))],
            {id: "selection-table", rowId: r => String(r.n)});
    $("sd-note").textContent = study.seeds > 1 ? `(mean ± sd over ${study.seeds} reward-model seeds)` : "";
    const scorers = (box, rows, columns, id) => T.table(box, rows, [{key: "label", label: "scorer"},
      ...Object.entries(columns).map(([c, label]) => ({key: c, label, numeric: true,
        format: (_, r) => c in r.metrics ? pm(r.metrics[c], r.sd[c]) : "–"}))], {id, rowId: r => r.key});
    scorers($("candidate-box"), study.candidate_metrics, study.columns.candidate_metrics, "candidate-metrics");
    $("candidate-box").hidden = study.candidate_metrics.length === 0;
    $("candidate-none").hidden = study.candidate_metrics.length > 0;
    scorers($("eval-box"), study.eval_metrics, study.columns.eval_metrics, "eval-metrics");
    $("facts-box").replaceChildren(T.el("table", {id: "facts", class: "data"}, T.el("tbody", {},
      T.el("tr", {"data-key": "file"}, T.el("th", {}, "summary"), T.el("td", {class: "mono"}, study.file)),
      ...study.facts.map(f => T.el("tr", {"data-key": f.key}, T.el("th", {}, f.label),
        T.el("td", {}, typeof f.value === "number" ? T.num(f.value) : Array.isArray(f.value) ? f.value.join(", ") : f.value))))));
  }

  function query(s) { return `${s.kind === "run" ? "run" : "published"}=${encodeURIComponent(s.id)}`; }

  async function openStudy(i) {
    const s = list[i];
    $("study-file").textContent = "";
    try {
      study = await T.api("/api/prm/study?" + query(s));
    } catch (e) {
      $("study-view").hidden = true;
      $("error").hidden = false;
      $("error").textContent = e.message;
      T.status(e.message, true);
      return;
    }
    $("error").hidden = true;
    if (document.getElementById("status")) T.status("");
    hidden = new Set();
    $("study-view").hidden = false;
    $("study-file").textContent = study.file;
    drawLegend(); drawChart(); drawTables();
    $("figure-box").hidden = !study.figure;
    if (study.figure) {
      const url = "/api/prm/figure?" + query(s);
      $("figure").src = url;
      $("figure-link").href = url;
    } else $("figure").removeAttribute("src");
  }

  async function main() {
    await T.nav("prm");
    list = (await T.api("/api/prm/studies")).studies;
    $("study-pick").replaceChildren(...list.map((s, i) => T.el("option", {value: String(i)},
      s.kind === "run" ? `${s.label} (${s.state})` : `${s.label} (published)`)));
    $("empty").hidden = list.length > 0;
    $("study-pick").addEventListener("change", () => openStudy(Number($("study-pick").value)));
    if (!list.length) return;
    // ?run=<id> or ?published=<file> picks a study (a link from elsewhere); else the first
    const params = new URLSearchParams(location.search);
    const want = list.findIndex(s => (s.kind === "run" && s.id === params.get("run")) ||
                                     (s.kind === "published" && s.id === params.get("published")));
    $("study-pick").value = String(Math.max(0, want));
    await openStudy(Math.max(0, want));
  }
  main().catch(e => T.status(e.message, true));
})();
