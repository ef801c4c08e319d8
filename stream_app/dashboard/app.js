// trainsentry dashboard: vanilla JS, inline SVG charts, polls the service's JSON API every 2 s.
// Data: /api/runs, /api/runs/{run}/signals, /api/runs/{run}/timeline, /api/stats (stream_app/web.py);
// silences and acks: /api/silences, /api/alerts/{id}/ack (stream_app/alerting_api.py).
"use strict";

const POLL_MS = 2000;
const $ = (sel) => document.querySelector(sel);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

// Run ids contain "/" (grpo-qwen7b/exp3): encode each segment, keep the slashes.
const runPath = (runId) => runId.split("/").map(encodeURIComponent).join("/");

function fmtTime(ts) {
  if (ts === null || ts === undefined) return "—";
  return new Date(ts * 1000).toLocaleString();
}

function fmtNum(x) {
  if (x === null || x === undefined) return "NaN";
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return x.toExponential(2);
  return (Math.round(x * 1000) / 1000).toString();
}

async function getJSON(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

async function send(method, path, body) {
  const r = await fetch(path, {
    method, headers: { "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  let data = null;
  try { data = await r.json(); } catch (e) { data = null; }
  if (!r.ok) throw new Error((data && data.error) || `${method} ${path}: HTTP ${r.status}`);
  return data;
}

function setLive(ok) {
  const live = $("#live");
  live.classList.toggle("stale", !ok);
  live.title = ok ? `updated ${new Date().toLocaleTimeString()}` : "update failed";
  document.body.dataset.updated = ok ? String(Date.now()) : document.body.dataset.updated || "";
}

async function refreshStats() {
  try {
    const s = await getJSON("/api/stats");
    const consumed = Object.values(s.consumed || {}).reduce((a, b) => a + b, 0);
    $("#stats").textContent =
      `${consumed} events · ${s.alerts} alerts · ${s.commands} commands · ${s.deadletters} dead letters`;
  } catch (e) { /* the runs poll reports the outage */ }
}

// ---------------------------------------------------------------------------- runs list
async function renderRuns() {
  const data = await getJSON("/api/runs");
  const tbody = $("#runs tbody");
  tbody.replaceChildren(...data.runs.map((r) => el("tr",
    { class: r.status, "data-run-id": r.run_id, "data-status": r.status,
      "data-diagnosis": r.diagnosis || "" },
    el("td", {}, el("span", { class: `dot ${r.status}`, title: r.status })),
    el("td", {}, el("a", { href: `/runs/${runPath(r.run_id)}`, class: "run-link", text: r.run_id })),
    el("td", { class: `status-${r.status}`, text: r.status }),
    el("td", { class: "diagnosis", text: r.diagnosis || "—" }),
    el("td", { text: r.last_step >= 0 ? r.last_step : "—" }),
    el("td", { text: r.firing.join(", ") || "—" }),
    el("td", { text: r.critical_streak }),
    el("td", { text: r.finished ? "finished" : (r.breaker_fired ? "breaker fired" : "running") }),
  )));
  $("#no-runs").hidden = data.runs.length > 0;
}

// ---------------------------------------------------------------------------- charts
const W = 360, H = 150, PAD_L = 46, PAD_R = 8, PAD_T = 8, PAD_B = 20;

function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function chart(sig, alertSteps) {
  const pts = sig.points;
  const finite = pts.filter((p) => p[1] !== null);
  const steps = pts.map((p) => p[0]);
  const x0 = Math.min(...steps), x1 = Math.max(...steps);
  let ys = finite.map((p) => p[1]);
  if (sig.band) ys = ys.concat([sig.band.lower, sig.band.upper].filter((v) => v !== null));
  let y0 = ys.length ? Math.min(...ys) : 0, y1 = ys.length ? Math.max(...ys) : 1;
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const pad = (y1 - y0) * 0.08; y0 -= pad; y1 += pad;
  const sx = (s) => PAD_L + (x1 === x0 ? 0.5 : (s - x0) / (x1 - x0)) * (W - PAD_L - PAD_R);
  const sy = (v) => PAD_T + (1 - (v - y0) / (y1 - y0)) * (H - PAD_T - PAD_B);
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img",
                            "aria-label": `${sig.key} over steps ${x0}–${x1}` });
  root.append(svg("rect", { class: "frame", x: PAD_L, y: PAD_T, width: W - PAD_L - PAD_R,
                            height: H - PAD_T - PAD_B }));
  if (sig.band && sig.band.lower !== null && sig.band.upper !== null) {
    const top = sy(Math.min(y1, sig.band.upper)), bottom = sy(Math.max(y0, sig.band.lower));
    root.append(svg("rect", { class: "band", x: PAD_L, y: top, width: W - PAD_L - PAD_R,
                              height: Math.max(0, bottom - top) }));
    if (sig.band.mean !== null) {
      root.append(svg("line", { class: "mean", x1: PAD_L, x2: W - PAD_R,
                                y1: sy(sig.band.mean), y2: sy(sig.band.mean) }));
    }
  }
  for (const a of alertSteps) {
    if (a.status !== "firing" || a.step < x0 || a.step > x1) continue;
    if (a.evidence.length && !a.evidence.includes(sig.key)) continue;
    root.append(svg("line", { class: `alert-line ${a.severity}`, x1: sx(a.step), x2: sx(a.step),
                              y1: PAD_T, y2: H - PAD_B }));
  }
  // One polyline per finite run of points; NaN/inf breaks the line and gets a red cross.
  let seg = [];
  const flush = () => {
    if (seg.length > 1) root.append(svg("polyline", { class: "series", points: seg.join(" ") }));
    else if (seg.length === 1) {
      const [x, y] = seg[0].split(",");
      root.append(svg("circle", { class: "series", cx: x, cy: y, r: 1.5 }));
    }
    seg = [];
  };
  for (const [s, v] of pts) {
    if (v === null) {
      flush();
      const x = sx(s), y = PAD_T + 6;
      root.append(svg("path", { class: "nan", d: `M${x - 4},${y - 4}L${x + 4},${y + 4}M${x - 4},${y + 4}L${x + 4},${y - 4}` }));
    } else seg.push(`${sx(s).toFixed(1)},${sy(v).toFixed(1)}`);
  }
  flush();
  const anomalous = new Set(sig.anomalies);
  for (const [s, v] of pts) {
    if (v !== null && anomalous.has(s)) {
      root.append(svg("circle", { class: "anomaly", cx: sx(s), cy: sy(v), r: 3,
                                  "data-step": s }));
    }
  }
  const label = (x, y, text, anchor) => {
    const t = svg("text", { class: "axis", x, y, "text-anchor": anchor || "start" });
    t.textContent = text; root.append(t);
  };
  label(PAD_L - 4, PAD_T + 8, fmtNum(y1), "end");
  label(PAD_L - 4, H - PAD_B, fmtNum(y0), "end");
  label(PAD_L, H - 6, `step ${x0}`);
  label(W - PAD_R, H - 6, `${x1}`, "end");
  const last = pts.length ? pts[pts.length - 1][1] : null;
  const fig = el("figure", { class: `chart${sig.anomalies.length ? " anomalous" : ""}`,
                             "data-key": sig.key, "data-anomalies": sig.anomalies.length },
    el("figcaption", {}, el("span", { class: "key", text: sig.key }),
       el("span", { class: "muted", text: sig.band
         ? `now ${fmtNum(last)} · band ${fmtNum(sig.band.lower)}…${fmtNum(sig.band.upper)}`
         : `now ${fmtNum(last)} · warming up` })));
  fig.append(root);
  return fig;
}

// ---------------------------------------------------------------------------- run page
let alertsKey = null;  // re-render alert cards only when they change (keeps buttons stable)

function message(text, ok) {
  const m = $("#action-msg");
  m.textContent = text;
  m.className = `msg ${ok ? "ok" : "error"}`;
}

async function silence(runId, alert, button) {
  button.disabled = true;
  try {
    const s = await send("POST", "/api/silences", {
      run_id: runId, diagnosis: alert.diagnosis, duration: "2h", created_by: "dashboard",
      comment: `silenced from the dashboard (alert ${alert.alert_id || alert.fingerprint})`,
    });
    message(`Silenced ${alert.diagnosis} on ${runId} until ${fmtTime(s.ends_at)} (silence ${s.id})`, true);
    document.body.dataset.lastSilence = s.id;
    await renderSilences(runId);
  } catch (e) {
    message(`Silence failed: ${e.message}`, false);
  } finally { button.disabled = false; }
}

async function acknowledge(runId, alert, button) {
  button.disabled = true;
  try {
    // By fingerprint: the engine's latest alert id of a problem may be one the notifier
    // merged into an earlier episode, but the problem's fingerprint is always in history.
    await send("POST", "/api/ack", { fingerprint: alert.fingerprint, by: "dashboard",
                                      comment: `acknowledged from the dashboard (alert ${alert.alert_id})` });
    message(`Acknowledged ${alert.diagnosis} on ${runId}`, true);
  } catch (e) {
    message(`Acknowledge failed: ${e.message}`, false);
  } finally { button.disabled = false; }
}

function renderAlerts(run) {
  const key = JSON.stringify(run.alerts.map((a) => [a.fingerprint, a.severity, a.alert_id]));
  if (key === alertsKey) return;
  alertsKey = key;
  const box = $("#alerts");
  if (!run.alerts.length) {
    box.replaceChildren(el("p", { class: "muted", text: "None." }));
    return;
  }
  box.replaceChildren(...run.alerts.map((a) => {
    const card = el("div", { class: `alert ${a.severity}`, "data-diagnosis": a.diagnosis,
                             "data-fingerprint": a.fingerprint },
      el("div", { class: "label", text: a.diagnosis }),
      el("div", { class: "meta", text: `${a.severity} · since step ${a.since_step}` }));
    const sil = el("button", { class: "silence-btn", type: "button", text: "Silence 2h",
                               title: `silence ${a.diagnosis} on this run for 2 hours` });
    const ack = el("button", { class: "ack-btn", type: "button", text: "Acknowledge" });
    sil.addEventListener("click", () => silence(run.run_id, a, sil));
    ack.addEventListener("click", () => acknowledge(run.run_id, a, ack));
    card.append(sil, " ", ack);
    return card;
  }));
}

async function renderSilences(runId) {
  const list = $("#silences");
  let data;
  try { data = await getJSON("/api/silences"); } catch (e) {
    list.replaceChildren(el("li", { class: "muted", text: `silences unavailable (${e.message})` }));
    return;
  }
  const mine = data.silences.filter((s) => s.matchers.some(
    (m) => m.name === "run_id" && (m.op === "=" ? m.value === runId
                                                : m.op === "=~" && new RegExp(`^(?:${m.value})$`).test(runId))));
  if (!mine.length) {
    list.replaceChildren(el("li", { class: "muted", text: "None." }));
    return;
  }
  list.replaceChildren(...mine.map((s) => el("li", { "data-silence-id": s.id, "data-state": s.state },
    `${s.matchers.map((m) => `${m.name}${m.op}${m.value}`).join(", ")} — ${s.state} until ${fmtTime(s.ends_at)}`,
    s.created_by ? ` by ${s.created_by}` : "", " ",
    s.state !== "expired" ? el("button", { type: "button", class: "expire-btn", text: "Expire",
      onclick: async () => {
        try { await send("DELETE", `/api/silences/${encodeURIComponent(s.id)}`); }
        catch (e) { message(`Expire failed: ${e.message}`, false); }
        await renderSilences(runId);
      } }) : null)));
}

function renderTimeline(tl) {
  const rows = tl.events.filter((e) => e.kind === "alert").slice().reverse();
  $("#timeline tbody").replaceChildren(...rows.map((e) => el("tr",
    { class: e.status === "firing" ? (e.severity === "critical" ? "red" : "amber") : "",
      "data-diagnosis": e.diagnosis, "data-status": e.status },
    el("td", { text: fmtTime(e.ts) }), el("td", { text: e.step }),
    el("td", { text: e.status }), el("td", { text: e.severity }),
    el("td", { text: e.diagnosis }), el("td", { text: e.summary }))));
  const cmds = tl.events.filter((e) => e.kind !== "alert").slice().reverse();
  $("#commands tbody").replaceChildren(...(cmds.length ? cmds.map((e) => el("tr",
    { "data-kind": e.kind },
    el("td", { text: fmtTime(e.ts) }), el("td", { text: e.step === null ? "—" : e.step }),
    el("td", { text: e.kind === "command" ? (e.published ? "issued" : "not sent (no secret)")
                                          : (e.kind === "command_applied" ? "applied" : "rejected") }),
    el("td", { text: e.action + (e.to_step !== undefined && e.to_step !== null ? ` → step ${e.to_step}` : "") }),
    el("td", { text: e.kind === "command" ? e.reason : `${e.result || ""} ${e.reason || ""}`.trim() })))
    : [el("tr", {}, el("td", { colspan: 5, class: "muted", text: "None." }))]));
}

async function renderRun(runId) {
  const base = `/api/runs/${runPath(runId)}`;
  const [sig, tl] = await Promise.all([getJSON(`${base}/signals`), getJSON(`${base}/timeline`)]);
  const run = sig.run;
  document.title = `${run.status.toUpperCase()} · ${runId} · trainsentry`;
  $("#run-title").textContent = runId;
  $("#run-dot").className = `dot ${run.status}`;
  const st = $("#run-status");
  st.textContent = run.status;
  st.dataset.status = run.status;
  st.className = `status-${run.status}`;
  $("#run-diagnosis").textContent = run.diagnosis || "—";
  $("#run-step").textContent = run.last_step >= 0 ? run.last_step : "—";
  $("#run-streak").textContent = run.critical_streak;
  $("#run-finished").textContent = run.finished ? " · finished" : (run.breaker_fired ? " · breaker fired" : "");
  renderAlerts(run);
  $("#charts").replaceChildren(...sig.signals.filter((s) => s.points.length)
    .map((s) => chart(s, sig.alert_steps)));
  renderTimeline(tl);
}

// ---------------------------------------------------------------------------- main loop
function route() {
  const m = location.pathname.match(/^\/runs\/(.+)$/);
  return m ? { view: "run", runId: m[1].split("/").map(decodeURIComponent).join("/") } : { view: "runs" };
}

async function tick() {
  const r = route();
  $("#runs-view").hidden = r.view !== "runs";
  $("#run-view").hidden = r.view !== "run";
  try {
    if (r.view === "runs") await renderRuns();
    else {
      await renderRun(r.runId);
      await renderSilences(r.runId);
    }
    $("#error-view").hidden = true;
    setLive(true);
  } catch (e) {
    $("#error").textContent = `Could not load: ${e.message}`;
    $("#error-view").hidden = false;
    setLive(false);
  }
  refreshStats();
  setTimeout(tick, POLL_MS);
}

tick();
