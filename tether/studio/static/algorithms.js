// Algorithms & memory: cards derived from tether.memory's held models, bars from tether.memory.estimate.
"use strict";
(function () {
  const T = window.tether, $ = id => document.getElementById(id);
  let choices = null, size = "7B", hfConfig = null, seq = 0;

  function state() {
    return {size, hf_config: hfConfig, algo: $("algo").value, lora: $("lora").checked,
            gradient_checkpointing: $("ckpt").checked, gpus: Number($("gpus").value), sharding: $("sharding").value};
  }

  async function refresh() {
    $("sharding-label").hidden = Number($("gpus").value) === 1;
    const mine = ++seq, r = await T.api("/api/algorithms/explore", state());
    if (mine !== seq) return;  // a newer choice is on its way
    drawCards(r.cards);
    const est = r.estimate, t = est.totals_gb;
    $("headline").replaceChildren(
      T.el("div", {}, `${est.algo} on ${est.model} (${T.fmt(est.params / 1e9)}B params${est.per_gpu ? `, per GPU of ${est.config.gpus}` : ""}): peak `,
           T.num(t.peak, {id: "peak-gb"}), " GB"),
      T.el("div", {}, ...r.markers_gb.map(m => T.el("span", {class: r.fits[String(m)] ? "fits" : "nofit", "data-gb": m},
                                                    `${m} GB ${r.fits[String(m)] ? "✓" : "✗"}   `))));
    T.barChart($("bars"), r.bars.map(b => ({label: b.label, parts: b.segments.map(s => ({name: s.group, value: s.gb}))})),
               {id: "memory-bars", title: "GB per GPU", yLabel: "GB", width: 640, height: 340,
                hlines: r.markers_gb.map(m => ({y: m, label: `${m} GB`}))});
    T.table($("components"), est.components.map(c => Object.assign({}, c, {where: c.device === "cpu" ? "CPU" : "GPU"})), [
      {key: "component", label: "component"}, {key: "group", label: "group"},
      {key: "gb", label: "GB", numeric: true}, {key: "where", label: "on"}, {key: "note", label: "note"},
    ], {id: "components-table", rowId: c => c.component});
    $("command").textContent = r.command;
  }

  function drawCards(cards) {
    $("cards").replaceChildren(...cards.map(c => {
      const card = T.el("div", {class: "panel card" + (c.algo === $("algo").value ? " current" : ""), id: `card-${c.algo}`, "data-algo": c.algo},
        T.el("h3", {}, c.algo.toUpperCase(), " ", T.el("span", {class: "tag " + (c.online ? "online" : "offline")}, c.online ? "online" : "offline")),
        T.el("div", {class: "muted"}, "models held"),
        T.el("ul", {class: "models"}, ...c.models.map(m => T.el("li", {"data-trained": m.trained}, `${m.name} — ${m.trained ? "trained" : "frozen"}`))),
        T.el("div", {class: "muted"}, "data"),
        T.el("ul", {}, ...c.data.map(d => T.el("li", {}, `${d.format}: `, T.el("code", {}, d.columns.join(", "))))),
        T.el("div", {class: "muted"}, "objective"),
        T.el("ul", {}, ...c.objectives.map(o => T.el("li", {title: o.summary}, T.el("code", {}, o.name)))));
      card.addEventListener("click", () => { $("algo").value = c.algo; refresh().catch(e => T.status(e.message, true)); });
      return card;
    }));
  }

  function setSize(s) {
    size = s; hfConfig = null;
    for (const b of $("sizes").querySelectorAll("button")) b.classList.toggle("current", b.dataset.size === s);
    refresh().catch(e => T.status(e.message, true));
  }

  async function main() {
    await T.nav("algorithms");
    choices = await T.api("/api/algorithms/choices");
    for (const s of choices.sizes) {
      const b = T.el("button", {"data-size": s, id: `size-${s}`}, s);
      b.addEventListener("click", () => setSize(s));
      $("sizes").append(b, " ");
    }
    $("algo").replaceChildren(...choices.memory_algos.map(a => T.el("option", {value: a, selected: a === "grpo"}, a)));
    $("gpus").replaceChildren(...choices.gpus.map(g => T.el("option", {value: g}, String(g))));
    $("size").addEventListener("change", () => { if ($("size").value.trim()) setSize($("size").value.trim()); });
    $("use-config").addEventListener("click", () => { hfConfig = $("hf-config").value; refresh().catch(e => T.status(e.message, true)); });
    for (const id of ["algo", "lora", "ckpt", "gpus", "sharding"]) $(id).addEventListener("change", () => refresh().catch(e => T.status(e.message, true)));
    setSize("7B");
  }
  main().catch(e => T.status(e.message, true));
})();
