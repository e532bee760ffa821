// Page 1, Runs: the runs table (polled), the curves of the ticked runs (polled, overlaid on shared
// axes, smoothed server-side), and the samples of one run (filter by step, sort by reward).
"use strict";
(function () {
  const T = window.tether;
  const state = {selected: [], curves: [], data: {}, versions: {}, smooth: 0, runs: null, gen: 0, sort: {key: null, desc: false}};
  const DEFAULT_CURVES = ["reward", "kl", "loss", "entropy", "lr", "grad_norm", "eval/pass@1", "pass@1", "accuracy", "eval/accuracy"];

  function statusCell(s) { return T.el("span", {class: "status-" + s}, s); }

  function renderRuns(runs) {
    state.runs = runs;
    const box = document.getElementById("runs-table");
    if (!runs.length) {
      box.replaceChildren(T.el("p", {id: "no-runs", class: "muted"}, "No runs yet under this runs directory."));
      return;
    }
    T.table(box, runs, [
      {key: "select", label: "", format: (_, r) => {
        const c = T.el("input", {type: "checkbox", class: "pick", "data-run": r.id, checked: state.selected.includes(r.id)});
        c.addEventListener("click", ev => { ev.stopPropagation(); toggle(r.id, c.checked); });
        return c; }},
      {key: "id", label: "run", sortable: true},
      {key: "command", label: "command", sortable: true},
      {key: "status", label: "status", sortable: true, format: statusCell},
      {key: "last_step", label: "last step", sortable: true, numeric: true},
      {key: "headline", label: "headline metric", format: h => h ? T.el("span", {}, h.name + " = ", T.num(h.value)) : "–"},
      {key: "bad_lines", label: "corrupt lines", numeric: true},
    ], {id: "runs", rowId: r => r.id, onRowClick: r => open(r.id), sortKey: state.sort.key, descending: state.sort.desc,
        onSort: (key, desc) => { state.sort = {key, desc}; }});
  }

  function toggle(id, on) {
    state.selected = on ? [...new Set([...state.selected, id])] : state.selected.filter(x => x !== id);
    showRunView();
  }

  function open(id) {  // a click on a row opens that run alone (its own usual curves); the ticks overlay several
    state.selected = [id];
    state.curves = [];
    document.querySelectorAll("input.pick").forEach(c => { c.checked = c.dataset.run === id; });
    showRunView();
  }

  function showRunView() {
    const view = document.getElementById("run-view");
    view.hidden = state.selected.length === 0;
    document.getElementById("run-names").textContent = state.selected.join(" + ");
    const pick = document.getElementById("samples-run");
    pick.replaceChildren(...state.selected.map(id => T.el("option", {value: id}, id)));
    reask().then(loadSamples);
    loadDetail();
  }

  // Every change of what is asked (runs, curves, smoothing) bumps state.gen; an answer to an older
  // question is dropped, so a slow answer can never overwrite a newer one (slider drags, polls).
  async function loadCurves() {
    const gen = state.gen;
    // only the curves on screen travel (a run may log dozens of metrics); before the first answer,
    // the usual ones (the server answers with those it has, and the names of all)
    const names = (state.curves.length ? state.curves : DEFAULT_CURVES).join(",");
    const q = s => `/api/runs/metrics?run=${encodeURIComponent(s)}&smooth=${state.smooth}&names=${encodeURIComponent(names)}` +
                   `&since=${encodeURIComponent(state.versions[s] || "")}`;
    let changed = false;
    for (const id of state.selected.slice()) {
      const d = await T.api(q(id));
      if (gen !== state.gen) return;
      if (d.unchanged) continue;
      state.data[id] = d; state.versions[id] = d.version; changed = true;
    }
    if (changed) drawCurves();
  }

  function reask() { state.gen += 1; state.versions = {}; return loadCurves(); }

  function drawCurves() {
    const names = new Set(), defaults = [];
    for (const id of state.selected) {
      const d = state.data[id];
      if (!d) continue;
      (d.names || []).forEach(n => names.add(n));
      (d.defaults || []).forEach(n => { if (!defaults.includes(n)) defaults.push(n); });
    }
    if (!state.curves.length) {
      if (defaults.length) state.curves = defaults.slice();
      else if (names.size) { state.curves = [...names].sort().slice(0, 4); reask(); return; }  // none of the usual ones
    }
    const pick = document.getElementById("metric-pick");
    const current = pick.value;
    pick.replaceChildren(...[...names].sort().map(n => T.el("option", {value: n, selected: n === current}, n)));
    const charts = document.getElementById("charts");
    charts.replaceChildren();
    const total = state.selected.reduce((a, id) => a + ((state.data[id] || {}).rows || 0), 0);
    document.getElementById("live").textContent = `${total} logged rows`;
    const loading = state.selected.filter(id => state.data[id] && state.data[id].loading);
    if (loading.length) charts.append(T.el("p", {id: "loading", class: "muted"},
      loading.map(id => `reading ${id}'s metrics (${(state.data[id].unread_bytes / 1e6).toFixed(0)} MB left)…` +
                        (state.data[id].preview ? " The curves show rows spread over the file until then." : "")).join(" ")));
    if (!names.size) {
      if (!loading.length) charts.append(T.el("p", {id: "no-metrics", class: "muted"}, "No metrics logged yet."));
      return;
    }
    for (const name of state.curves) {
      if (!names.has(name)) continue;
      const ser = state.selected.filter(id => state.data[id] && state.data[id].metrics[name]).map(id => {
        const m = state.data[id].metrics[name];
        return {name: id, x: m.x, y: m.y};
      });
      const box = T.el("div", {class: "chart-box", "data-metric": name});
      charts.append(box);
      T.lineChart(box, ser, {title: name, xLabel: "step", legend: state.selected.length > 1});
      const last = ser.map(s => T.el("span", {class: "last", "data-run": s.name}, s.name + ": ", T.num(s.y[s.y.length - 1]), " "));
      box.append(T.el("div", {class: "muted"}, "last: ", ...last));
    }
  }

  // One run open: its summary.json (flattened, numbers as T.num) and its resolved config.
  async function loadDetail() {
    const box = document.getElementById("run-detail");
    box.hidden = state.selected.length !== 1;
    if (box.hidden) return;
    const d = await T.api(`/api/runs/detail?run=${encodeURIComponent(state.selected[0])}`);
    document.getElementById("detail-name").textContent = d.id;
    const flat = (obj, pre, out) => {
      for (const [k, v] of Object.entries(obj || {}))
        if (v && typeof v === "object" && !Array.isArray(v)) flat(v, pre + k + ".", out);
        else out.push({key: pre + k, value: v});
      return out;
    };
    const show = v => typeof v === "number" ? T.num(v) : T.el("span", {class: "mono"}, typeof v === "string" ? v : JSON.stringify(v));
    T.table(document.getElementById("summary-table"), flat(d.summary, "", []),
            [{key: "key", label: "summary", sortable: true}, {key: "value", label: "value", format: show}], {id: "summary"});
    T.table(document.getElementById("config-table"), flat(d.config, "", []),
            [{key: "key", label: "config", sortable: true}, {key: "value", label: "value", format: show}], {id: "config"});
  }

  let samplesTable = null;
  async function loadSamples() {
    const id = document.getElementById("samples-run").value;
    if (!id) return;
    const stepSel = document.getElementById("step-filter");
    const step = stepSel.value;
    const d = await T.api(`/api/runs/samples?run=${encodeURIComponent(id)}` + (step !== "" ? `&step=${step}` : ""));
    stepSel.replaceChildren(T.el("option", {value: ""}, "all"),
                            ...d.steps.map(s => T.el("option", {value: String(s), selected: String(s) === step}, String(s))));
    document.getElementById("samples-count").textContent = `${d.total} samples`;
    // multi-turn samples (a run over an environment) open on the Episodes page, at this step
    const link = document.getElementById("episodes-link");
    link.hidden = !(d.columns.includes("segments") && d.columns.includes("messages"));
    link.href = `/episodes?run=${encodeURIComponent(id)}` + (step !== "" ? `&step=${step}` : "");
    const cols = d.columns.filter(c => c !== "step");
    const columns = [{key: "step", label: "step", sortable: true, numeric: true}].concat(cols.map(c => {
      const numeric = d.rows.some(r => typeof r[c] === "number");
      return {key: c, label: c, sortable: numeric, numeric,
              format: numeric ? undefined : v => T.el("pre", {}, v === undefined || v === null ? "" : (typeof v === "string" ? v : JSON.stringify(v)))};
    }));
    const box = document.getElementById("samples-table");
    if (!d.rows.length) { box.replaceChildren(T.el("p", {class: "muted", id: "no-samples"}, "No samples.")); return; }
    samplesTable = T.table(box, d.rows, columns, {id: "samples"});
  }

  document.getElementById("smooth").addEventListener("input", ev => {
    state.smooth = Number(ev.target.value);
    document.getElementById("smooth-value").textContent = String(state.smooth);
    reask();
  });
  document.getElementById("add-metric").addEventListener("click", () => {
    const n = document.getElementById("metric-pick").value;
    if (n && !state.curves.includes(n)) { state.curves.push(n); reask(); }
  });
  document.getElementById("step-filter").addEventListener("change", loadSamples);
  document.getElementById("samples-run").addEventListener("change", () => {
    document.getElementById("step-filter").value = ""; loadSamples(); });

  T.nav("runs");
  T.poll(async () => {
    const d = await T.api("/api/runs/list");
    const before = JSON.stringify(state.runs);
    if (JSON.stringify(d.runs) !== before) renderRuns(d.runs);
    if (state.selected.length) await loadCurves();
    T.status(`${d.runs.length} runs in ${d.runs_dir} · updated ${new Date().toLocaleTimeString()}`);
  }, 1000);
})();
