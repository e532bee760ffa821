// Training stages: one quickstart (or a listed chain of checkpoints) answering the same problems.
"use strict";
(function () {
  const T = window.tether, $ = id => document.getElementById(id);
  let sources = null, chain = [], results = [], selected = [];

  function currentChain() {
    const pick = $("chain-pick").value;
    if (pick === "__custom__") return {run: null, stages: chain.map(c => ({stage: c, checkpoint: c}))};
    const q = sources.quickstarts.find(x => x.run === pick);
    return {run: q.run, stages: q.stages};
  }

  function drawChainPicker() {
    const pick = $("chain-pick");
    pick.replaceChildren(...sources.quickstarts.map(q => T.el("option", {value: q.run}, `quickstart: ${q.run}`)),
                         T.el("option", {value: "__custom__"}, "checkpoints I list…"));
    $("ckpt-pick").replaceChildren(...sources.checkpoints.map(c => T.el("option", {value: c}, c)));
    const custom = () => { $("custom-chain").hidden = pick.value !== "__custom__"; };
    pick.addEventListener("change", custom);
    custom();
  }

  function drawBars() {
    T.barChart($("bars"), results.map(r => ({label: r.stage, value: r.accuracy,
                                             color: selected.includes(r.stage) ? "#d62728" : "#1f77b4"})),
               {id: "stage-bars", title: "held-out accuracy (pass@1, greedy)", yLabel: "accuracy", width: 420,
                hlines: [], onClick: (b) => select(b.label)});
    const c = currentChain(), q = c.run && sources.quickstarts.find(x => x.run === c.run);
    const recorded = q ? Object.fromEntries(q.stages.map(s => [s.stage, s.accuracy])) : null;
    T.table($("summary"), results.map(r => Object.assign({recorded: recorded ? recorded[r.stage] : null}, r)), [
      {key: "stage", label: "stage"},
      {key: "accuracy", label: "accuracy", numeric: true},
      {key: "correct", label: "right", numeric: true},
      ...(q ? [{key: "recorded", label: `quickstart's (all ${q.split.n_test})`, numeric: true}] : []),
      {key: "misses", label: "misses by kind", format: m => Object.entries(m || {}).map(([k, n]) => `${k} ${n}`).join(", ")},
    ], {id: "stage-table", rowId: r => r.stage, onRowClick: r => select(r.stage)});
  }

  function select(stage) {
    if (selected.includes(stage)) selected = selected.filter(s => s !== stage);
    else selected = selected.length >= 2 ? [stage] : selected.concat([stage]);
    drawBars();
    showDetail();
  }

  async function showDetail() {
    const detail = $("detail");
    if (selected.length === 0) { $("detail-title").textContent = ""; detail.replaceChildren(); return; }
    const byStage = s => results.find(r => r.stage === s);
    if (selected.length === 1) {
      const r = byStage(selected[0]);
      $("detail-title").textContent = `${r.stage}: its answers`;
      T.table(detail, r.answers, [
        {key: "prompt", label: "prompt"}, {key: "answer", label: "answer"},
        {key: "completion", label: "completion", format: c => T.el("pre", {}, c)},
        {key: "correct", label: "right", format: v => v ? "✓" : "✗"}, {key: "kind", label: "kind"},
      ], {id: "answers-table"});
      return;
    }
    const [a, b] = selected.map(byStage), c = currentChain();
    $("detail-title").textContent = `${a.stage} → ${b.stage}: what changed`;
    const d = await T.api("/api/stages/diff", {checkpoint: a.checkpoint, other: b.checkpoint, run: c.run,
                                                count: a.answers.length});
    T.table(detail, d.rows, [
      {key: "prompt", label: "prompt"}, {key: "answer", label: "answer"},
      {key: "a_correct", label: a.stage, format: v => v ? "✓" : "✗"},
      {key: "b_correct", label: b.stage, format: v => v ? "✓" : "✗"},
      {key: "diff", label: "completion (red: only " + a.stage + ", green: only " + b.stage + ")",
       format: segs => T.el("pre", {class: "diff"}, ...segs.map(s => s.op === "equal" ? s.text + " " :
         T.el(s.op === "delete" ? "del" : "ins", {}, s.text + " ")))},
    ], {id: "diff-table"});
  }

  // Start the chain's job and poll it: each finished stage's bar appears as it comes.
  async function run() {
    const c = currentChain(), count = Number($("count").value) || 20;
    if (!c.stages.length) { T.status("list at least one checkpoint", true); return; }
    results = []; selected = []; showDetail(); drawBars();
    $("run").disabled = true;
    try {
      let job = await T.api("/api/stages/answer", {checkpoints: c.stages.map(s => s.checkpoint),
                                                   labels: c.stages.map(s => s.stage), run: c.run, count});
      while (true) {
        job = await T.api("/api/stages/job/" + job.id);
        if (job.partial.length !== results.length) {
          results = job.partial.map(r => Object.assign({correct: r.answers.filter(a => a.correct).length}, r));
          drawBars();
        }
        $("progress").textContent = job.state === "done" ? `${results.length} stages × ${count} problems` : job.message;
        if (job.state === "error") throw new Error(job.error);
        if (job.state === "done") break;
        await new Promise(r => setTimeout(r, 300));
      }
    } finally { $("run").disabled = false; }
  }

  async function main() {
    await T.nav("stages");
    sources = await T.api("/api/stages/sources");
    $("count").value = sources.default_count;
    if (!sources.quickstarts.length && !sources.checkpoints.length) { $("empty").hidden = false; $("run").disabled = true; }
    drawChainPicker();
    $("ckpt-add").addEventListener("click", () => { chain.push($("ckpt-pick").value); $("chain-list").textContent = chain.join(" → "); });
    $("ckpt-clear").addEventListener("click", () => { chain = []; $("chain-list").textContent = ""; });
    $("run").addEventListener("click", () => run().catch(e => T.status(e.message, true)));
  }
  main().catch(e => T.status(e.message, true));
})();
