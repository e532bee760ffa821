// Reward hacking: a study's gold vs proxy curves, the β slider, and the samples that show the hack.
"use strict";
(function () {
  const T = window.tether, $ = id => document.getElementById(id);
  let study = null, run = null, stopPoll = null;

  function sampleTable(container, rows, id) {
    T.table(container, rows, [
      {key: "prompt", label: "prompt"}, {key: "completion", label: "completion", format: c => T.el("pre", {}, c)},
      {key: "proxy", label: "proxy", numeric: true, sortable: true}, {key: "gold", label: "gold", numeric: true, sortable: true},
      {key: "rel", label: "topic words", numeric: true}, {key: "rep", label: "repeats", numeric: true},
      {key: "off", label: "off-topic", numeric: true}, {key: "length", label: "words", numeric: true},
    ], {id});
  }

  function drawCurves(beta) {
    const betas = study.betas;
    const series = key => betas.flatMap((b, i) => {
      const c = study.ppo[b], mine = b === beta;
      const out = [{name: `β=${b}`, x: c.d, y: c[key], points: true, width: mine ? 3 : 1, color: T.PALETTE[i % 8]}];
      if (key === "gold") out.push({x: c.fit_d, y: c.fit_gold, dash: "3 3", color: T.PALETTE[i % 8], width: mine ? 2 : 1});
      return out;
    });
    const peak = study.ppo[beta].peak;
    T.lineChart($("gold-chart"), series("gold"), {id: "gold-chart-svg", title: "gold reward gain (dotted: Gao fit)",
      xLabel: "d = √KL", yLabel: "gain", width: 440, vlines: [{x: peak.d, label: "gold peak"}], hlines: [{y: 0}]});
    T.lineChart($("proxy-chart"), series("proxy"), {id: "proxy-chart-svg", title: "proxy (RM) reward gain",
      xLabel: "d = √KL", yLabel: "gain", width: 440, hlines: [{y: 0}]});
    const v = study.views[beta];
    $("beta-panel").replaceChildren(
      T.el("div", {}, T.el("b", {}, `β = ${beta}`)),
      T.el("div", {}, "gold peaks at d = ", T.num(v.peak_d, {id: "peak-d"}), " (step ", T.num(v.peak_step, {id: "peak-step"}), ")"),
      T.el("div", {}, "peak gold gain ", T.num(v.peak_gain, {id: "peak-gain"})),
      T.el("div", {}, "final gold gain ", T.num(v.final_gold, {id: "final-gold"}), ", proxy gain ", T.num(v.final_proxy, {id: "final-proxy"})),
      T.el("div", {}, "final KL ", T.num(v.final_kl, {id: "final-kl"}), " nats"),
      T.el("div", {id: "verdict"}, v.overoptimized ? "over-optimized: gold fell after its peak while the proxy kept rising" : "gold still at its peak"),
      T.el("div", {class: "muted"}, `highest gold peak: β = ${study.best_beta}`));
  }

  async function drawSamples(beta) {
    const s = await T.api(`/api/hacking/samples?run=${encodeURIComponent(run)}&beta=${encodeURIComponent(beta)}`);
    $("hack-title").textContent = `PPO at β = ${s.beta}, its last step (${s.hack_step}): what the proxy rewards`;
    sampleTable($("hack-table"), s.hack, "hack-samples");
    $("optimal-title").textContent = `gold-optimal: β = ${s.best_beta} at its gold peak (step ${s.optimal_step})`;
    sampleTable($("optimal-table"), s.optimal, "optimal-samples");
  }

  function drawStudy() {
    $("study-view").hidden = false;
    const b = study.bon;
    T.lineChart($("bon-chart"), [
      {name: "gold", x: b.d, y: b.gold, points: true, color: T.PALETTE[0]},
      {name: "proxy", x: b.d, y: b.proxy, points: true, color: T.PALETTE[1]},
      {name: "gold fit d(α − βd)", x: b.fit_d, y: b.fit_gold_curve, dash: "3 3", color: T.PALETTE[0]},
      {name: "proxy fit", x: b.fit_d, y: b.fit_proxy_curve, dash: "3 3", color: T.PALETTE[1]},
    ], {id: "bon-chart-svg", title: "best-of-n (n = " + b.n.join(", ") + ")", xLabel: "d = √(log n − (n−1)/n)", yLabel: "gain", width: 440});
    const rm = study.rm || {};
    $("rm-panel").replaceChildren(
      T.el("div", {}, "proxy RM held-out accuracy ", T.num(rm.eval_accuracy, {id: "rm-acc"})),
      T.el("div", {}, "Bayes-optimal ", T.num(rm.bayes_optimal_accuracy, {id: "rm-bayes"})),
      T.el("div", {}, "best-of-n gold fit: α ", T.num(b.fit_gold.alpha), ", β ", T.num(b.fit_gold.beta), ", R² ", T.num(b.fit_gold.r2, {id: "bon-r2"})));
    const slider = $("beta");
    slider.max = String(study.betas.length - 1);
    slider.value = "0";
    onBeta();
  }

  function onBeta() {
    const beta = study.betas[Number($("beta").value)];
    $("beta-value").textContent = beta;
    drawCurves(beta);
    drawSamples(beta).catch(e => T.status(e.message, true));
  }

  async function openStudy(id) {
    run = id;
    if (stopPoll) { stopPoll(); stopPoll = null; }
    $("study-view").hidden = true;
    stopPoll = T.poll(async () => {
      const s = await T.api("/api/hacking/study?run=" + encodeURIComponent(id));
      if (s.status === "done") {
        if (stopPoll) stopPoll();
        $("progress-box").hidden = true;
        if (document.getElementById("status")) T.status("");  // no empty status bar over the page
        study = s; drawStudy();
        return;
      }
      $("progress-box").hidden = false;
      const p = s.progress || {fraction: 0};
      $("progress").value = p.fraction;
      $("progress-text").textContent = `${s.state}: ${Math.round(100 * p.fraction)} % — world ${p.world ? "✓" : "…"}, ` +
        `proxy RM ${p.rm ? "✓" : "…"}, PPO steps ${p.ppo_steps || 0}/${p.ppo_total || "?"}`;
      $("progress").dataset.value = String(p.fraction);
      // failed: the study this studio started died; stopped: nobody is writing it now (it may be
      // copied in, or resumed elsewhere), so the page keeps looking
      if (s.state === "failed") { if (stopPoll) stopPoll(); T.status(`study ${id} failed before it finished: ${(s.log || "").trim().split("\n").pop()}`, true); }
      else if (s.state === "stopped") T.status(`study ${id}: no process is writing it; its curves appear when its summary does`);
    }, 1000);
  }

  async function listStudies(select) {
    const r = await T.api("/api/hacking/studies");
    $("study-pick").replaceChildren(...r.studies.map(s => T.el("option", {value: s.run}, `${s.run} (${s.state})`)));
    $("empty").hidden = r.studies.length > 0;
    if (select) $("study-pick").value = select;
    if ($("study-pick").value) await openStudy($("study-pick").value);
  }

  async function main() {
    await T.nav("hacking");
    $("study-pick").addEventListener("change", () => openStudy($("study-pick").value));
    $("beta").addEventListener("input", onBeta);
    $("start").addEventListener("click", async () => {
      try {
        const r = await T.api("/api/hacking/start", {name: $("new-name").value});
        T.status("started: " + r.command);
        await listStudies(r.run);
      } catch (e) { T.status(e.message, true); }
    });
    await listStudies();
  }
  main().catch(e => T.status(e.message, true));
})();
