// The jobs list, kept current: every 2 s the rows are rebuilt from /api/jobs, with textContent only.
"use strict";

const REFRESH_MS = 2000;

function age(seconds) {
  seconds = Math.max(0, Math.floor(seconds));
  for (const [unit, size] of [["d", 86400], ["h", 3600], ["min", 60]]) {
    if (seconds >= size) return `${Math.floor(seconds / size)} ${unit}`;
  }
  return `${seconds} s`;
}

function cell(field, text, href) {
  const td = document.createElement("td");
  td.dataset.field = field;
  if (href) {
    const a = document.createElement("a");
    a.href = href;
    a.textContent = text;
    td.appendChild(a);
  } else if (field === "state") {
    const span = document.createElement("span");
    span.className = `state ${text}`;
    span.textContent = text;
    td.appendChild(span);
  } else {
    td.textContent = text;
  }
  return td;
}

// "accuracy 0.9771, rmse 0.9114": what the job's script reported (tfl.report_metrics), as the launcher says it.
function metricsText(metrics) {
  return Object.entries(metrics || {}).map(([name, value]) => `${name} ${formatMetric(value)}`).join(", ");
}

function formatMetric(value) {
  const size = Math.abs(value);
  return size >= 1e4 || (size > 0 && size < 1e-3) ? value.toPrecision(4) : value.toFixed(4);
}

function row(job) {
  const tr = document.createElement("tr");
  tr.dataset.job = job.id;
  const p = job.progress || {};
  const progress = p.global_step ? `${p.global_step}${p.target_step ? ` / ${p.target_step}` : ""}` : "";
  tr.append(
    cell("id", String(job.id), `/jobs/${job.id}`),
    cell("name", job.name, `/jobs/${job.id}`),
    cell("state", job.state),
    cell("progress", progress),
    cell("steps_per_sec", p.steps_per_sec ? p.steps_per_sec.toFixed(1) : ""),
    cell("metrics", metricsText(job.metrics)),
    cell("restarts", String(job.restarts)),
    cell("age", age(job.age_s)),
    cell("owner", job.owner),
    cell("backend", job.backend),
  );
  return tr;
}

async function refresh() {
  const state = document.getElementById("jobs").dataset.state;
  try {
    const response = await fetch(`/api/jobs${state ? `?state=${encodeURIComponent(state)}` : ""}`,
                                 { cache: "no-store", credentials: "same-origin" });
    if (response.status === 401) { window.location.href = "/login?next=/"; return; }
    if (!response.ok) return;
    const { jobs } = await response.json();
    document.getElementById("job-rows").replaceChildren(...jobs.map(row));
    document.getElementById("no-jobs").hidden = jobs.length > 0;
  } catch (error) {
    // the service is restarting: keep the last rows and try again
  }
}

setInterval(refresh, REFRESH_MS);
