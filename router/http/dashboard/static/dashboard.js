// The dashboard: polls the gateway's /dashboard/data and draws it. No build step, no
// framework: one file, uPlot (vendored) for the charts.
"use strict";

const REFRESH_MS = 2000;
const HISTORY_S = 600; // the gateway keeps ten minutes of samples; so do the charts
const COLORS = ["#3b7dd8", "#d8603b", "#2e9d5b", "#9b6bd8", "#c9a227", "#d83b8c", "#3bb5d8", "#777"];

const state = {
  key: sessionStorage.getItem("prefix-router-key") || "",
  showText: false,
  since: 0, // the gateway sends chart points after this time stamp only
  points: {}, // policy -> [{ts, token_hit_rate, ttft_p50_s, ttft_p90_s, prediction_accuracy}]
  colors: {},
  charts: {},
};

const $ = (selector) => document.querySelector(selector);
const dash = "–";
const pct = (x) => (x == null ? dash : (100 * x).toFixed(1) + "%");
const ms = (s) => (s == null ? dash : (1000 * s).toFixed(1) + " ms");
const int = (n) => (n == null ? dash : Number(n).toLocaleString("en-US"));
const rate = (x) => (x == null ? dash : x.toFixed(1));

function colorOf(policy) {
  if (!(policy in state.colors)) {
    state.colors[policy] = COLORS[Object.keys(state.colors).length % COLORS.length];
  }
  return state.colors[policy];
}

// A table cell that carries its raw value too, so a test (or a curious operator)
// can compare it with /stats without parsing the formatting.
function cell(field, value, text, extra = "") {
  const td = document.createElement("td");
  td.dataset.field = field;
  td.dataset.value = value == null ? "" : String(value);
  td.textContent = text;
  if (extra) td.className = extra;
  return td;
}

function bar(used, total, kind) {
  const td = document.createElement("td");
  td.dataset.field = kind + "_cached_blocks";
  td.dataset.value = used == null ? "" : String(used);
  if (used == null || !total) {
    td.textContent = total === 0 ? "no tier" : dash;
    return td;
  }
  const outer = document.createElement("span");
  outer.className = "bar " + kind;
  const inner = document.createElement("span");
  inner.style.width = Math.min(100, (100 * used) / total).toFixed(1) + "%";
  outer.appendChild(inner);
  td.appendChild(outer);
  td.appendChild(document.createTextNode(`${int(used)} / ${int(total)}`));
  return td;
}

function renderFleet(view) {
  const fields = {
    policy: view.policy, backends: int(view.backends), requests: int(view.requests),
    token_hit_rate: pct(view.token_hit_rate), queued: int(view.queued),
    refused: int(view.refused), retries: int(view.retries),
  };
  for (const [field, text] of Object.entries(fields)) {
    const dd = $(`#fleet [data-field="${field}"]`);
    dd.textContent = text;
    dd.dataset.value = view[field] == null ? "" : String(view[field]);
  }
  $("#no-backends").hidden = view.backends > 0;
}

// One row per item, keyed (data-KEY) so the browser test can find it.
function fillTable(selector, key, items, cellsOf) {
  $(selector + " tbody").replaceChildren(...items.map(([id, item]) => {
    const row = document.createElement("tr");
    row.dataset[key] = id;
    row.append(...cellsOf(item, id));
    return row;
  }));
}

function renderReplicas(view) {
  fillTable("#replicas", "replica", view.replicas.map((r) => [r.replica_id, r]), (r) => [
    replicaCell(r),
    modelCell(r),
    bar(r.gpu_cached_blocks, r.gpu_blocks, "gpu"),
    bar(r.host_cached_blocks, r.host_blocks, "host"),
    cell("window_hit_rate", r.rates.token_hit_rate, pct(r.rates.token_hit_rate)),
    cell("decisions_per_s", r.rates.decisions_per_s, rate(r.rates.decisions_per_s)),
    cell("outstanding_requests", r.outstanding_requests, int(r.outstanding_requests)),
    cell("outstanding_prefill_tokens", r.outstanding_prefill_tokens, int(r.outstanding_prefill_tokens)),
    cell("dispatched", r.dispatched, int(r.dispatched)),
    cell("index_keys", r.index_keys, int(r.index_keys)),
    routing(r),
  ]);
}

// Its name, its role in a disaggregated fleet, and the KV it moved (on hover).
function replicaCell(r) {
  const role = r.role && r.role !== "both" ? ` (${r.role})` : "";
  const text = r.replica_id + role + (r.healthy ? "" : " (down)");
  const td = cell("replica_id", r.replica_id, text, r.healthy ? "" : "down");
  const t = r.transfers;
  if (t && (t.pulls || t.lent_blocks)) {
    td.title = `pulled ${t.pulls} times (${t.pulled_tokens} tokens), lent ${t.lent_blocks} blocks, ` +
      `${t.pull_fallbacks} fallbacks, ${t.hold_timeouts} holds timed out`;
  }
  return td;
}

// The replicas by role, and the requests by how their KV got where they ran: shown
// once the fleet has roles or any KV moved.
function renderPools(view) {
  const paths = Object.entries(view.paths);
  const moved = view.pools.some((p) => p.role !== "both" || p.transfers.pulls || p.transfers.lent_blocks) ||
    paths.some(([path, count]) => path !== "local" && count);
  $("#pools-section").hidden = !moved;
  $("#paths").replaceChildren(...paths.flatMap(([path, count], i) => {
    const span = document.createElement("span");
    span.dataset.field = path;
    span.dataset.value = String(count);
    span.textContent = `${path} ${int(count)}`;
    return i ? [document.createTextNode(" · "), span] : [span];
  }));
  fillTable("#pools", "pool", view.pools.map((p) => [p.role, p]), (p) => {
    const t = p.transfers;
    const down = p.replicas.length - p.healthy;
    return [
      cell("role", p.role, p.role),
      cell("replicas", p.replicas.join(","), p.replicas.length + (down ? ` (${down} down)` : "")),
      cell("outstanding_requests", p.outstanding_requests, int(p.outstanding_requests)),
      cell("outstanding_prefill_tokens", p.outstanding_prefill_tokens, int(p.outstanding_prefill_tokens)),
      bar(p.gpu_cached_blocks, p.gpu_blocks, "gpu"),
      cell("pulls", t.pulls, int(t.pulls)),
      cell("pulled_tokens", t.pulled_tokens, int(t.pulled_tokens)),
      cell("pull_s", t.pull_s, ms(t.pull_s)),
      cell("lent_blocks", t.lent_blocks, int(t.lent_blocks)),
      cell("pull_fallbacks", t.pull_fallbacks, int(t.pull_fallbacks)),
      cell("hold_timeouts", t.hold_timeouts, int(t.hold_timeouts)),
    ];
  });
}

// Its base model, and the adapters in its GPU slots after a "+".
function modelCell(r) {
  const loaded = r.loaded_adapters || [];
  const text = (r.model || dash) + (loaded.length ? " + " + loaded.join(", ") : "");
  return cell("model", r.model, text);
}

function renderModels(view) {
  const names = (ids) => (ids.length ? ids.join(", ") : dash);
  fillTable("#models", "model", view.models.map((m) => [m.name, m]), (m) => [
    cell("name", m.name, m.name),
    cell("base", m.base, m.base || dash),
    cell("requests", m.requests, int(m.requests)),
    cell("errors", m.errors, int(m.errors)),
    cell("token_hit_rate", m.token_hit_rate, pct(m.token_hit_rate)),
    cell("replicas", m.replicas.join(","), m.replicas.length ? names(m.replicas) : "none: 404"),
    cell("loaded_on", m.loaded_on.join(","), m.base ? names(m.loaded_on) : ""),
  ]);
}

// Each tenant's requests, charge and blocks on the GPUs (most on one replica, on hover).
function renderTenants(view) {
  $("#tenants-section").hidden = !view.tenants.length;
  fillTable("#tenants", "tenant", view.tenants.map((t) => [t.name, t]), (t) => {
    const held = Object.entries(t.gpu_blocks_by_replica).sort((a, b) => b[1] - a[1]);
    const td = cell("gpu_blocks", t.gpu_blocks, int(t.gpu_blocks));
    td.title = held.map(([replica, blocks]) => `${replica}: ${blocks}`).join("\n");
    return [
      cell("name", t.name, t.name),
      cell("requests", t.requests, int(t.requests)),
      cell("errors", t.errors, int(t.errors)),
      cell("token_hit_rate", t.token_hit_rate, pct(t.token_hit_rate)),
      cell("charged_tokens", t.charged_tokens, int(t.charged_tokens)),
      td,
      cell("replicas_held", held.length, held.length ? `${held.length}` : dash),
    ];
  });
}

// How the router knows the replica's cache; why approximately, on hover.
function routing(r) {
  const approximate = r.routing_mode === "approximate";
  const td = cell("routing_mode", r.routing_mode, r.routing_mode, approximate ? "down" : "");
  if (approximate) td.title = r.approximate_reason;
  return td;
}

function renderPolicies(view) {
  fillTable("#policies", "policy", Object.entries(view.policies), (p, name) => {
    const label = cell("policy", name, name);
    label.style.borderLeft = `4px solid ${colorOf(name)}`;
    return [
      label,
      cell("requests", p.requests, int(p.requests)),
      cell("errors", p.errors, int(p.errors)),
      cell("token_hit_rate", p.token_hit_rate, pct(p.token_hit_rate)),
      cell("ttft_p50_s", p.ttft_p50_s, ms(p.ttft_p50_s)),
      cell("ttft_p90_s", p.ttft_p90_s, ms(p.ttft_p90_s)),
      cell("prediction_accuracy", p.prediction_accuracy,
        p.predictions ? `${pct(p.prediction_accuracy)} of ${int(p.predictions)}` : dash),
    ];
  });
}

function renderHot(view) {
  fillTable("#hot", "prefix", view.hot_prefixes.map((h) => [h.hash, h]), (h) => {
    const holders = h.holders == null
      ? "unknown: this policy keeps no prefix index"
      : h.holders.map((x) => `${x.replica_id} ${int(x.gpu_tokens)} · ${int(x.host_tokens)}`).join(", ") || "nobody";
    return [
      cell("hash", h.hash, h.hash),
      cell("requests", h.requests, int(h.requests)),
      cell("prompt_tokens", h.prompt_tokens, int(h.prompt_tokens)),
      cell("holders", h.holders == null ? "" : h.holders.map((x) => x.replica_id).join(","), holders),
      cell("spread", (h.replicated_on || []).join(","), h.replicated_on == null ? "" : h.replicated_on.join(", ")),
      cell("text", h.text, h.text == null ? "" : h.text, "text"),
    ];
  });
  for (const el of document.querySelectorAll(".text-col")) el.hidden = !view.text_shown;
  for (const el of document.querySelectorAll("td.text")) el.hidden = !view.text_shown;
}

// ------------------------------------------------------------------ charts

function addPoints(series) {
  for (const [policy, points] of Object.entries(series)) {
    state.points[policy] = (state.points[policy] || []).concat(points);
    colorOf(policy);
  }
  const horizon = Date.now() / 1000 - HISTORY_S;
  for (const policy of Object.keys(state.points)) {
    state.points[policy] = state.points[policy].filter((p) => p.ts >= horizon);
  }
}

// uPlot wants one x array shared by every series: the union of the policies'
// time stamps, with gaps (null) where a policy did not route.
function aligned(fields) {
  const policies = Object.keys(state.points);
  const xs = [...new Set(policies.flatMap((p) => state.points[p].map((q) => q.ts)))].sort((a, b) => a - b);
  const data = [xs];
  const series = [{}];
  for (const policy of policies) {
    const byTs = new Map(state.points[policy].map((q) => [q.ts, q]));
    fields.forEach((field, i) => {
      data.push(xs.map((x) => (byTs.has(x) ? byTs.get(x)[field] : null)));
      series.push({ label: i ? `${policy} p90` : policy, stroke: colorOf(policy), width: 2, dash: i ? [6, 4] : undefined });
    });
  }
  return { data, series };
}

function drawChart(id, fields, format, range) {
  const { data, series } = aligned(fields);
  const signature = series.map((s) => s.label).join("|");
  let chart = state.charts[id];
  if (chart && chart.signature !== signature) {
    chart.plot.destroy();
    chart = null;
  }
  if (!chart) {
    const options = {
      width: 430, height: 210, series,
      scales: { x: { time: true }, y: range ? { range } : {} },
      // Wide enough for "1000.0 ms": uPlot's default cuts long tick labels.
      axes: [{}, { values: (u, ticks) => ticks.map(format), size: 76 }],
      legend: { live: false },
    };
    chart = state.charts[id] = { plot: new uPlot(options, data, $(id)), signature };
  } else {
    chart.plot.setData(data);
  }
}

function renderCharts() {
  drawChart("#chart-hit", ["token_hit_rate"], pct, [0, 1]);
  drawChart("#chart-ttft", ["ttft_p50_s", "ttft_p90_s"], ms, null);
  drawChart("#chart-accuracy", ["prediction_accuracy"], pct, [0, 1]);
}

// ------------------------------------------------------------------ polling

function setStatus(text, error = false) {
  const status = $("#status");
  status.textContent = text;
  status.classList.toggle("error", error);
}

async function refresh() {
  const headers = state.key ? { Authorization: "Bearer " + state.key } : {};
  const url = `dashboard/data?since=${state.since}` + (state.showText ? "&text=true" : "");
  let response;
  try {
    response = await fetch(url, { headers, cache: "no-store" });
  } catch (error) {
    setStatus(`The gateway did not answer (${error}); retrying.`, true);
    return;
  }
  if (response.status === 401 || response.status === 403) {
    const why = response.status === 401 ? "This gateway has API keys: enter an admin key above." : "This key is not an admin's: enter an admin key above.";
    setStatus(why, true);
    return;
  }
  if (!response.ok) {
    setStatus(`The gateway answered ${response.status}; retrying.`, true);
    return;
  }
  const view = await response.json();
  state.since = view.ts;
  addPoints(view.series);
  renderFleet(view);
  renderReplicas(view);
  renderPools(view);
  renderModels(view);
  renderTenants(view);
  renderPolicies(view);
  renderHot(view);
  renderCharts();
  document.body.dataset.refreshed = String(view.ts);
  setStatus(`Updated ${new Date(view.ts * 1000).toLocaleTimeString()} · every ${REFRESH_MS / 1000} s`);
}

$("#key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("#key").value.trim();
  sessionStorage.setItem("prefix-router-key", state.key);
  $("#key").value = "";
  refresh();
});
$("#show-text").addEventListener("change", (event) => {
  state.showText = event.target.checked;
  refresh();
});

refresh();
setInterval(refresh, REFRESH_MS);
