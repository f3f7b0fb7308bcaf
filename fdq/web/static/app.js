// FDQ dashboard: polls the JSON API (api/...) and draws what it says. No framework,
// nothing loaded from elsewhere; charts are drawn on canvases by Chart below.
"use strict";

const state = {
  info: null,
  route: null,
  gen: 0,                 // bumps on every route change: late answers of the old view are dropped
  timer: null,
  busy: false,            // a refresh is on its way
  again: false,           // ... and another was asked for meanwhile
  samples: [],            // the open topic's history samples (oldest first)
  windowS: 300,           // the charts' time window
  charts: {},
  selected: new Set(),    // dead letter ids ticked on the DLQ view
  dlqIds: [],
};

// -- small helpers ------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "text") el.textContent = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "style") {       // through CSSOM: the page's CSP refuses style attributes
      for (const [p, val] of Object.entries(v)) {
        if (p.startsWith("--")) el.style.setProperty(p, val); else el.style[p] = val;
      }
    }
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

const $ = (sel) => document.querySelector(sel);
const fmt = (n) => (n === null || n === undefined) ? "–" : Number(n).toLocaleString("en-US");
const fmtRate = (n) => (n === null || n === undefined) ? "–" : (n >= 100 ? Math.round(n).toLocaleString("en-US") : n.toFixed(1));

function fmtAge(s) {
  if (s === null || s === undefined) return "–";
  if (s < 60) return s.toFixed(1) + " s";
  if (s < 3600) return Math.floor(s / 60) + "m " + Math.round(s % 60) + "s";
  return Math.floor(s / 3600) + "h " + Math.round((s % 3600) / 60) + "m";
}

function fmtTime(ms) {
  if (!ms) return "–";
  const d = new Date(ms);
  return d.toLocaleTimeString("en-GB", { hour12: false }) + (Date.now() - ms > 86400e3 ? " " + d.toISOString().slice(0, 10) : "");
}

// A consumer's colour: picked by a hash of its id from a palette of distinct ones, the
// next free one where two consumers of a subscription would share it, and then kept for
// as long as the page is open (a consumer leaving does not repaint the others).
const OWNER_COLORS = ["#2f6fde", "#e0662b", "#1f9d55", "#8e44ad", "#d4a20b", "#16a0a0",
  "#c2185b", "#5d6d7e", "#7cb342", "#6d4c41", "#3949ab", "#00897b"];
const ownerColors = new Map();

function hashOf(text) {
  let x = 2166136261;
  for (const ch of String(text)) x = Math.imul(x ^ ch.charCodeAt(0), 16777619);
  return x >>> 0;
}

function assignColors(ids) {
  const taken = new Set(ids.filter((id) => ownerColors.has(id)).map((id) => ownerColors.get(id)));
  for (const id of [...ids].sort()) {
    if (ownerColors.has(id)) continue;
    let i = hashOf(id) % OWNER_COLORS.length;
    for (let n = 0; n < OWNER_COLORS.length && taken.has(OWNER_COLORS[i]); n++) i = (i + 1) % OWNER_COLORS.length;
    ownerColors.set(id, OWNER_COLORS[i]);
    taken.add(OWNER_COLORS[i]);
  }
}

function colorOf(id) {
  if (!ownerColors.has(id)) assignColors([id]);
  return ownerColors.get(id);
}

const enc = encodeURIComponent;

// -- the API ------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, body) {
    super(body && body.message ? body.message : `HTTP ${status}`);
    this.status = status;
    this.code = body && body.error;
  }
}

async function api(path, options = {}) {
  const headers = { "Accept": "application/json" };
  const token = sessionStorage.getItem("fdq-token");
  if (token) headers["Authorization"] = "Bearer " + token;
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch("api/" + path, {
    method: options.method || "GET", headers, cache: "no-store",
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
  });
  let body = null;
  try { body = await res.json(); } catch (e) { body = null; }
  if (!res.ok) throw new ApiError(res.status, body);
  return body;
}

function toast(text, kind) {
  const t = $("#toast");
  t.textContent = text;
  t.dataset.kind = kind;
  t.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { t.hidden = true; }, kind === "error" ? 9000 : 5000);
}

function confirmAction(title, text, okLabel) {
  const d = $("#confirm");
  $("#confirm-title").textContent = title;
  $("#confirm-text").textContent = text;
  $("#confirm-ok").textContent = okLabel || "Confirm";
  return new Promise((resolve) => {
    d.addEventListener("close", () => resolve(d.returnValue === "ok"), { once: true });
    d.returnValue = "";
    d.showModal();
  });
}

// An action: confirmed in the page, then posted; the answer (or the refusal) is shown.
async function act(title, text, okLabel, path, body) {
  if (!(await confirmAction(title, text, okLabel))) return null;
  try {
    const out = await api(path, { method: "POST", body: body || {} });
    toast(out.message, "ok");
    refreshSoon();
    return out;
  } catch (e) {
    toast(`${title} refused: ${e.message}`, "error");
    return null;
  }
}

function writeButton(label, attrs, onclick) {
  const writable = state.info && state.info.writable;
  return h("button", Object.assign({}, attrs, {
    onclick, disabled: !writable,
    title: writable ? null : "read-only: the server was started without a write token",
  }), label);
}

// -- the chart ------------------------------------------------------------------------

class Chart {
  constructor(id, title, unit) {
    this.canvas = h("canvas", { id: "chart-" + id, role: "img", "aria-label": title });
    this.legend = h("div", { class: "legend" });
    this.el = h("div", { class: "chart" }, h("h3", {}, title, h("span", { class: "muted", text: unit })), this.canvas, this.legend);
    this.series = [];
  }

  // series: [{name, color, points: [[t_ms, value|null], ...]}]
  set(series, windowS) {
    this.series = series;
    this.windowS = windowS;
    const last = {};
    for (const s of series) {
      const p = [...s.points].reverse().find((q) => q[1] !== null);
      last[s.name] = p ? p[1] : null;
    }
    this.canvas.dataset.last = JSON.stringify(last);
    this.canvas.dataset.points = String(series.reduce((n, s) => n + s.points.length, 0));
    this.legend.replaceChildren(...series.map((s) => h("span", { style: { "--c": s.color } },
      `${s.name} `, h("b", { text: s.format(last[s.name]) }))));
    this.draw();
  }

  draw() {
    const c = this.canvas, dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth, ht = c.clientHeight;
    if (!w || !ht) return;
    c.width = Math.round(w * dpr); c.height = Math.round(ht * dpr);
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, ht);
    const left = 46, right = 8, top = 8, bottom = 20;
    const now = Date.now(), t0 = now - this.windowS * 1000;
    let max = 0;
    for (const s of this.series) for (const [t, v] of s.points) if (t >= t0 && v !== null && v > max) max = v;
    const ymax = niceCeil(max);
    const X = (t) => left + (t - t0) / (now - t0) * (w - left - right);
    const Y = (v) => top + (1 - v / ymax) * (ht - top - bottom);
    g.font = "11px system-ui, sans-serif";
    g.strokeStyle = "#e6e9ef"; g.fillStyle = "#8a94a6"; g.lineWidth = 1;
    g.textAlign = "right"; g.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const v = ymax * i / 4, y = Math.round(Y(v)) + 0.5;
      g.beginPath(); g.moveTo(left, y); g.lineTo(w - right, y); g.stroke();
      g.fillText(shortNum(v), left - 6, y);
    }
    g.textAlign = "center"; g.textBaseline = "top";
    const step = this.windowS <= 60 ? 15 : this.windowS <= 300 ? 60 : 120;
    for (let s = 0; s <= this.windowS; s += step) {
      const x = X(now - s * 1000);
      g.fillText(s === 0 ? "now" : `-${s >= 60 ? s / 60 + "m" : s + "s"}`, Math.min(Math.max(x, left + 10), w - right - 12), ht - bottom + 5);
    }
    for (const s of this.series) {
      g.strokeStyle = s.color; g.lineWidth = 2; g.lineJoin = "round";
      g.setLineDash(s.dash || []);
      g.beginPath();
      let pen = false;
      for (const [t, v] of s.points) {
        if (t < t0 - 5000 || v === null) { pen = false; continue; }
        const x = X(t), y = Y(v);
        if (pen) g.lineTo(x, y); else g.moveTo(x, y);
        pen = true;
      }
      g.stroke();
      g.setLineDash([]);
      const lastP = [...s.points].reverse().find((q) => q[1] !== null && q[0] >= t0);
      if (lastP) { g.fillStyle = s.color; g.beginPath(); g.arc(X(lastP[0]), Y(lastP[1]), 3, 0, 2 * Math.PI); g.fill(); }
    }
  }
}

function niceCeil(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 4, 8, 10]) if (v <= m * p) return m * p;     // quarters stay round
  return 10 * p;
}

function shortNum(v) {
  if (v >= 1e6) return (v / 1e6).toFixed(v % 1e6 ? 1 : 0) + "M";
  if (v >= 1e3) return (v / 1e3).toFixed(v % 1e3 ? 1 : 0) + "k";
  return String(Math.round(v * 100) / 100);
}

const PALETTE = ["#2f6fde", "#e0662b", "#1f9d55", "#8e44ad", "#c0392b", "#16a0a0", "#b7950b"];

// -- routing --------------------------------------------------------------------------

function parseRoute() {
  const parts = location.hash.replace(/^#\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
  if (parts[0] === "topic" && parts[1] && parts[2] === "dlq" && parts[3]) return { view: "dlq", topic: parts[1], sub: parts[3] };
  if (parts[0] === "topic" && parts[1]) return { view: "topic", topic: parts[1] };
  return { view: "topics" };
}

function crumbs(route) {
  const items = [h("a", { href: "#/" }, "topics")];
  if (route.topic) items.push(h("span", { class: "sep" }, "/"), h("a", { href: `#/topic/${enc(route.topic)}` }, route.topic));
  if (route.sub) items.push(h("span", { class: "sep" }, "/"), h("span", {}, `${route.sub} dead letters`));
  $("#crumbs").replaceChildren(...items);
}

function go() {
  state.gen++;
  clearTimeout(state.timer);
  state.route = parseRoute();
  state.samples = [];
  state.selected = new Set();
  crumbs(state.route);
  const view = $("#view");
  view.replaceChildren();
  ({ topics: buildTopics, topic: buildTopic, dlq: buildDlq })[state.route.view](view, state.route);
  poll();
}

function pollMs() {
  const s = state.info ? state.info.sample_interval_s : 1;
  return Math.max(500, Math.min(2000, s * 1000));
}

// One refresh at a time: a refresh asked for while one is on its way (an action, a route
// change) runs right after it.
async function poll() {
  if (state.busy) { state.again = true; return; }
  state.busy = true;
  clearTimeout(state.timer);
  const gen = state.gen;
  try {
    await ({ topics: refreshTopics, topic: refreshTopic, dlq: refreshDlq })[state.route.view](state.route, gen);
    if (gen !== state.gen) return;
    $("#banner").hidden = true;
    const live = $("#live");
    live.textContent = "live · " + new Date().toLocaleTimeString("en-GB", { hour12: false });
    live.classList.remove("stale");
  } catch (e) {
    if (gen !== state.gen) return;
    const b = $("#banner");
    b.textContent = e.status === 401 || e.status === 403 ? `${e.message}` : `cannot read the dashboard's data: ${e.message} (retrying)`;
    b.hidden = false;
    $("#live").classList.add("stale");
  } finally {
    state.busy = false;
  }
  const soon = state.again || gen !== state.gen;
  state.again = false;
  clearTimeout(state.timer);
  state.timer = setTimeout(poll, soon ? 100 : pollMs());
}

function refreshSoon() {
  clearTimeout(state.timer);
  state.timer = setTimeout(poll, 150);
}

// -- topics ----------------------------------------------------------------------------

function buildTopics(view) {
  view.append(h("div", { class: "head" }, h("h1", {}, "Topics")),
    h("div", { class: "card" }, h("table", { id: "topics-table" },
      h("thead", {}, h("tr", {}, ["topic", "shards", "state", "subs", "consumers"].map((t) => h("th", {}, t)),
        ["inserted/s", "acked/s", "backlog", "in flight", "dead letters", "oldest ready"].map((t) => h("th", { class: "num" }, t)))),
      h("tbody", {}))));
}

async function refreshTopics(route, gen) {
  const data = await api("topics");
  if (gen !== state.gen) return;
  const tbody = $("#topics-table tbody");
  if (!data.topics.length) {
    tbody.replaceChildren(h("tr", {}, h("td", { colspan: 11, class: "empty" }, "No topics yet: push a message (fdq push TOPIC DATA) or create one.")));
    return;
  }
  tbody.replaceChildren(...data.topics.map((t) => h("tr", { dataset: { topic: t.name } },
    h("td", {}, h("a", { href: `#/topic/${enc(t.name)}` }, t.name)),
    h("td", {}, t.resharding_to !== null && t.resharding_to !== t.shards ? `${t.shards}→${t.resharding_to}` : t.shards),
    h("td", {}, t.paused ? h("span", { class: "badge warn" }, "paused") : h("span", { class: "badge ok" }, "running")),
    h("td", {}, t.subscriptions),
    h("td", {}, t.consumers, t.zombies ? h("span", { class: "badge bad" }, ` ${t.zombies} zombie`) : null),
    h("td", { class: "num" }, fmtRate(t.inserted_per_s)),
    h("td", { class: "num" }, fmtRate(t.acked_per_s)),
    h("td", { class: "num", dataset: { field: "backlog" } }, fmt(t.backlog)),
    h("td", { class: "num" }, fmt(t.in_flight)),
    h("td", { class: "num" }, fmt(t.dlq)),
    h("td", { class: "num" }, t.lag_ms ? fmtAge(t.lag_ms / 1000) : "–"))));
}

// -- one topic -------------------------------------------------------------------------

function buildTopic(view, route) {
  const topic = route.topic;
  state.charts = {
    rates: new Chart("rates", "Inserted and acked", "messages/s"),
    backlog: new Chart("backlog", "Backlog", "messages"),
    lag: new Chart("lag", "Oldest ready message", "age, s"),
  };
  const shardsInput = h("input", { type: "number", id: "rebalance-shards", min: 1, max: 4096, placeholder: "shards", "aria-label": "shard count" });
  const windowButtons = [60, 300, 600].map((s) => h("button", {
    class: s === state.windowS ? "on" : null, dataset: { window: s },
    onclick: (e) => { state.windowS = s; for (const b of document.querySelectorAll(".window button")) b.classList.toggle("on", b === e.target); drawCharts(); },
  }, s / 60 + "m"));
  view.append(
    h("div", { class: "head" },
      h("h1", {}, topic), h("span", { id: "topic-state" }),
      h("span", { class: "spacer" }),
      h("div", { class: "actions" },
        writeButton("Pause", { id: "pause-topic", dataset: { action: "pause-topic" } },
          () => act("Pause topic", `Pause ${topic}? Pushes are kept in its log; nothing is delivered until you play it.`, "Pause",
            `topics/${enc(topic)}/pause`)),
        writeButton("Play", { id: "play-topic", dataset: { action: "play-topic" } },
          () => act("Play topic", `Resume ${topic}? What was pushed while paused is routed, in order.`, "Play",
            `topics/${enc(topic)}/play`)),
        shardsInput,
        writeButton("Rebalance", { id: "rebalance", dataset: { action: "rebalance" } }, () => {
          const raw = shardsInput.value.trim();
          const shards = raw === "" ? null : Number(raw);
          const text = shards === null ? `Re-divide ${topic}'s shards among its live consumers now?`
            : `Change ${topic} to ${raw} shards? Every backlog is re-routed, each shard key's order kept.`;
          return act("Rebalance", text, "Rebalance", `topics/${enc(topic)}/rebalance`, { shards: Number.isInteger(shards) ? shards : raw });
        }))),
    h("div", { class: "card" }, h("dl", { class: "settings", id: "settings" })),
    h("div", { class: "head" }, h("h2", { class: "inline" }, "Last minutes"), h("span", { class: "window" }, windowButtons)),
    h("div", { class: "charts" }, Object.values(state.charts).map((c) => c.el)),
    h("div", { class: "card" }, h("h2", {}, "Subscriptions"), h("table", { id: "subs-table" },
      h("thead", {}, h("tr", {}, h("th", {}, "subscription"), h("th", {}, "state"),
        ["backlog", "in flight", "delayed", "redeliveries", "dead letters", "consumers", "oldest ready"].map((t) => h("th", { class: "num" }, t)),
        h("th", {}, ""))),
      h("tbody", {}))),
    h("div", { class: "card" }, h("h2", {}, "Consumers and their shards"), h("div", { id: "assignment" }),
      h("table", { id: "consumers-table" },
        h("thead", {}, h("tr", {}, ["subscription", "consumer", "state"].map((t) => h("th", {}, t)),
          h("th", { class: "num" }, "heartbeat age"), ["host", "pid", "mode", "tag", "shards"].map((t) => h("th", {}, t)))),
        h("tbody", {}))),
    h("div", { class: "card" }, h("h2", {}, "What changed"), h("ul", { class: "events", id: "events" })));
}

async function refreshTopic(route, gen) {
  const topic = enc(route.topic);
  const since = state.samples.length ? state.samples[state.samples.length - 1].time_ms : null;
  const [detail, hist] = await Promise.all([
    api(`topics/${topic}`),
    api(`topics/${topic}/history` + (since ? `?since=${since}` : "")),
  ]);
  if (gen !== state.gen) return;
  state.samples.push(...hist.samples);
  const keep = Date.now() - (state.info ? state.info.history_s : 600) * 1000;
  while (state.samples.length && state.samples[0].time_ms < keep) state.samples.shift();
  renderTopic(detail);
  drawCharts();
}

function drawCharts() {
  const ss = state.samples, w = state.windowS;
  const subs = [...new Set(ss.flatMap((s) => Object.keys(s.subscriptions)))];
  const perSub = (key) => subs.map((name, i) => ({
    name, color: PALETTE[i % PALETTE.length], format: key === "lag_s" ? fmtAge : fmt,
    points: ss.map((s) => [s.time_ms, s.subscriptions[name] ? s.subscriptions[name][key] : null]),
  }));
  if (!state.charts.rates) return;
  state.charts.rates.set([
    { name: "inserted/s", color: PALETTE[0], format: fmtRate, points: ss.map((s) => [s.time_ms, s.inserted_per_s]) },
    { name: "acked/s", color: PALETTE[2], format: fmtRate, dash: [6, 4], points: ss.map((s) => [s.time_ms, s.acked_per_s]) },
  ], w);
  state.charts.backlog.set(perSub("backlog"), w);
  state.charts.lag.set(perSub("lag_s"), w);
}

function renderTopic(d) {
  const s = d.summary, st = d.settings;
  $("#topic-state").replaceChildren(h("span", {},
    s.paused ? h("span", { class: "badge warn", id: "topic-paused" }, "paused") : h("span", { class: "badge ok" }, "running"),
    s.resharding_to !== null && s.resharding_to !== st.shards ? h("span", { class: "badge warn" }, ` resharding → ${s.resharding_to}`) : null));
  const opt = (v, f) => (v === null || v === undefined) ? "none" : (f ? f(v) : v);
  const items = [
    ["shards", st.shards], ["hash", st.hash], ["extend (headers)", st.extend ? "yes" : "no"],
    ["max backlog", opt(st.max_backlog, fmt)], ["retention", opt(st.retention_s, fmtAge)],
    ["retention bytes", opt(st.retention_bytes, fmt)], ["dedupe window", fmtAge(st.dedupe_window_s)],
    ["max message", fmt(st.max_message_bytes) + " B"],
    ["inserted", fmt(d.counters.inserted)], ["acked", fmt(d.counters.acked)],
    ["pending (paused)", fmt(d.counters.pending)], ["log size", d.counters.log_bytes === null ? "–" : fmt(d.counters.log_bytes) + " B"],
  ];
  $("#settings").replaceChildren(...items.map(([k, v]) => h("div", { dataset: { setting: k } }, h("dt", {}, k), h("dd", {}, v))));

  const topic = s.name;
  $("#subs-table tbody").replaceChildren(...d.subscriptions.map((sub) => h("tr", { dataset: { sub: sub.name } },
    h("td", {}, sub.name),
    h("td", {}, sub.paused ? h("span", { class: "badge warn" }, "paused") : h("span", { class: "badge ok" }, "delivering"),
      sub.catching_up ? h("span", { class: "badge" }, " catching up") : null),
    h("td", { class: "num", dataset: { field: "backlog" } }, fmt(sub.backlog)),
    h("td", { class: "num" }, fmt(sub.in_flight)),
    h("td", { class: "num" }, fmt(sub.delayed)),
    h("td", { class: "num" }, fmt(sub.redeliveries)),
    h("td", { class: "num", dataset: { field: "dlq" } }, sub.dlq ? h("a", { href: `#/topic/${enc(topic)}/dlq/${enc(sub.name)}` }, fmt(sub.dlq)) : "0"),
    h("td", { class: "num" }, sub.consumers.length),
    h("td", { class: "num" }, sub.lag_ms ? fmtAge(sub.lag_ms / 1000) : "–"),
    h("td", { class: "actions" },
      sub.paused
        ? writeButton("Play", { dataset: { action: "play-sub", sub: sub.name } },
          () => act("Play subscription", `Resume delivering ${topic}/${sub.name}?`, "Play", `topics/${enc(topic)}/subscriptions/${enc(sub.name)}/play`))
        : writeButton("Pause", { dataset: { action: "pause-sub", sub: sub.name } },
          () => act("Pause subscription", `Stop delivering ${topic}/${sub.name}? Its queue keeps filling; the other subscriptions go on.`, "Pause",
            `topics/${enc(topic)}/subscriptions/${enc(sub.name)}/pause`)),
      h("a", { href: `#/topic/${enc(topic)}/dlq/${enc(sub.name)}` }, "dead letters")))));

  renderAssignment(d.subscriptions);
  const consumers = d.subscriptions.flatMap((sub) => sub.consumers);
  $("#consumers-table tbody").replaceChildren(...(consumers.length ? consumers.map((c) => h("tr", {
    class: c.state === "zombie" ? "zombie" : null, dataset: { consumer: c.id, state: c.state, sub: c.subscription },
  },
    h("td", {}, c.subscription),
    h("td", {}, h("span", { class: "sw", style: { background: colorOf(c.id) } }), h("code", {}, c.id)),
    h("td", {}, h("span", { class: "badge " + (c.state === "zombie" ? "bad" : c.state === "live" ? "ok" : "") }, c.state)),
    h("td", { class: "num" }, fmtAge(c.heartbeat_age_s), h("span", { class: "muted" }, c.zombie_after_s ? ` / ${c.zombie_after_s}s` : "")),
    h("td", {}, c.host || "–"), h("td", {}, c.pid || "–"), h("td", {}, c.mode || "–"), h("td", {}, c.tag || "–"),
    h("td", { dataset: { field: "shards" } }, c.shards.map((x) => (x.tag ? x.tag + "/" : "") + x.shard).join(", ") || "none")))
    : [h("tr", {}, h("td", { colspan: 9, class: "empty" }, "No consumer is registered."))]));

  $("#events").replaceChildren(...(d.events.length ? d.events.map((e) => h("li", { class: e.kind, dataset: { kind: e.kind } },
    h("time", {}, fmtTime(e.time_ms)), e.text)) : [h("li", { class: "muted" }, "Nothing changed since the dashboard started.")]));
}

function renderAssignment(subs) {
  for (const sub of subs) assignColors([...new Set([...sub.consumers.map((c) => c.id), ...sub.assignment.map((a) => a.owner).filter(Boolean)])]);
  const box = $("#assignment");
  box.replaceChildren(...subs.map((sub) => {
    const states = Object.fromEntries(sub.consumers.map((c) => [c.id, c.state]));
    const cells = sub.assignment.map((a) => {
      const owner = a.owner;
      const zombie = owner && states[owner] === "zombie";
      return h("div", {
        class: "shard" + (owner ? "" : " unowned") + (zombie ? " zombie" : ""),
        style: owner ? { backgroundColor: colorOf(owner) } : null,
        title: `shard ${a.tag ? a.tag + "/" : ""}${a.shard}: ${owner || "no owner"} · backlog ${a.backlog}, in flight ${a.in_flight}`,
        dataset: { sub: sub.name, shard: a.shard, tag: a.tag || "", owner: owner || "" },
      }, (a.tag ? a.tag + "/" : "") + a.shard, a.backlog ? h("span", { class: "bl" }, shortNum(a.backlog)) : null);
    });
    const owners = sub.consumers.map((c) => h("span", {},
      h("span", { class: "sw", style: { background: colorOf(c.id) } }),
      h("code", {}, c.id), " ", h("span", { class: "badge " + (c.state === "zombie" ? "bad" : "ok") }, c.state),
      ` ${c.shards.length} shard${c.shards.length === 1 ? "" : "s"}`));
    const unowned = sub.assignment.filter((a) => !a.owner).length;
    if (unowned) owners.push(h("span", { class: "muted" }, h("span", { class: "sw", style: { background: "#c8ced8" } }), `${unowned} unowned`));
    return h("div", { class: "assign", dataset: { sub: sub.name } }, h("h3", {}, `${sub.name}`), h("div", { class: "grid" }, cells), h("div", { class: "owners" }, owners));
  }));
}

// -- dead letters ----------------------------------------------------------------------

function buildDlq(view, route) {
  const { topic, sub } = route;
  const base = `topics/${enc(topic)}/subscriptions/${enc(sub)}/dlq`;
  const chosen = () => [...state.selected];
  const count = h("span", { id: "dlq-selected", class: "muted" }, "0 selected");
  view.append(
    h("div", { class: "head" }, h("h1", {}, `Dead letters of ${topic}/${sub}`), h("span", { id: "dlq-total", class: "badge" }),
      h("span", { class: "spacer" }),
      h("div", { class: "actions" }, count,
        writeButton("Redrive selected", { id: "dlq-redrive", dataset: { action: "redrive" } }, async () => {
          const ids = chosen();
          if (!ids.length) return toast("Select dead letters first.", "error");
          const out = await act("Redrive", `Move ${ids.length} dead letter${ids.length === 1 ? "" : "s"} back to their shards' queues (attempts reset)? They are delivered again.`, "Redrive", base + "/redrive", { ids });
          if (out) { state.selected.clear(); }
        }),
        writeButton("Purge selected", { id: "dlq-purge", class: "danger", dataset: { action: "purge" } }, async () => {
          const ids = chosen();
          if (!ids.length) return toast("Select dead letters first.", "error");
          const out = await act("Purge", `Delete ${ids.length} dead letter${ids.length === 1 ? "" : "s"} for good?`, "Purge", base + "/purge", { ids });
          if (out) { state.selected.clear(); }
        }))),
    h("div", { class: "card" }, h("table", { id: "dlq-table" },
      h("thead", {}, h("tr", {}, h("th", {}, h("input", { type: "checkbox", id: "dlq-all", "aria-label": "select all",
        onchange: (e) => { for (const id of state.dlqIds) { if (e.target.checked) state.selected.add(id); else state.selected.delete(id); } syncChecks(); } })),
        ["id", "reason", "attempts", "consumer", "shard key", "inserted", "body"].map((t) => h("th", {}, t)))),
      h("tbody", {}))));
}

function syncChecks() {
  for (const box of document.querySelectorAll("#dlq-table tbody input[type=checkbox]")) box.checked = state.selected.has(box.value);
  const all = $("#dlq-all");
  if (all) all.checked = state.dlqIds.length > 0 && state.dlqIds.every((id) => state.selected.has(id));
  const n = state.selected.size;
  $("#dlq-selected").textContent = `${n} selected`;
}

async function refreshDlq(route, gen) {
  const data = await api(`topics/${enc(route.topic)}/subscriptions/${enc(route.sub)}/dlq?limit=200`);
  if (gen !== state.gen) return;
  state.dlqIds = data.dead_letters.map((d) => d.id);
  for (const id of [...state.selected]) if (!state.dlqIds.includes(id)) state.selected.delete(id);
  $("#dlq-total").textContent = `${fmt(data.total)} in the queue`;
  const tbody = $("#dlq-table tbody");
  tbody.replaceChildren(...(data.dead_letters.length ? data.dead_letters.map((d) => h("tr", { dataset: { id: d.id } },
    h("td", {}, h("input", { type: "checkbox", value: d.id, "aria-label": "select " + d.id,
      onchange: (e) => { if (e.target.checked) state.selected.add(d.id); else state.selected.delete(d.id); syncChecks(); } })),
    h("td", {}, h("code", {}, d.id)),
    h("td", {}, d.reason),
    h("td", { class: "num" }, d.attempts),
    h("td", {}, d.consumer ? h("code", {}, d.consumer) : "–"),
    h("td", {}, d.shard_key === null ? "–" : h("code", {}, d.shard_key)),
    h("td", {}, fmtTime(d.insertion_time_ms)),
    h("td", { class: "body" }, h("code", {}, d.body_encoding === "base64" ? `base64:${d.body}` : d.body),
      d.body_truncated ? h("span", { class: "muted" }, ` … (${fmt(d.body_bytes)} bytes)`) : null)))
    : [h("tr", {}, h("td", { colspan: 8, class: "empty" }, "No dead letters."))]));
  syncChecks();
}

// -- start ----------------------------------------------------------------------------

function showAccess() {
  const a = $("#access"), i = state.info;
  const token = sessionStorage.getItem("fdq-token");
  if (!i.writable) { a.textContent = "read-only"; a.className = "badge"; a.title = "started without --write-token"; }
  else if (token) { a.textContent = "token set"; a.className = "badge ok"; a.title = "actions send the token you entered"; }
  else { a.textContent = "actions need the token"; a.className = "badge"; a.title = ""; }
  $("#token-form").hidden = !i.writable && i.access !== "auth-file";
}

async function start() {
  $("#token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const v = $("#token").value.trim();
    if (v) sessionStorage.setItem("fdq-token", v); else sessionStorage.removeItem("fdq-token");
    $("#token").value = "";
    if (state.info) showAccess();
    toast(v ? "Token set for this tab." : "Token cleared.", "ok");
    refreshSoon();
  });
  window.addEventListener("hashchange", go);
  window.addEventListener("resize", () => { for (const c of Object.values(state.charts)) c.draw(); });
  for (;;) {
    try {
      state.info = await api("info");
      break;
    } catch (e) {
      const b = $("#banner");
      b.textContent = `cannot reach the dashboard's API: ${e.message} (retrying)`;
      b.hidden = false;
      await new Promise((r) => setTimeout(r, 2000));
    }
  }
  showAccess();
  go();
}

document.addEventListener("DOMContentLoaded", start);
