// tether studio: what every page's script shares (loaded before <page>.js, as window.tether).
// Hand-written SVG charts and tables: no library, nothing fetched from the network.
"use strict";
(function () {
  const SVG = "http://www.w3.org/2000/svg";
  const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

  // --- server ---------------------------------------------------------------------------------
  // JSON from /api/...; throws Error(detail) on a non-2xx answer. body: sent as JSON (POST).
  async function api(path, body, method) {
    const opts = {method: method || (body === undefined ? "GET" : "POST"), headers: {}};
    if (body !== undefined) {
      opts.headers["Content-Type"] = "application/json";
      opts.body = JSON.stringify(body);
    }
    const r = await fetch(path, opts);
    let data = null;
    try { data = await r.json(); } catch (e) { data = null; }
    if (!r.ok) throw new Error((data && data.detail) ? String(data.detail) : `${r.status} ${r.statusText}`);
    return data;
  }

  // Call fn every ms milliseconds (after each call finishes); returns a stop function.
  function poll(fn, ms) {
    let stopped = false, timer = null;
    async function tick() {
      if (stopped) return;
      try { await fn(); } catch (e) { status(String(e.message || e), true); }
      if (!stopped) timer = setTimeout(tick, ms);
    }
    tick();
    return () => { stopped = true; clearTimeout(timer); };
  }

  // --- DOM ------------------------------------------------------------------------------------
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "on") for (const [ev, f] of Object.entries(v)) e.addEventListener(ev, f);
      else if (k === "text") e.textContent = v;
      else if (v !== undefined && v !== null && v !== false) e.setAttribute(k, v === true ? "" : v);
    }
    for (const c of children) if (c !== null && c !== undefined) e.append(c);
    return e;
  }

  // A number as text: 4 significant digits (integers whole), "–" for null / NaN.
  function fmt(x) {
    if (x === null || x === undefined || (typeof x === "number" && !isFinite(x))) return "–";
    if (typeof x !== "number") return String(x);
    if (Number.isInteger(x)) return String(x);
    return String(Number(x.toPrecision(4)));
  }

  // A number on screen: <span class="num" data-value="full precision">fmt(x)</span>. Tests read
  // data-value and compare it with the Python function's output.
  function num(x, attrs) {
    return el("span", Object.assign({class: "num", "data-value": x === null || x === undefined ? "" : String(x)}, attrs || {}), fmt(x));
  }

  // The status line at the bottom of the page (errors in red).
  function status(text, isError) {
    let s = document.getElementById("status");
    if (!s) { s = el("div", {id: "status"}); document.body.append(s); }
    s.textContent = text || "";
    s.className = isError ? "error" : "";
  }

  // The navigation bar, from /api/pages, into <nav id="nav">; `current` is this page's name.
  async function nav(current) {
    const n = document.getElementById("nav");
    if (!n) return;
    n.append(el("span", {class: "brand"}, "tether studio"));
    for (const p of await api("/api/pages"))
      n.append(el("a", {href: "/" + p.name, class: p.name === current ? "current" : null, id: "nav-" + p.name}, p.title));
  }

  // --- tables ---------------------------------------------------------------------------------
  // columns: [{key, label, format(value,row) -> string|Node, sortable, numeric}]. Clicking a sortable
  // header sorts by it (again: reverses). opts: {id, sortKey, descending, onRowClick(row, tr), rowId(row),
  // onSort(key, descending) (to keep the order when the table is drawn again)}.
  function table(container, rows, columns, opts) {
    opts = opts || {};
    let sortKey = opts.sortKey, desc = !!opts.descending;
    function render() {
      const sorted = rows.slice();
      if (sortKey) {
        sorted.sort((a, b) => {
          const x = a[sortKey], y = b[sortKey];
          if (x === y) return 0;
          if (x === null || x === undefined) return 1;   // missing values last either way
          if (y === null || y === undefined) return -1;
          return (x < y ? -1 : 1) * (desc ? -1 : 1);
        });
      }
      const head = el("tr", {}, ...columns.map(c => {
        const th = el("th", {"data-key": c.key, class: c.sortable ? "sortable" : null},
                      c.label + (sortKey === c.key ? (desc ? " ▼" : " ▲") : ""));
        if (c.sortable) th.addEventListener("click", () => {
          desc = sortKey === c.key ? !desc : !!c.numeric;
          sortKey = c.key; render();
          if (opts.onSort) opts.onSort(sortKey, desc);
        });
        return th;
      }));
      const body = sorted.map(r => {
        const tr = el("tr", {"data-id": opts.rowId ? opts.rowId(r) : null}, ...columns.map(c => {
          const v = c.format ? c.format(r[c.key], r) : (typeof r[c.key] === "number" ? num(r[c.key]) : fmt(r[c.key]));
          return el("td", {"data-key": c.key, class: c.numeric ? "numeric" : null}, v);
        }));
        if (opts.onRowClick) { tr.classList.add("clickable"); tr.addEventListener("click", () => opts.onRowClick(r, tr)); }
        return tr;
      });
      container.replaceChildren(el("table", {id: opts.id, class: "data"}, el("thead", {}, head), el("tbody", {}, ...body)));
    }
    render();
    return {setRows(r) { rows = r; render(); }};
  }

  // --- charts ---------------------------------------------------------------------------------
  function svg(tag, attrs, ...children) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) if (v !== undefined && v !== null) e.setAttribute(k, v);
    for (const c of children) if (c !== null && c !== undefined) e.append(c);
    return e;
  }

  // ~n round tick values covering [lo, hi].
  function ticks(lo, hi, n) {
    if (!(hi > lo)) return [lo];
    const raw = (hi - lo) / (n || 5), mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw);
    const out = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(Number(t.toPrecision(12)));
    return out;
  }

  function extent(values, pad) {
    let lo = Infinity, hi = -Infinity;
    for (const v of values) if (v !== null && isFinite(v)) { if (v < lo) lo = v; if (v > hi) hi = v; }
    if (lo === Infinity) return [0, 1];
    if (lo === hi) { lo -= 0.5 * (Math.abs(lo) || 1); hi += 0.5 * (Math.abs(hi) || 1); }
    const p = (hi - lo) * (pad || 0);
    return [lo - p, hi + p];
  }

  // Line chart into `container` (replacing its content). series: [{name, x:[], y:[], color, dash,
  // width, points (draw dots)}]; nulls break the line. opts: {title, xLabel, yLabel, width, height,
  // xDomain, yDomain, vlines: [{x, label, color}], hlines: [{y, label, color}], id}. Returns the <svg>.
  function lineChart(container, series, opts) {
    opts = opts || {};
    const withLegend = series.filter(s => s.name).length > 1 || opts.legend;
    const W = opts.width || 460, H = opts.height || 260, m = {l: 56, r: 12, t: withLegend ? 36 : (opts.title ? 24 : 10), b: 40};
    const xs = series.flatMap(s => s.x), ys = series.flatMap(s => s.y);
    const [x0, x1] = opts.xDomain || extent(xs, 0), [y0, y1] = opts.yDomain || extent(ys, 0.05);
    const X = v => m.l + (v - x0) / (x1 - x0 || 1) * (W - m.l - m.r);
    const Y = v => H - m.b - (v - y0) / (y1 - y0 || 1) * (H - m.t - m.b);
    const root = svg("svg", {viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "chart", id: opts.id});
    if (opts.title) root.append(svg("text", {x: m.l, y: 16, class: "title"}, opts.title));
    for (const t of ticks(y0, y1, 5)) {
      root.append(svg("line", {x1: m.l, x2: W - m.r, y1: Y(t), y2: Y(t), class: "grid"}));
      root.append(svg("text", {x: m.l - 4, y: Y(t) + 4, class: "tick", "text-anchor": "end"}, fmt(t)));
    }
    for (const t of ticks(x0, x1, 6)) {
      root.append(svg("line", {x1: X(t), x2: X(t), y1: H - m.b, y2: H - m.b + 4, class: "axis"}));
      root.append(svg("text", {x: X(t), y: H - m.b + 16, class: "tick", "text-anchor": "middle"}, fmt(t)));
    }
    root.append(svg("line", {x1: m.l, x2: W - m.r, y1: H - m.b, y2: H - m.b, class: "axis"}));
    root.append(svg("line", {x1: m.l, x2: m.l, y1: m.t, y2: H - m.b, class: "axis"}));
    if (opts.xLabel) root.append(svg("text", {x: (m.l + W - m.r) / 2, y: H - 6, class: "label", "text-anchor": "middle"}, opts.xLabel));
    if (opts.yLabel) root.append(svg("text", {x: 12, y: (m.t + H - m.b) / 2, class: "label", "text-anchor": "middle",
                                              transform: `rotate(-90 12 ${(m.t + H - m.b) / 2})`}, opts.yLabel));
    for (const v of opts.vlines || [])
      root.append(svg("line", {x1: X(v.x), x2: X(v.x), y1: m.t, y2: H - m.b, stroke: v.color || "#888", class: "marker"}),
                  svg("text", {x: X(v.x) + 3, y: m.t + 10, class: "tick"}, v.label || ""));
    for (const h of opts.hlines || [])
      root.append(svg("line", {x1: m.l, x2: W - m.r, y1: Y(h.y), y2: Y(h.y), stroke: h.color || "#888", class: "marker"}),
                  svg("text", {x: W - m.r - 3, y: Y(h.y) - 3, class: "tick", "text-anchor": "end"}, h.label || ""));
    series.forEach((s, i) => {
      const color = s.color || PALETTE[i % PALETTE.length];
      let d = "", pen = false;
      for (let k = 0; k < s.x.length; k++) {
        const y = s.y[k];
        if (y === null || y === undefined || !isFinite(y)) { pen = false; continue; }
        d += (pen ? "L" : "M") + X(s.x[k]).toFixed(1) + " " + Y(y).toFixed(1);
        pen = true;
      }
      root.append(svg("path", {d, fill: "none", stroke: color, "stroke-width": s.width || 1.5,
                               "stroke-dasharray": s.dash, class: "series", "data-name": s.name}));
      if (s.points) for (let k = 0; k < s.x.length; k++)
        if (s.y[k] !== null && isFinite(s.y[k])) root.append(svg("circle", {cx: X(s.x[k]), cy: Y(s.y[k]), r: 2.5, fill: color}));
    });
    // the legend: one row above the plot, right-aligned (never over the lines)
    const named = series.filter(s => s.name);
    if (named.length > 1 || opts.legend) {
      let x = W - m.r - named.reduce((a, s) => a + 26 + 6.2 * s.name.length, 0);
      named.forEach(s => {
        const color = s.color || PALETTE[series.indexOf(s) % PALETTE.length], y = m.t - 6;
        root.append(svg("line", {x1: x, x2: x + 14, y1: y - 4, y2: y - 4, stroke: color, "stroke-width": 2}),
                    svg("text", {x: x + 18, y, class: "legend"}, s.name));
        x += 26 + 6.2 * s.name.length;
      });
    }
    container.replaceChildren(root);
    return root;
  }

  // Bar chart (vertical bars; each bar one value or a stack of parts) into `container`.
  // bars: [{label, value} | {label, parts: [{name, value}]}]. opts: {title, yLabel, width, height,
  // hlines: [{y, label}], colors: {partName: color}, onClick(bar, index), id}. Returns the <svg>.
  function barChart(container, bars, opts) {
    opts = opts || {};
    const W = opts.width || 460, H = opts.height || 260, m = {l: 56, r: 12, t: opts.title ? 24 : 10, b: 46};
    const names = [...new Set(bars.flatMap(b => (b.parts || []).map(p => p.name)))];
    const color = (n, i) => (opts.colors && opts.colors[n]) || PALETTE[i % PALETTE.length];
    const totals = bars.map(b => b.parts ? b.parts.reduce((a, p) => a + p.value, 0) : b.value);
    const top = Math.max(0, ...totals.filter(isFinite), ...(opts.hlines || []).map(h => h.y)) * 1.05 || 1;
    const lo = Math.min(0, ...totals.filter(isFinite));
    const Y = v => H - m.b - (v - lo) / (top - lo) * (H - m.t - m.b);
    const bw = (W - m.l - m.r) / Math.max(1, bars.length);
    const root = svg("svg", {viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "chart", id: opts.id});
    if (opts.title) root.append(svg("text", {x: m.l, y: 16, class: "title"}, opts.title));
    for (const t of ticks(lo, top, 5)) {
      root.append(svg("line", {x1: m.l, x2: W - m.r, y1: Y(t), y2: Y(t), class: "grid"}));
      root.append(svg("text", {x: m.l - 4, y: Y(t) + 4, class: "tick", "text-anchor": "end"}, fmt(t)));
    }
    bars.forEach((b, i) => {
      const g = svg("g", {class: "bar", "data-label": b.label, "data-value": String(totals[i])});
      const x = m.l + i * bw + bw * 0.15, w = bw * 0.7;
      if (b.parts) {
        let acc = 0;
        b.parts.forEach(p => {
          g.append(svg("rect", {x, width: w, y: Y(acc + p.value), height: Math.max(0, Y(acc) - Y(acc + p.value)),
                                fill: color(p.name, names.indexOf(p.name)), "data-name": p.name, "data-value": String(p.value)}));
          acc += p.value;
        });
      } else {
        g.append(svg("rect", {x, width: w, y: Y(Math.max(0, b.value)), height: Math.abs(Y(0) - Y(b.value)),
                              fill: b.color || PALETTE[0]}));
      }
      g.append(svg("text", {x: x + w / 2, y: H - m.b + 14, class: "tick", "text-anchor": "middle"}, b.label));
      g.append(svg("text", {x: x + w / 2, y: Y(Math.max(0, totals[i])) - 3, class: "tick", "text-anchor": "middle"}, fmt(totals[i])));
      if (opts.onClick) { g.classList.add("clickable"); g.addEventListener("click", () => opts.onClick(b, i)); }
      root.append(g);
    });
    root.append(svg("line", {x1: m.l, x2: W - m.r, y1: Y(0), y2: Y(0), class: "axis"}));
    for (const h of opts.hlines || [])
      root.append(svg("line", {x1: m.l, x2: W - m.r, y1: Y(h.y), y2: Y(h.y), class: "marker", stroke: h.color || "#888"}),
                  svg("text", {x: W - m.r - 2, y: Y(h.y) - 3, class: "tick", "text-anchor": "end"}, h.label || ""));
    if (opts.yLabel) root.append(svg("text", {x: 12, y: (m.t + H - m.b) / 2, class: "label", "text-anchor": "middle",
                                              transform: `rotate(-90 12 ${(m.t + H - m.b) / 2})`}, opts.yLabel));
    names.forEach((n, i) => root.append(
      svg("rect", {x: m.l + 4 + 100 * i, y: H - 14, width: 10, height: 10, fill: color(n, i)}),
      svg("text", {x: m.l + 18 + 100 * i, y: H - 5, class: "legend"}, n)));
    container.replaceChildren(root);
    return root;
  }

  window.tether = {api, poll, el, fmt, num, status, nav, table, lineChart, barChart, ticks, PALETTE};
})();
