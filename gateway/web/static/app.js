// edgeflow's dashboard: read-only for everyone; an operator who logs in (HTTPS only) can deploy, roll back and send
// commands. Every string shown may come from a device: it is set with textContent / createTextNode only (no HTML
// parsing of data), links are built with encodeURIComponent. Every POST carries the session's CSRF token.
"use strict";

const POLL_MS = 2000;
const MAX_ROWS = 500;
const SVG = "http://www.w3.org/2000/svg";
let state = null;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k === "href") e.setAttribute("href", v);
    else e.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.appendChild(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}

function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }

function ago(ts) {
  if (ts === null || ts === undefined) return "-";
  const s = Math.max(0, Date.now() / 1000 - ts);
  if (s < 60) return `${s.toFixed(0)} s ago`;
  if (s < 3600) return `${(s / 60).toFixed(0)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}

function fmt(v, digits) {
  if (v === null || v === undefined) return "-";
  return typeof v === "number" ? v.toFixed(digits) : String(v);
}

// A line chart of (x, y) points as inline SVG; null values leave gaps.
function lineChart(container, points, opts) {
  clear(container);
  const W = opts.width || 420, H = opts.height || 160, P = 32;
  const s = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img" });
  s.appendChild(svg("rect", { x: 0, y: 0, width: W, height: H, fill: "#fff" }));
  const pts = points.filter(p => p[1] !== null && p[1] !== undefined && isFinite(p[1]));
  if (!pts.length) {
    const t = svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", fill: "#9ca3af" });
    t.textContent = "no data yet";
    s.appendChild(t);
    container.appendChild(s);
    return;
  }
  const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs);
  let y0 = opts.ymin !== undefined ? opts.ymin : Math.min(...ys), y1 = opts.ymax !== undefined ? opts.ymax : Math.max(...ys);
  if (y1 === y0) { y1 = y0 + 1; }
  const X = x => P + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - P - 8);
  const Y = y => H - P + 8 - ((y - y0) / (y1 - y0)) * (H - P);
  s.appendChild(svg("line", { x1: P, y1: H - P + 8, x2: W - 8, y2: H - P + 8, stroke: "#d1d5db" }));
  for (const [v, y] of [[y0, Y(y0)], [y1, Y(y1)]]) {
    const t = svg("text", { x: 2, y: y + 4, "font-size": 10, fill: "#6b7280" });
    t.textContent = fmt(v, opts.digits === undefined ? 2 : opts.digits);
    s.appendChild(t);
  }
  const tx = svg("text", { x: W - 8, y: H - 4, "font-size": 10, fill: "#6b7280", "text-anchor": "end" });
  tx.textContent = `${opts.xlabel || "round"} ${x0}–${x1}`;
  s.appendChild(tx);
  const d = pts.map((p, i) => `${i ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ");
  s.appendChild(svg("path", { d, fill: "none", stroke: opts.color || "#2563eb", "stroke-width": 2 }));
  for (const p of pts.slice(-60)) {
    const c = svg("circle", { cx: X(p[0]), cy: Y(p[1]), r: 2.5, fill: opts.color || "#2563eb" });
    const title = svg("title", {});
    title.textContent = `${opts.xlabel || "round"} ${p[0]}: ${fmt(p[1], opts.digits === undefined ? 3 : opts.digits)}`;
    c.appendChild(title);
    s.appendChild(c);
  }
  container.appendChild(s);
}

function renderSummary(st) {
  const box = document.getElementById("summary");
  clear(box);
  const last = st.rounds.length ? st.rounds[st.rounds.length - 1] : null;
  const cards = [
    ["devices", st.summary.devices], ["online", st.summary.online], ["training", st.summary.training],
    ["global model", st.model_version === null ? "-" : `v${st.model_version}`],
    ["rounds closed", (st.round_states.closed || 0)], ["rounds failed", (st.round_states.failed || 0)],
    ["last accuracy", last ? fmt(last.accuracy, 3) : "-"],
  ];
  for (const [k, v] of cards) box.appendChild(el("div", { class: "card", "data-key": k }, el("b", {}, v), k));
}

function deviceLink(id) {
  return el("a", { href: "#/device/" + encodeURIComponent(id), class: "device-link" }, id);
}

function renderDevices(st) {
  const body = document.querySelector("#devices tbody");
  const q = document.getElementById("filter").value.trim().toLowerCase();
  const rows = st.devices.filter(d => !q || d.device_id.toLowerCase().includes(q) || String(d.profile).toLowerCase().includes(q));
  clear(body);
  for (const d of rows.slice(0, MAX_ROWS)) {
    const health = String(d.health);
    body.appendChild(el("tr", { "data-device": d.device_id },
      el("td", {}, deviceLink(d.device_id)),
      el("td", { class: "h-" + health.split(" ")[0].replace(/[^a-z]/g, "") }, health),
      el("td", {}, d.profile), el("td", {}, d.backend || "-"),
      el("td", {}, d.model_version === null ? "none" : `v${d.model_version}`),
      el("td", {}, ago(d.last_seen)),
      el("td", { title: d.why || "" }, d.trains ? "yes" : "no")));
  }
  document.getElementById("devices-more").textContent =
    rows.length > MAX_ROWS ? `${rows.length - MAX_ROWS} more not shown: filter to narrow` : `${rows.length} device(s)`;
}

function renderRounds(st) {
  lineChart(document.getElementById("chart-accuracy"), st.rounds.map(r => [r.round_id, r.accuracy]), { ymin: 0, ymax: 1, digits: 2 });
  lineChart(document.getElementById("chart-bytes"), st.rounds.map(r => [r.round_id, r.bytes_in / 1024]), { ymin: 0, digits: 0, color: "#059669" });
  const body = document.querySelector("#rounds tbody");
  clear(body);
  for (const r of st.rounds.slice().reverse()) {
    body.appendChild(el("tr", { "data-round": r.round_id },
      el("td", { class: "num" }, r.round_id), el("td", {}, `v${r.model_version}`),
      el("td", { class: "num" }, `${r.participants}/${r.selected}`), el("td", { class: "num" }, r.dropped),
      el("td", { class: "num" }, r.late), el("td", { class: "num", title: JSON.stringify(r.rejected_by_reason || {}) }, r.rejected),
      el("td", { class: "num" }, fmt(r.bytes_in / 1024, 1)), el("td", {}, r.codec),
      el("td", { class: "num" }, fmt(r.accuracy, 3)), el("td", { class: "num" }, fmt(r.round_s, 2))));
  }
}

function renderRollouts(st) {
  const box = document.getElementById("rollouts");
  clear(box);
  if (!st.rollouts.length) { box.appendChild(el("p", { class: "muted" }, "no rollout since the gateway started")); return; }
  for (const r of st.rollouts.slice().reverse()) {
    const pct = r.targets ? Math.round(100 * r.done / r.targets) : 0;
    const fill = el("span", {});
    fill.style.width = `${pct}%`;  // CSSOM, allowed by the CSP (an inline style attribute is not)
    const bar = el("span", { class: "bar" }, fill);
    const counts = Object.entries(r.counts).map(([k, v]) => `${k} ${v}`).join(", ");
    const div = el("div", { class: "rollout card" },
      el("h3", {}, `artifact v${r.version} — `, el("span", { class: "st-" + String(r.state) }, r.state)),
      el("p", {}, bar, ` ${r.done}/${r.targets} devices (${pct}%)`),
      el("p", {}, `canary: ${r.canary.length ? r.canary.join(", ") : "-"}; waves ${r.waves}; failure rate ${fmt(r.failure_rate, 3)}; rolled back ${r.rolled_back}`),
      el("p", { class: "muted" }, counts),
      r.halted_reason ? el("p", { class: "st-halted" }, `halted: ${r.halted_reason}`) : null);
    if (r.failures.length) {
      const ul = el("ul", {});
      for (const f of r.failures) ul.appendChild(el("li", {}, deviceLink(f.device_id), ` ${f.state} ${f.code} ${f.error}`));
      div.appendChild(ul);
    }
    box.appendChild(div);
  }
}

async function renderDevice(id) {
  document.getElementById("device-id").textContent = id;
  const facts = document.getElementById("device-facts");
  const body = document.querySelector("#telemetry tbody");
  let d;
  try {
    const resp = await fetch("/api/device?id=" + encodeURIComponent(id), { cache: "no-store" });
    d = await resp.json();
    if (!resp.ok) throw new Error(d.error || resp.statusText);
  } catch (e) {
    clear(facts);
    facts.appendChild(el("dt", {}, "error")); facts.appendChild(el("dd", {}, String(e.message || e)));
    return;
  }
  clear(facts);
  const b = d.birth || {};
  const items = [["health", d.health], ["profile", d.profile], ["backend", d.backend || "-"],
    ["running model", d.model_version === null ? "none" : `v${d.model_version}`], ["last seen", ago(d.last_seen)],
    ["first seen", d.first_seen ? new Date(d.first_seen * 1000).toISOString() : "-"],
    ["trains", d.trains ? "yes" : `no (${d.why})`], ["battery", fmt(d.battery, 2)],
    ["versions", JSON.stringify(b.versions || {})]];
  for (const [k, v] of items) { facts.appendChild(el("dt", {}, k)); facts.appendChild(el("dd", {}, v)); }
  // the first numeric field of the telemetry that changes over time is charted (latency, battery, memory)
  const keys = ["cpu_percent", "battery", "latency_p50_ms", "rss_bytes", "temperature_c", "latency_ms", "memory_mb"];
  const skip = new Set(["ts", "seq", "bdseq", "model_version"]);
  const key = keys.find(k => d.telemetry.some(t => typeof t.data[k] === "number")) ||
    Object.keys((d.telemetry[0] || { data: {} }).data).find(k => !skip.has(k) && typeof d.telemetry[0].data[k] === "number");
  document.getElementById("device-chart-caption").textContent = key ? `telemetry: ${key}` : "telemetry";
  const t0 = d.telemetry.length ? d.telemetry[0].ts : 0;
  lineChart(document.getElementById("chart-device"),
    key ? d.telemetry.map(t => [Math.round(t.ts - t0), typeof t.data[key] === "number" ? t.data[key] : null]) : [],
    { xlabel: "seconds", digits: 2, color: "#7c3aed" });
  clear(body);
  for (const t of d.telemetry.slice(-50)) {
    body.appendChild(el("tr", {}, el("td", {}, new Date(t.ts * 1000).toISOString().slice(11, 19)),
      el("td", { class: "data" }, JSON.stringify(t.data))));
  }
}

function route() {
  const h = location.hash || "#/";
  const pages = { fleet: h === "#/" || h === "#", rounds: h === "#/rounds", rollouts: h === "#/rollouts", device: h.startsWith("#/device/") };
  for (const [name, shown] of Object.entries(pages)) document.getElementById("page-" + name).hidden = !shown;
  return pages.device ? decodeURIComponent(h.slice("#/device/".length)) : null;
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const resp = await fetch("/api/state", { cache: "no-store" });
    if (!resp.ok) throw new Error(resp.statusText);
    state = await resp.json();
    document.getElementById("fleet-name").textContent = state.fleet ? `fleet ${state.fleet}` : "";
    status.textContent = state.attached ? `updated ${new Date().toLocaleTimeString()}` : "waiting for the gateway to start…";
    renderSummary(state);
    renderDevices(state);
    renderRounds(state);
    renderRollouts(state);
    const dev = route();
    if (dev !== null) await renderDevice(dev);
    document.getElementById("command-form").hidden = !(session && session.operator && dev !== null);
    document.body.setAttribute("data-loaded", "1");
  } catch (e) {
    status.textContent = `cannot reach the gateway (${e.message || e}); retrying`;
  }
}

// ---- actions: the operator's session, log-in, deploy, rollback, commands ----
let session = null;

function say(text, isError) {
  const p = document.getElementById("action-result");
  p.textContent = text;
  p.className = isError ? "error" : "muted";
}

async function loadSession() {
  const box = document.getElementById("operator");
  let info;
  try {
    const resp = await fetch("/api/session", { cache: "no-store" });
    info = await resp.json();
  } catch (e) { return; }
  session = info.operator ? info : null;
  box.hidden = !info.actions && !info.why;
  const why = document.getElementById("operator-why");
  why.hidden = !!info.actions || !info.why;
  why.textContent = info.why || "";
  document.getElementById("login-form").hidden = !info.actions || !!session;
  document.getElementById("actions").hidden = !session;
  if (!session) return;
  document.getElementById("operator-name").textContent = session.operator;
  const sel = document.getElementById("deploy-version");
  clear(sel);
  for (const m of session.models.slice().reverse()) sel.appendChild(el("option", { value: m.version }, `v${m.version}`));
  const names = document.getElementById("command-name");
  clear(names);
  for (const c of session.commands) names.appendChild(el("option", { value: c }, c));
}

async function post(path, body) {
  const headers = { "Content-Type": "application/json" };
  if (session) headers["X-CSRF-Token"] = session.csrf;
  const resp = await fetch(path, { method: "POST", headers, body: JSON.stringify(body), cache: "no-store",
                                   credentials: "same-origin" });
  let out = {};
  try { out = await resp.json(); } catch (e) { out = { error: resp.statusText }; }
  if (resp.status === 401 && path !== "/api/login") { session = null; loadSession(); }
  if (!resp.ok) throw new Error(out.error || resp.statusText);
  return out;
}

function onSubmit(id, fn) {
  document.getElementById(id).addEventListener("submit", async ev => {
    ev.preventDefault();
    try { await fn(); } catch (e) { say(String(e.message || e), true); }
  });
}

function setupActions() {
  onSubmit("login-form", async () => {
    const user = document.getElementById("login-user").value;
    const password = document.getElementById("login-password").value;
    await post("/api/login", { user, password });
    document.getElementById("login-password").value = "";
    say(`logged in as ${user}`);
    await loadSession();
    refresh();
  });
  document.getElementById("logout-button").addEventListener("click", async () => {
    try { await post("/api/logout", {}); say("logged out"); } catch (e) { say(String(e.message || e), true); }
    await loadSession();
    refresh();
  });
  onSubmit("deploy-form", async () => {
    const v = Number(document.getElementById("deploy-version").value);
    const to = document.getElementById("deploy-to").value;
    const out = await post("/api/deploy", { model_version: v, to });
    say(`deploying global model v${out.model_version} as artifact v${out.artifact_version} to ${out.targets} device(s): progress under rollouts`);
  });
  onSubmit("rollback-form", async () => {
    const out = await post("/api/rollback", { to: document.getElementById("rollback-to").value });
    say(Object.entries(out.results).map(([d, a]) => `${d}: ${a.ok ? "ok" : a.code} ${a.error || ""}`).join("\n"));
  });
  onSubmit("command-form", async () => {
    let args;
    try { args = JSON.parse(document.getElementById("command-args").value || "{}"); }
    catch (e) { throw new Error("args must be a JSON object, e.g. {}"); }
    const out = await post("/api/command", { device: route(), name: document.getElementById("command-name").value, args });
    say(`${out.device}: ${out.name} ${out.ack.ok ? "ok" : out.ack.code + " " + out.ack.error}\n${JSON.stringify(out.ack.result)}`, !out.ack.ok);
  });
}

window.addEventListener("hashchange", () => { route(); refresh(); });
document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("filter").addEventListener("input", () => { if (state) renderDevices(state); });
  setupActions();
  route();
  loadSession().then(refresh);
  setInterval(refresh, POLL_MS);
});
