// GRPO explorer: a group's rewards -> every estimator's advantages -> the clipped surrogate.
"use strict";
(function () {
  const T = window.tether, $ = id => document.getElementById(id);
  let src = null, G = 8, group = null, adv = null, selectedRow = 0, pending = null;

  // The group shown: {prompt, completions[], rewards[], lengths|null}. Manual groups have no text.
  function manualGroup(n) {
    // half right, half wrong, as a verifier would score a group a policy half solves
    return {prompt: null, completions: Array(n).fill(null), rewards: Array.from({length: n}, (_, i) => (i % 2 === 0 ? 1 : 0)), lengths: null};
  }

  function setSize(n) {
    G = n;
    for (const b of $("sizes").querySelectorAll("button")) b.classList.toggle("current", Number(b.dataset.g) === n);
    const mode = $("source").value;
    if (mode === "manual") setGroup(manualGroup(n));
    else if (mode === "samples") pickGroup();
  }

  function setGroup(g) {
    group = g;
    if (document.getElementById("status")) T.status("");  // no empty status bar over the page
    selectedRow = 0;
    $("prompt-shown").textContent = g.prompt ? "prompt: " + g.prompt : "";
    recompute();
  }

  function schedule() {  // coalesce slider drags into one request at a time
    if (pending) return;
    pending = setTimeout(() => { pending = null; recompute().catch(e => T.status(e.message, true)); }, 30);
  }

  // Answers can arrive out of order (a slider fires many requests) or after the group changed:
  // only the newest request's answer is drawn, and advantages are drawn only for their own group.
  let advFor = null, advSeq = 0, surSeq = 0;
  async function recompute() {
    if (!group) return;
    const g = group, greedy = Number($("greedy").value), mine = ++advSeq;
    $("greedy-value").replaceChildren(T.num(greedy, {id: "greedy-shown"}));
    const r = await T.api("/api/grpo/advantages", {rewards: g.rewards.slice(), lengths: g.lengths,
                                                   greedy_reward: greedy, scale: $("scale").value});
    if (g !== group || mine !== advSeq) return;
    adv = r.advantages; advFor = g;
    await surrogate();
  }

  async function surrogate() {
    const g = group;
    if (advFor !== g) return;  // its advantages are on their way; recompute() calls back
    const est = $("estimator").value, a = adv[est], mine = ++surSeq, forAdv = adv;
    const ratio = Number($("ratio").value), lo = Number($("eps-low").value), hi = Number($("eps-high").value);
    $("ratio-value").replaceChildren(T.num(ratio, {id: "ratio-shown"}));
    $("eps-low-value").replaceChildren(T.num(lo)); $("eps-high-value").replaceChildren(T.num(hi));
    const s = await T.api("/api/grpo/surrogate", {advantages: a, lengths: g.lengths, ratio, eps_low: lo, eps_high: hi,
                                                  curve_advantage: a[selectedRow]});
    if (g !== group || advFor !== g || adv !== forAdv || mine !== surSeq) return;
    drawTable(s);
    const c = s.curve, clipped = c.ratio.map((r, i) => c.clipped[i] ? c.objective[i] : null);
    T.lineChart($("curve"), [
      {name: "min(rA, clip(r)A)", x: c.ratio, y: c.objective, color: "#1f77b4"},
      {name: "clip binds", x: c.ratio, y: clipped, color: "#d62728", width: 4},
    ], {id: "surrogate-chart", title: `surrogate of completion ${selectedRow + 1} (${est}, A = ${T.fmt(c.advantage)})`, xLabel: "ratio r = π/π_old",
        yLabel: "objective", width: 480, legend: true,
        vlines: [{x: ratio, label: "r"}, {x: 1 - lo, label: "1−ε"}, {x: 1 + hi, label: "1+ε"}]});
    $("loss").replaceChildren(
      T.el("div", {}, "policy_loss (token-mean): ", T.num(s.policy_loss, {id: "policy-loss"})),
      T.el("div", {}, "clip_ratio/low_mean: ", T.num(s.clip_ratio.low_mean, {id: "clip-low"})),
      T.el("div", {}, "clip_ratio/high_mean: ", T.num(s.clip_ratio.high_mean, {id: "clip-high"})));
  }

  function rewardSlider(i) {
    const input = T.el("input", {type: "range", class: "reward", min: -2, max: 2, step: 0.05, value: group.rewards[i],
                                 id: `reward-${i}`, "aria-label": `reward of completion ${i + 1}`});
    input.addEventListener("input", () => { group.rewards[i] = Number(input.value); schedule(); });
    return T.el("span", {}, input, " ", T.num(group.rewards[i], {class: "num reward-value"}));
  }

  // The table is built once per group; slider drags then only refresh its numbers (rebuilding it
  // would replace the slider being dragged).
  let builtFor = null;
  function drawTable(s) {
    if (builtFor !== group) buildTable(s);
    document.querySelectorAll("#advantages-table tbody tr").forEach((tr, i) => {
      tr.classList.toggle("selected", i === selectedRow);
      for (const e of src.estimators) tr.querySelector(`td[data-key="${e}"]`).replaceChildren(T.num(adv[e][i]));
      const cell = tr.querySelector('td[data-key="loss"]');
      cell.replaceChildren(T.num(s.rows[i].loss));
      cell.classList.toggle("clip-low", s.rows[i].clipped_low);
      cell.classList.toggle("clip-high", s.rows[i].clipped_high);
      tr.querySelector('td[data-key="clip"]').textContent = s.rows[i].clipped_low ? "low" : s.rows[i].clipped_high ? "high" : "";
      tr.querySelector(".reward-value").replaceChildren(T.fmt(group.rewards[i]));
      tr.querySelector(".reward-value").dataset.value = String(group.rewards[i]);
    });
  }

  function buildTable(s) {
    builtFor = group;
    const rows = group.rewards.map((r, i) => ({i: i + 1, completion: group.completions[i], reward: r,
                                                length: group.lengths ? group.lengths[i] : null}));
    const cols = [
      {key: "i", label: "#"},
      {key: "completion", label: "completion", format: c => c === null ? T.el("span", {class: "muted"}, "–") : T.el("pre", {}, c)},
      {key: "reward", label: "reward", format: (v, row) => rewardSlider(row.i - 1)},
      {key: "length", label: "tokens", numeric: true},
      ...src.estimators.map(e => ({key: e, label: e, numeric: true, format: () => ""})),
      {key: "loss", label: "surrogate L", numeric: true, format: () => ""},
      {key: "clip", label: "clip binds", format: () => ""},
    ];
    T.table($("group-table"), rows, cols, {id: "advantages-table", rowId: r => String(r.i),
      onRowClick: (r) => { if (selectedRow !== r.i - 1) { selectedRow = r.i - 1; surrogate().catch(e => T.status(e.message, true)); } }});
  }

  async function loadRun() {
    const run = $("run-pick").value;
    if (!run) return;
    const r = await T.api("/api/grpo/groups?run=" + encodeURIComponent(run));
    $("group-pick").replaceChildren(...r.groups.map((g, i) => T.el("option", {value: i}, `step ${g.step}: ${g.prompt.slice(0, 40)} (${g.rewards.length})`)));
    $("group-pick").groups = r.groups;
    pickGroup();
  }

  function pickGroup() {
    const groups = $("group-pick").groups || [];
    const g = groups[Number($("group-pick").value) || 0];
    if (!g) { setGroup(manualGroup(G)); if (groups === $("group-pick").groups) T.status("this run has no scored samples"); return; }
    const n = Math.min(G, g.rewards.length);  // a logged group may hold fewer than G
    setGroup({prompt: g.prompt, completions: g.completions.slice(0, n), rewards: g.rewards.slice(0, n),
              lengths: g.lengths ? g.lengths.slice(0, n) : null});
  }

  async function sample() {
    const body = {checkpoint: $("ckpt-pick").value, prompt: $("prompt").value, answer: $("answer").value,
                  reward: $("reward-pick").value, n: G, temperature: Number($("temperature").value)};
    $("sample").disabled = true;
    try {
      let job = await T.api("/api/grpo/sample", body);
      while (job.state !== "done") {
        if (job.state === "error") throw new Error(job.error);
        $("sample-progress").textContent = job.message;
        await new Promise(r => setTimeout(r, 250));
        job = await T.api("/api/grpo/job/" + job.id);
      }
      const g = job.result;
      $("greedy").value = g.greedy_reward;
      $("sample-progress").textContent = `greedy completion: ${JSON.stringify(g.greedy_completion)} (reward ${T.fmt(g.greedy_reward)})`;
      setGroup({prompt: g.prompt, completions: g.completions, rewards: g.rewards, lengths: g.lengths});
    } finally { $("sample").disabled = false; }
  }

  function mode() {
    const m = $("source").value;
    $("samples-controls").hidden = m !== "samples";
    $("live-controls").hidden = m !== "live";
    if (m === "manual") setGroup(manualGroup(G));
    if (m === "samples") loadRun().catch(e => T.status(e.message, true));
  }

  async function main() {
    await T.nav("grpo");
    src = await T.api("/api/grpo/sources");
    for (const g of src.group_sizes) {
      const b = T.el("button", {"data-g": g, id: `g-${g}`}, String(g));
      b.addEventListener("click", () => setSize(g));
      $("sizes").append(b, " ");
    }
    $("scale").replaceChildren(...src.scales.map(s => T.el("option", {value: s}, s)));
    $("estimator").replaceChildren(...src.estimators.map(s => T.el("option", {value: s}, s)));
    $("run-pick").replaceChildren(...src.runs.map(r => T.el("option", {value: r}, r)));
    $("ckpt-pick").replaceChildren(...src.checkpoints.map(r => T.el("option", {value: r}, r)));
    $("reward-pick").replaceChildren(...src.rewards.map(r => T.el("option", {value: r}, r)));
    if (!src.runs.length) $("source").querySelector('option[value="samples"]').disabled = true;
    if (!src.checkpoints.length) $("source").querySelector('option[value="live"]').disabled = true;
    $("source").addEventListener("change", mode);
    $("run-pick").addEventListener("change", () => loadRun().catch(e => T.status(e.message, true)));
    $("group-pick").addEventListener("change", pickGroup);
    $("sample").addEventListener("click", () => sample().catch(e => T.status(e.message, true)));
    for (const id of ["greedy", "scale"]) $(id).addEventListener("input", schedule);
    for (const id of ["ratio", "eps-low", "eps-high", "estimator"]) $(id).addEventListener("input", () => surrogate().catch(e => T.status(e.message, true)));
    setSize(8);
  }
  main().catch(e => T.status(e.message, true));
})();
