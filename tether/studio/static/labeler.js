// Page 3, the preference labeler: label the pair on screen (buttons or keys a / b / t / s, undo u
// or Ctrl+Z), watch the Bradley–Terry model retrain in the background (polled).
"use strict";
(function () {
  const T = window.tether;
  // one id per tab, kept across reloads (sessionStorage is per tab): the server keeps the pair each
  // tab shows apart from the others', and a reloaded tab gets its pair and its undo stack back
  let session = sessionStorage.getItem("tether-labeler-session");
  if (!session) {
    session = "tab-" + Date.now().toString(36) + "-" + Math.random().toString(36).slice(2);
    sessionStorage.setItem("tether-labeler-session", session);
  }
  let pair = null, busy = false;
  const done = [];  // this tab's label ids, newest last: what undo takes back

  function show(p) {
    pair = p;
    document.getElementById("prompt").textContent = p ? (typeof p.prompt === "string" ? p.prompt : JSON.stringify(p.prompt)) : "All pairs are labelled.";
    document.getElementById("response-a").textContent = p ? text(p.a) : "";
    document.getElementById("response-b").textContent = p ? text(p.b) : "";
    document.querySelector("main").dataset.pairIndex = p ? String(p.index) : "";
  }
  function text(v) { return typeof v === "string" ? v : v.map(m => `${m.role}: ${m.content}`).join("\n"); }

  function showCounts(c) {
    const el = document.getElementById("counts");
    el.replaceChildren("labels ", T.num(c.labels, {id: "count-labels"}), " · A ", T.num(c.a), " · B ", T.num(c.b),
                       " · tie ", T.num(c.tie), " · skip ", T.num(c.skip));
  }

  async function next() {
    const d = await T.api("/api/labeler/next", {session});
    show(d.pair);
  }

  async function choose(choice) {
    if (busy || !pair) return;
    busy = true;
    try {
      const side = {a: "side-a", b: "side-b"}[choice];
      if (side) document.getElementById(side).classList.add("flash");
      const d = await T.api("/api/labeler/label", {session, index: pair.index, choice});
      done.push(d.id);
      showCounts(d.counts);
      await next();
      document.querySelectorAll(".flash").forEach(e => e.classList.remove("flash"));
    } finally { busy = false; }
  }

  async function undo() {
    if (busy || !done.length) return;
    busy = true;
    try {
      const d = await T.api("/api/labeler/undo", {session, id: done[done.length - 1]});
      done.pop();
      show(d.pair);
      showCounts(d.counts);
    } finally { busy = false; }
  }

  function renderModel(s) {
    document.getElementById("source").textContent = `· pairs from ${s.source}`;
    document.getElementById("files").textContent = `appending to ${s.files.preferences} (ties: ${s.files.ties})`;
    showCounts(s.counts);
    const m = s.model;
    document.getElementById("fit-state").textContent = s.fitting ? "· fitting…" :
      `· retrains every ${s.retrain_every} labels`;
    const box = document.getElementById("rm-numbers");
    if (!m) { box.replaceChildren(T.el("p", {class: "muted", id: "rm-none"}, `Not fitted yet: label ${s.retrain_every} pairs.`)); return; }
    if (m.error) { box.replaceChildren(T.el("p", {class: "error"}, m.error)); return; }
    const rows = [
      ["fitted on labels", T.num(m.n_labels, {id: "rm-n-labels"})],
      ["train pairs / held-out pairs", T.el("span", {}, T.num(m.n_train, {id: "rm-n-train"}), " / ", T.num(m.n_held_out, {id: "rm-n-held"}))],
      ["accuracy on held-out labels", T.num(m.held_out_accuracy, {id: "rm-held-acc"})],
      ["accuracy on its training labels", T.num(m.train_accuracy, {id: "rm-train-acc"})],
    ];
    if (m.world) rows.push(
      [`expected accuracy on ${m.world.pairs} unseen world pairs (BT labels, τ=${m.world.temperature})`, T.num(m.world.expected_accuracy, {id: "rm-expected-acc"})],
      ["Bayes-optimal accuracy on them", T.num(m.world.bayes_optimal_accuracy, {id: "rm-bayes-acc"})],
      ["agreement with the gold reward's order", T.num(m.world.gold_agreement, {id: "rm-gold-agree"})]);
    box.replaceChildren(T.el("table", {class: "data"}, ...rows.map(([k, v]) => T.el("tr", {}, T.el("td", {}, k), T.el("td", {class: "numeric"}, v)))));
    const bars = [{label: "RM (held-out labels)", value: m.held_out_accuracy || 0, color: "#1f77b4"}];
    if (m.world) bars.push({label: "RM (expected)", value: m.world.expected_accuracy, color: "#2ca02c"},
                           {label: "Bayes-optimal", value: m.world.bayes_optimal_accuracy, color: "#888"});
    T.barChart(document.getElementById("rm-bars"), bars, {title: "accuracy", width: 360, height: 220, id: "rm-bar-chart"});
    if (s.history.length > 1)
      T.lineChart(document.getElementById("rm-curve"), [{name: "RM", x: s.history.map(h => h.labels), y: s.history.map(h => h.accuracy), points: true}],
                  {title: "accuracy vs labels", xLabel: "labels", width: 360, height: 220,
                   hlines: m.world ? [{y: m.world.bayes_optimal_accuracy, label: "Bayes-optimal"}] : []});
    const cols = [{key: "prompt", label: "prompt", format: v => T.el("pre", {}, text(v))},
                  {key: "a", label: "A", format: v => T.el("pre", {}, text(v))},
                  {key: "b", label: "B", format: v => T.el("pre", {}, text(v))},
                  {key: "score_a", label: "r(A)", numeric: true, sortable: true},
                  {key: "score_b", label: "r(B)", numeric: true, sortable: true},
                  {key: "prefers", label: "RM prefers", format: (_, r) => r.score_a > r.score_b ? "A" : (r.score_b > r.score_a ? "B" : "tie")}];
    if (m.world) cols.push({key: "gold_a", label: "gold(A)", numeric: true}, {key: "gold_b", label: "gold(B)", numeric: true});
    T.table(document.getElementById("unseen"), m.unseen, cols, {id: "unseen-table"});
  }

  const KEYS = {a: "a", ArrowLeft: "a", b: "b", ArrowRight: "b", t: "tie", s: "skip"};
  document.addEventListener("keydown", ev => {
    if (ev.target.tagName === "INPUT" || ev.target.tagName === "TEXTAREA") return;
    if (ev.key === "u" || (ev.key === "z" && (ev.ctrlKey || ev.metaKey))) { ev.preventDefault(); undo(); return; }
    if (!ev.ctrlKey && !ev.metaKey && !ev.altKey && KEYS[ev.key]) { ev.preventDefault(); choose(KEYS[ev.key]); }
  });
  document.getElementById("btn-a").addEventListener("click", () => choose("a"));
  document.getElementById("btn-b").addEventListener("click", () => choose("b"));
  document.getElementById("btn-tie").addEventListener("click", () => choose("tie"));
  document.getElementById("btn-skip").addEventListener("click", () => choose("skip"));
  document.getElementById("btn-undo").addEventListener("click", undo);

  T.nav("labeler");
  let last = "";
  T.api(`/api/labeler/mine?session=${encodeURIComponent(session)}`).then(d => done.push(...d.ids)).then(next).then(() => T.poll(async () => {
    const s = await T.api("/api/labeler/state"), key = JSON.stringify(s);
    if (key !== last) { last = key; renderModel(s); }
  }, 1000));
})();
