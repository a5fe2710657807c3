// The farm's live view: read-only. Server text goes into the DOM with
// textContent only (never innerHTML); updates arrive by server-sent events.
"use strict";
const $ = (id) => document.getElementById(id);
const MAX_EVENTS = 500, POINTS = 120;
let selected = null;
const series = {};
const CHARTS = [
  ["sessions busy", (f) => count(f.sessions, "busy")],
  ["turns started", (f) => f.counters.turns_started],
  ["tool calls", (f) => f.counters.tool_calls],
  ["model calls", (f) => f.counters.model_calls],
  ["busy slots", (f) => slots(f, "busy")],
  ["queued requests", (f) => sum(Object.values((f.status.broker || {}).queues || {}))],
  ["approvals pending", (f) => f.approvals.length],
  ["failures", (f) => f.counters.failures],
];

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function count(list, state) { return list.filter((s) => s.state === state).length; }
function sum(a) { return a.reduce((x, y) => x + y, 0); }
function slots(f, which) {
  let n = 0;
  for (const svc of Object.values((f.status.broker || {}).workers || {}))
    for (const w of svc.workers || [])
      n += which === "busy" ? w.in_flight : Math.max(0, w.capacity - w.in_flight);
  return n;
}
function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
function time(t) { return new Date(t * 1000).toLocaleTimeString(); }

function renderWorkers(f) {
  const box = $("workers"); clear(box);
  const hosts = {};
  for (const [svc, entry] of Object.entries((f.status.broker || {}).workers || {}))
    for (const w of entry.workers || []) {
      const host = (w.info || {}).host || "?";
      (hosts[host] = hosts[host] || {})[w.identity] = hosts[host][w.identity] || { w, svcs: [] };
      hosts[host][w.identity].svcs.push(svc);
    }
  for (const [host, ws] of Object.entries(hosts)) {
    const div = el("div", null, "host"); div.appendChild(el("b", host));
    for (const { w, svcs } of Object.values(ws)) {
      const tier = ((w.info || {}).tool || {}).tier || "-";
      const label = `${svcs.join("+")} · tier ${tier} · ${w.in_flight}/${w.capacity} · seen ${w.last_seen_s}s ago`;
      div.appendChild(el("span", label, "worker" + (w.in_flight ? " busy" : "")));
    }
    box.appendChild(div);
  }
  if (!Object.keys(hosts).length) box.appendChild(el("p", f.status.broker && f.status.broker.error ? "broker: " + f.status.broker.error : "no workers", "note"));
}

function renderSessions(f) {
  const body = $("sessions").tBodies[0]; clear(body);
  for (const s of f.sessions.slice().reverse()) {
    const tr = el("tr"); tr.dataset.session = s.session_id;
    if (s.session_id === selected) tr.className = "selected";
    for (const v of [s.session_id, s.state, s.turn_id || "", s.phase || "", s.route, s.last_sequence]) tr.appendChild(el("td", v));
    tr.addEventListener("click", () => select(s.session_id));
    body.appendChild(tr);
  }
  if (selected === null && f.sessions.length) select(f.sessions[f.sessions.length - 1].session_id);
}

function renderApprovals(f) {
  const ul = $("approvals"); clear(ul);
  for (const a of f.approvals) ul.appendChild(el("li", `${a.session_id} · ${a.id} · ${a.calls.join(", ")}`));
  if (!f.approvals.length) ul.appendChild(el("li", "none", "note"));
}

function renderFaults(f) {
  const ul = $("faults"); clear(ul);
  const items = f.faults.map((x) => [x.at, `fault ${x.kind}${x.service ? " (" + x.service + ")" : ""}: ${x.message}`])
    .concat(f.restarts.map((r) => [r.at, `restart ${r.child}: ${r.why}`]))
    .sort((a, b) => b[0] - a[0]).slice(0, 30);
  for (const [at, text] of items) ul.appendChild(el("li", `${time(at)} ${text}`));
  if (!items.length) ul.appendChild(el("li", "none", "note"));
}

function renderCharts(f) {
  const box = $("charts");
  for (const [name, fn] of CHARTS) {
    let v = 0; try { v = Number(fn(f)) || 0; } catch (e) { v = 0; }
    const s = (series[name] = series[name] || []); s.push(v); if (s.length > POINTS) s.shift();
    let c = box.querySelector(`[data-chart="${name}"]`);
    if (!c) {
      c = el("div", null, "chart"); c.dataset.chart = name;
      const head = el("div", name); head.appendChild(el("span", "", "v"));
      c.appendChild(head); const cv = el("canvas"); cv.width = 190; cv.height = 48; c.appendChild(cv);
      box.appendChild(c);
    }
    c.querySelector(".v").textContent = String(v);
    const cv = c.querySelector("canvas"), g = cv.getContext("2d");
    g.clearRect(0, 0, cv.width, cv.height);
    const max = Math.max(1, ...s), min = Math.min(0, ...s);
    g.strokeStyle = "#0550ae"; g.lineWidth = 1.5; g.beginPath();
    s.forEach((y, i) => {
      const px = (i / (POINTS - 1)) * cv.width, py = cv.height - 3 - ((y - min) / (max - min || 1)) * (cv.height - 6);
      i ? g.lineTo(px, py) : g.moveTo(px, py);
    });
    g.stroke();
  }
}

function addEvent(e) {
  if (e.session_id !== selected) return;
  const ol = $("events");
  const li = el("li"); li.value = e.sequence;
  li.appendChild(el("span", `${time(e.at)} `));
  li.appendChild(el("span", e.type, "type"));
  li.appendChild(el("span", " " + e.summary));
  li.dataset.type = e.type;
  ol.appendChild(li);
  while (ol.children.length > MAX_EVENTS) ol.removeChild(ol.firstChild);
  ol.scrollTop = ol.scrollHeight;
}

async function select(sid) {
  selected = sid;
  $("selected").textContent = "· " + sid;
  for (const tr of $("sessions").tBodies[0].rows) tr.className = tr.dataset.session === sid ? "selected" : "";
  clear($("events"));
  try {
    const resp = await fetch("/api/history?session=" + encodeURIComponent(sid), { credentials: "same-origin" });
    for (const e of await resp.json()) addEvent(e);
  } catch (err) { /* the live stream still shows what comes next */ }
}

function farm(f) {
  if (f.error) { $("updated").textContent = f.error; return; }
  const total = f.sessions_total || 0;
  $("updated").textContent = "updated " + time(f.at) +
    (total > f.sessions.length ? ` · ${f.sessions.length} of ${total} sessions shown (busy first)` : "");
  renderWorkers(f); renderSessions(f); renderApprovals(f); renderFaults(f); renderCharts(f);
}

function connect() {
  const es = new EventSource("/api/events");
  es.addEventListener("open", () => { $("conn").textContent = "live"; $("conn").className = "ok"; });
  es.addEventListener("error", () => { $("conn").textContent = "reconnecting…"; $("conn").className = "bad"; });
  es.addEventListener("farm", (m) => farm(JSON.parse(m.data)));
  es.addEventListener("event", (m) => addEvent(JSON.parse(m.data)));
}
connect();
