// Live dashboard of torsh-distributed: polls /api/state and draws plain-canvas charts.
// No libraries, nothing fetched from the internet. Each canvas records how many data points it
// drew in its data-points attribute (the browser test reads it).
"use strict";

const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];
const PHASES = ["data", "forward", "backward", "optimizer", "comm_wait"];

function fmt(v) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
  if (a >= 10) return v.toFixed(0);
  return v.toPrecision(3);
}

function frame(canvas) {
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, left: 48, right: canvas.width - 10, top: 10, bottom: canvas.height - 36 };
}

function message(canvas, text) {
  const { ctx } = frame(canvas);
  ctx.fillStyle = "#6b7280";
  ctx.fillText(text, 60, canvas.height / 2);
  canvas.dataset.points = "0";
}

// series: [{name, values}] sharing the x values xs.
function lineChart(canvas, xs, series) {
  const finite = series.flatMap(s => s.values.filter(v => v !== null && isFinite(v)));
  if (!xs.length || !finite.length) { message(canvas, "waiting for data…"); return; }
  const f = frame(canvas), ctx = f.ctx;
  let lo = Math.min(0, ...finite), hi = Math.max(...finite);
  if (hi === lo) hi = lo + 1;
  const x0 = xs[0], x1 = xs[xs.length - 1] === x0 ? x0 + 1 : xs[xs.length - 1];
  const px = x => f.left + (x - x0) / (x1 - x0) * (f.right - f.left);
  const py = y => f.bottom - (y - lo) / (hi - lo) * (f.bottom - f.top);
  ctx.strokeStyle = "#d1d5db"; ctx.fillStyle = "#6b7280";
  for (let i = 0; i <= 4; i++) {
    const y = lo + (hi - lo) * i / 4;
    ctx.beginPath(); ctx.moveTo(f.left, py(y)); ctx.lineTo(f.right, py(y)); ctx.stroke();
    ctx.fillText(fmt(y), 4, py(y) + 4);
  }
  ctx.fillText("step " + x0, f.left, f.bottom + 14);
  ctx.fillText("step " + xs[xs.length - 1], f.right - 60, f.bottom + 14);
  let points = 0;
  series.forEach((s, i) => {
    ctx.strokeStyle = COLORS[i % COLORS.length]; ctx.fillStyle = ctx.strokeStyle; ctx.lineWidth = 2;
    ctx.beginPath();
    let pen = false;
    s.values.forEach((v, j) => {
      if (v === null || !isFinite(v)) { pen = false; return; }
      points++;
      if (pen) ctx.lineTo(px(xs[j]), py(v)); else ctx.moveTo(px(xs[j]), py(v));
      pen = true;
      if (xs.length < 40) ctx.fillRect(px(xs[j]) - 2, py(v) - 2, 4, 4);
    });
    ctx.stroke(); ctx.lineWidth = 1;
    if (series.length > 1) ctx.fillText(s.name, f.left + 8 + i * 90, canvas.height - 6);
  });
  canvas.dataset.points = String(points);
}

function barChart(canvas, labels, values, highlight) {
  if (!values.length) { message(canvas, "waiting for data…"); return; }
  const f = frame(canvas), ctx = f.ctx;
  const hi = Math.max(...values, 1e-9) * 1.15;  // room for the value labels
  const w = (f.right - f.left) / values.length;
  values.forEach((v, i) => {
    const h = v / hi * (f.bottom - f.top);
    ctx.fillStyle = i === highlight ? "#dc2626" : "#2563eb";
    ctx.fillRect(f.left + i * w + w * 0.15, f.bottom - h, w * 0.7, h);
    ctx.fillStyle = "#374151";
    ctx.fillText(labels[i], f.left + i * w + w * 0.4, f.bottom + 14);
    ctx.fillText(fmt(v), f.left + i * w + w * 0.35, f.bottom - h - 4);
  });
  canvas.dataset.points = String(values.length);
}

function renderAlerts(state) {
  const body = document.querySelector("#alerts tbody");
  body.innerHTML = "";
  for (const a of state.alerts || []) {
    const tr = document.createElement("tr");
    const cells = [a.severity, a.rule, a.message, a.step, a.count];
    cells.forEach((c, i) => {
      const td = document.createElement("td");
      td.textContent = String(c);
      if (i === 0) td.className = "sev-" + a.severity;
      tr.appendChild(td);
    });
    const td = document.createElement("td");
    if (a.acknowledged) td.textContent = "acknowledged";
    else {
      const b = document.createElement("button");
      b.textContent = "acknowledge";
      b.onclick = () => fetch("api/ack?rule=" + encodeURIComponent(a.rule), { method: "POST" });
      td.appendChild(b);
    }
    tr.appendChild(td);
    body.appendChild(tr);
  }
  if (!(state.alerts || []).length) {
    const tr = document.createElement("tr");
    tr.innerHTML = "<td colspan=6>no active alerts</td>";
    body.appendChild(tr);
  }
  const s = state.alert_stats || {};
  document.getElementById("alert-stats").textContent =
    `opened ${s.opened ?? 0} · notified ${s.notified ?? 0} · suppressed by cooldown ${s.suppressed ?? 0}` +
    ` · acknowledged ${s.acknowledged ?? 0} · resolved ${s.resolved ?? 0}`;
}

function render(state) {
  const h = state.history || {};
  const xs = h.step || [];
  // a federated run publishes rounds and clients in the same shape (unit, rank_label)
  const unit = state.unit || "step", who = state.rank_label || "rank";
  document.getElementById("job").textContent = `job ${state.job} · ${state.world_size} ${who}s`;
  document.getElementById("progress").textContent = `${unit} ${state.step ?? 0} / ${state.max_steps ?? "?"}`;
  const status = document.getElementById("status");
  status.textContent = state.done ? "finished" : "live";
  status.className = "badge " + (state.done ? "done" : "live");
  document.getElementById("slowest").textContent = state.ranks && state.ranks.length ?
    `slowest ${who} ${state.slowest_rank} (${(state.imbalance || 1).toFixed(2)}x median)` : "";
  lineChart(document.getElementById("chart-loss"), xs, [{ name: "loss", values: h.loss || [] }]);
  lineChart(document.getElementById("chart-throughput"), xs,
    [{ name: state.throughput_label || "tokens/s", values: h.tokens_per_s || [] }]);
  lineChart(document.getElementById("chart-breakdown"), xs,
    PHASES.map(p => ({ name: p, values: (h[p] || []).map(v => v === null ? null : v * 1e3) })));
  const ranks = state.ranks || [];
  barChart(document.getElementById("chart-ranks"), ranks.map(r => who + " " + r.rank),
    ranks.map(r => r.busy * 1e3), state.slowest_rank);
  const comm = h.comm_mbps || [];
  const hasComm = comm.some(v => v !== null && v > 0);
  if (hasComm) lineChart(document.getElementById("chart-comm"), xs, [{ name: "MB/s", values: comm }]);
  else message(document.getElementById("chart-comm"), "no profiled collectives yet");
  document.getElementById("comm-note").textContent = hasComm ? "" :
    "Bandwidth comes from the comm profiler: run with --comm-algorithm ring --trace FILE.";
  lineChart(document.getElementById("chart-memory"), xs, [
    { name: "RSS", values: (h.rss_max || []).map(v => v === null ? null : v / 2 ** 20) },
    { name: "CUDA", values: (h.cuda_max || []).map(v => v === null ? null : v / 2 ** 20) },
  ]);
  const power = h.power_w || [];
  if (power.some(v => v !== null)) {
    lineChart(document.getElementById("chart-energy"), xs, [{ name: "W", values: power }]);
    const grams = (h.carbon_g || []).filter(v => v !== null);
    const carbon = grams.length ? grams[grams.length - 1] : null;
    document.getElementById("energy-note").textContent =
      `carbon so far ${carbon === null ? "–" : carbon.toPrecision(3)} g CO2e. From the ranks' energy ` +
      "meters (docs/energy.md); ranks that share a host's RAPL counter each count it.";
  } else {
    message(document.getElementById("chart-energy"), "no energy metering (--energy.meter off)");
  }
  renderAlerts(state);
  document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
}

async function poll() {
  try {
    const response = await fetch("api/state", { cache: "no-store" });
    render(await response.json());
  } catch (err) {
    const status = document.getElementById("status");
    status.textContent = "disconnected"; status.className = "badge down";
  }
  setTimeout(poll, 1000);
}
poll();
