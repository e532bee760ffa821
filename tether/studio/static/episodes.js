// Episodes: a run's multi-turn samples of one step; one episode turn by turn, its trained tokens
// (model segments) told apart from the masked ones (the environment's), with its rewards and counts.
"use strict";
(function () {
  const T = window.tether, $ = id => document.getElementById(id);
  const params = new URLSearchParams(location.search);
  let reasons = {}, data = null, current = null, seq = 0;

  function remember() {  // the URL names what is shown (the Runs page links here the same way)
    const q = new URLSearchParams();
    if ($("run-pick").value) q.set("run", $("run-pick").value);
    if (data && data.step !== null) q.set("step", String(data.step));
    if (current !== null) q.set("sample", String(current));
    history.replaceState(null, "", "/episodes?" + q.toString());
  }

  async function loadStep(step, sample) {
    const run = $("run-pick").value, mine = ++seq;
    if (!run) return;
    const q = `/api/episodes/samples?run=${encodeURIComponent(run)}` + (step === null || step === undefined ? "" : `&step=${step}`);
    const d = await T.api(q);
    if (mine !== seq) return;  // a newer choice was made meanwhile
    data = d;
    $("step-pick").replaceChildren(...d.steps.map(s => T.el("option", {value: String(s), selected: s === d.step}, String(s))));
    const at = d.steps.indexOf(d.step);
    $("step-prev").disabled = at <= 0;
    $("step-next").disabled = at < 0 || at >= d.steps.length - 1;
    $("step-count").textContent = `${d.episodes.length} episodes at step ${d.step} · ${d.steps.length} logged steps`;
    T.table($("episodes-table"), d.episodes, [
      {key: "index", label: "#", numeric: true, format: v => String(v + 1)},
      {key: "prompt", label: "prompt", format: v => T.el("pre", {title: v}, short(v))},
      {key: "reward", label: "reward", numeric: true, sortable: true},
      {key: "advantage", label: "advantage", numeric: true, sortable: true},
      {key: "turns", label: "turns", numeric: true, sortable: true},
      {key: "tool_calls", label: "tool calls", numeric: true, sortable: true},
      {key: "tool_errors", label: "tool errors", numeric: true, sortable: true},
      {key: "finish_reason", label: "finish", sortable: true, format: v => T.el("span", {class: "finish-" + v}, v || "–")},
    ], {id: "episodes", rowId: e => String(e.index), onRowClick: e => show(e.index), onSort: mark});
    if (!d.episodes.length) {  // a run linked here that logs no episodes (yet)
      current = null; $("episode").hidden = true; $("step-count").textContent = "no episodes logged"; remember();
      return;
    }
    const pick = Number(sample);
    show(Number.isInteger(pick) && pick >= 0 && pick < d.episodes.length ? pick : 0);
  }

  function short(text) {  // a prompt in the table: its first line, at most 100 characters
    const first = text.split("\n")[0];
    return first.length > 100 ? first.slice(0, 100) + "…" : first + (first.length < text.length ? " …" : "");
  }

  function item(label, node, attrs) {
    return T.el("span", Object.assign({class: "item"}, attrs || {}), T.el("span", {class: "muted"}, label), node);
  }

  // An assistant message with its tool calls marked where they are written (each call's text, in order).
  function withCalls(text, calls) {
    const pre = T.el("pre", {class: "content"});
    let at = 0;
    for (const c of calls) {
      const k = c.text ? text.indexOf(c.text, at) : -1;
      if (k < 0) continue;
      pre.append(text.slice(at, k), T.el("mark", {class: "call"}, c.text));
      at = k + c.text.length;
    }
    pre.append(text.slice(at));
    return pre;
  }

  function callLine(c) {
    const args = [...(c.positional || []).map(v => JSON.stringify(v)),
                  ...Object.entries(c.arguments || {}).map(([k, v]) => `${k}=${JSON.stringify(v)}`)].join(", ");
    return T.el("li", {class: c.error ? "call error" : "call"}, c.error ? `${c.name || "?"}: ${c.error}` : `${c.name}(${args})`);
  }

  function message(m) {
    const role = m.role + (m.name ? " · " + m.name : "");
    return T.el("div", {class: "msg " + m.role, "data-role": m.role},
                T.el("div", {class: "role"}, role), T.el("pre", {class: "content"}, String(m.content ?? "")));
  }

  function seg(kind, text, attrs) {
    return T.el("span", Object.assign({class: "seg " + (kind === "model" ? "trained" : "masked"), "data-kind": kind}, attrs || {}), text);
  }

  function mark() {  // the episode shown, highlighted in the table (sorting draws the table again)
    document.querySelectorAll("#episodes tbody tr").forEach(tr => tr.classList.toggle("selected", tr.dataset.id === String(current)));
  }

  function show(i) {
    current = i;
    const e = data.episodes[i];
    mark();
    $("episode").hidden = false;
    $("ep-title").textContent = `${i + 1} of ${data.episodes.length}, step ${e.step}`;
    const fns = Object.entries(e.rewards).map(([k, v]) => item(`rewards/${k}`, T.num(v, {class: "num fn-reward", "data-fn": k})));
    $("ep-summary").replaceChildren(
      item(e.reward_name, T.num(e.reward, {id: "ep-reward"})),
      item("advantage", T.num(e.advantage, {id: "ep-advantage"})),
      item("env reward", T.num(e.env_reward, {id: "ep-env-reward"})),
      ...fns,
      item("finish", T.el("span", {id: "ep-finish", class: "finish-" + e.finish_reason, title: reasons[e.finish_reason] || ""},
                          e.finish_reason || "–"), {title: reasons[e.finish_reason] || ""}),
      T.el("span", {class: "muted", id: "ep-finish-why"}, reasons[e.finish_reason] || ""),
      item("turns", T.num(e.turns, {id: "ep-turns"})),
      item("tool calls", T.num(e.tool_calls, {id: "ep-tool-calls"})),
      item("tool errors", T.num(e.tool_errors, {id: "ep-tool-errors"})),
      item(e.turn_rewards_by_turn ? "turn rewards (one per turn)" : "turn rewards (of the turns the environment rewarded)",
           T.el("span", {id: "ep-turn-rewards"}, ...(e.turn_rewards.length
             ? e.turn_rewards.flatMap((r, k) => [k ? ", " : "", T.num(r, {class: "num turn-reward"})]) : ["none"]))));
    $("context").replaceChildren(...(e.context.length ? [T.el("div", {class: "panel", id: "prompt"},
      T.el("div", {class: "turn-head"}, T.el("span", {class: "seg prompt"}, "prompt")), ...e.context.map(message))] : []));
    $("turns").replaceChildren(...e.by_turn.map(t => {
      const said = [T.el("h3", {}, "transcript: what the environment read, and its reply")];
      if (t.assistant === null) said.push(T.el("p", {class: "muted cut"}, "cut by the token budget: the environment never read this turn"));
      else said.push(T.el("div", {class: "msg assistant", "data-role": "assistant"}, T.el("div", {class: "role"}, "assistant"),
                          withCalls(t.assistant, t.calls)));
      if (t.calls.length) said.push(T.el("ul", {class: "calls"}, ...t.calls.map(callLine)));
      said.push(...t.replies.map(message));
      const toks = T.el("pre", {class: "tokens"});
      if (t.model !== null) toks.append(seg("model", t.model));
      if (t.env !== null) toks.append(seg("env", t.env));
      const head = T.el("div", {class: "turn-head"}, `turn ${t.turn}`);
      if (t.reward !== null) head.append(" · reward ", T.num(t.reward, {class: "num turn-reward-at", id: `turn-reward-${t.turn}`}));
      if (t.env === null && t.replies.length && t.model !== null)
        head.append(T.el("span", {class: "muted"}, " · the reply was not fed back (the episode ended)"));
      return T.el("div", {class: "turn panel", "data-turn": String(t.turn)}, head,
                  T.el("div", {class: "turn-body"}, T.el("div", {class: "said"}, ...said),
                       T.el("div", {}, T.el("h3", {}, "tokens: what the loss saw"), toks)));
    }));
    $("stream").replaceChildren(...e.segments.map(([kind, text], k) => seg(kind, text, {"data-index": String(k)})));
    remember();
  }

  async function main() {
    await T.nav("episodes");
    const r = await T.api("/api/episodes/runs");
    reasons = r.finish_reasons;
    const want = params.get("run");
    const runs = want && !r.runs.includes(want) ? [want, ...r.runs] : r.runs;  // a run linked before its first episode is judged
    $("run-pick").replaceChildren(...runs.map(id => T.el("option", {value: id, selected: id === want}, id)));
    $("empty").hidden = runs.length > 0;
    if (!runs.length) return;
    $("run-pick").addEventListener("change", () => { current = null; loadStep(null).catch(e => T.status(e.message, true)); });
    $("step-pick").addEventListener("change", () => loadStep(Number($("step-pick").value)).catch(e => T.status(e.message, true)));
    const move = d => () => {
      const k = data ? data.steps.indexOf(data.step) + d : -1;
      if (data && k >= 0 && k < data.steps.length) loadStep(data.steps[k]).catch(e => T.status(e.message, true));
    };
    $("step-prev").addEventListener("click", move(-1));
    $("step-next").addEventListener("click", move(1));
    const step = params.get("step");
    await loadStep(step === null || step === "" ? null : Number(step), params.get("sample"));
  }
  main().catch(e => T.status(e.message, true));
})();
