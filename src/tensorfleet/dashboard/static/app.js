// The tensorfleet dashboard: polls api/status about once a second and updates the page in place.
//
// Every value from the launcher reaches the DOM through textContent or setAttribute, never
// innerHTML, so a task name with markup in it is shown as text. Stable hooks for tests and
// scripts: #global-step (data-value holds the raw number), #connection (data-state is
// "connecting", "ok", "finished" (the job is over: nothing will change) or "lost"), and
// one <tr data-task="NAME"> per task whose cells are
// <td data-field="FIELD" data-value="RAW">, FIELD being the picture's key for that column.
// A job with embedding tables (some ps reports tables, some worker unique ids) gets
// body.has-tables, which shows the tasks' "unique_ids" column and the #embedding-tables
// section: one <tr data-table="TABLE" data-shard="PS TASK"> per table and shard, whose cells
// are <td data-field="FIELD" data-value="RAW">, FIELD one of table, task, rows, bytes, rows_per_sec.
"use strict";

(() => {
  const POLL_MS = 1000;
  const REQUEST_TIMEOUT_MS = 3000;
  const STALE_HEARTBEAT_S = 5;
  const CHART_HEIGHT = 220;
  // Tick spacings on the elapsed-time axis, in seconds: whole, round durations only.
  const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 28800, 86400];
  const KNOWN_STATES = new Set([
    "starting", "running", "restarting", "done", "failed", "unreachable", "refused", "succeeded", "stopped",
  ]);
  const FINISHED_JOB_STATES = new Set(["succeeded", "failed", "stopped"]);

  // ---- formatting ---------------------------------------------------------------------------

  const DASH = "—";
  const integerFormat = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });
  const rateFormat = new Intl.NumberFormat("en-US", { notation: "compact", maximumSignificantDigits: 3 });

  const isNumber = (value) => typeof value === "number" && Number.isFinite(value);
  const formatInteger = (value) => (isNumber(value) ? integerFormat.format(value) : DASH);
  const formatRate = (value) => (isNumber(value) ? rateFormat.format(value) : DASH);
  const formatPlain = (value) => (value === null || value === undefined || value === "" ? DASH : String(value));

  function formatLoss(value) {
    if (!isNumber(value)) return DASH;
    if (value !== 0 && Math.abs(value) < 1e-3) return value.toExponential(2);
    return String(Number(value.toPrecision(4)));
  }

  function formatDuration(seconds) {
    if (!isNumber(seconds)) return DASH;
    const s = Math.max(0, seconds);
    if (s < 60) return `${s < 10 ? s.toFixed(1) : Math.round(s)} s`;
    const total = Math.round(s);
    const h = Math.floor(total / 3600);
    const m = Math.floor((total % 3600) / 60);
    const rest = total % 60;
    if (h > 0) return `${h} h ${String(m).padStart(2, "0")} m`;
    return `${m} m ${String(rest).padStart(2, "0")} s`;
  }

  function formatAxisTime(seconds) {
    const total = Math.round(seconds);
    if (Math.abs(total) < 60) return `${total}s`;
    const m = Math.floor(total / 60);
    return total % 60 === 0 ? `${m}m` : `${m}m${String(total % 60).padStart(2, "0")}`;
  }

  const formatAge = (value) => (isNumber(value) ? `${value.toFixed(1)} s` : DASH);
  const megabytesFormat = new Intl.NumberFormat("en-US", { minimumFractionDigits: 1, maximumFractionDigits: 1 });
  const formatMegabytes = (bytes) => (isNumber(bytes) ? megabytesFormat.format(bytes / 1e6) : DASH);
  const formatShare = (share) => (isNumber(share) ? `${(100 * share).toFixed(1)} %` : DASH);
  const stateClass = (state) => `badge state-${KNOWN_STATES.has(state) ? state : "unknown"}`;

  // ---- header -------------------------------------------------------------------------------

  const byId = (id) => document.getElementById(id);

  function setValue(id, value, format) {
    const element = byId(id);
    element.textContent = format(value);
    element.dataset.value = value === null || value === undefined ? "" : String(value);
  }

  function renderJob(job) {
    byId("job-name").textContent = job.name || DASH;
    document.title = `${job.name || "job"} · ${job.state || "?"} — tensorfleet`;

    const mode = byId("job-mode");
    mode.hidden = !job.mode;
    mode.textContent = job.mode || "";

    const state = byId("job-state");
    state.textContent = job.state || "";
    state.className = stateClass(job.state);
    document.body.dataset.jobState = job.state || "";

    // Something that keeps the picture from ever filling in (tasks refusing this dashboard): said, not hidden.
    const problem = byId("job-problem");
    problem.hidden = !job.problem;
    problem.textContent = job.problem || "";

    setValue("global-step", job.global_step, formatInteger);
    const target = job.target_step;
    byId("target-step").textContent = isNumber(target) ? ` / ${formatInteger(target)}` : "";
    renderProgress(job.global_step, target);

    setValue("examples-per-sec", job.examples_per_sec, formatRate);
    setValue("steps-per-sec", job.steps_per_sec, formatRate);
    setValue("eta", job.eta_s, formatDuration);
    setValue("elapsed", job.elapsed_s, formatDuration);
    setValue("dropped-stale", job.dropped_stale, formatInteger);
    setValue("restarts", job.restarts, formatInteger);
    renderMetrics(job.metrics);
  }

  // What the script reported of its model (tfl.report_metrics): one stat each, in the order reported.
  function renderMetrics(metrics) {
    const entries = Object.entries(metrics || {}).filter(([, value]) => isNumber(value));
    const section = byId("job-metrics");
    section.hidden = entries.length === 0;
    section.replaceChildren(...entries.map(([name, value]) => {
      const stat = document.createElement("div");
      stat.className = "stat metric";
      stat.dataset.metric = name;
      const label = document.createElement("span");
      label.className = "label";
      label.textContent = name;
      const shown = document.createElement("span");
      shown.className = "value";
      const size = Math.abs(value);
      shown.textContent = size >= 1e4 || (size > 0 && size < 1e-3) ? value.toPrecision(4) : value.toFixed(4);
      stat.append(label, shown);
      return stat;
    }));
  }

  function renderProgress(step, target) {
    const bar = byId("progress");
    const known = isNumber(step) && isNumber(target) && target > 0;
    const percent = known ? Math.min(100, (100 * step) / target) : 0;
    bar.classList.toggle("unknown", !known);
    byId("progress-fill").style.width = `${percent}%`;
    byId("progress-percent").textContent = known ? `${percent.toFixed(1)}%` : "no target step";
    if (known) bar.setAttribute("aria-valuenow", percent.toFixed(1));
    else bar.removeAttribute("aria-valuenow");
  }

  // ---- tasks table --------------------------------------------------------------------------

  const COLUMNS = [
    { field: "name", format: formatPlain },
    { field: "role", format: formatPlain },
    { field: "address", format: formatPlain, className: "mono" },
    { field: "state", badge: true },
    { field: "restarts", format: formatInteger, numeric: true },
    { field: "step", format: formatInteger, numeric: true },
    { field: "global_step", format: formatInteger, numeric: true },
    { field: "loss", format: formatLoss, numeric: true },
    { field: "examples_per_sec", format: formatRate, numeric: true },
    { field: "unique_ids", format: formatInteger, numeric: true, className: "tables-only" },
    { field: "heartbeat_age_s", format: formatAge, numeric: true },
    { field: "pid", format: formatPlain, numeric: true },
    { field: "exit_code", format: formatPlain, numeric: true },
  ];

  const rows = new Map(); // task name -> <tr>, so a row is updated in place, never rebuilt

  function createRow(name) {
    const row = document.createElement("tr");
    row.dataset.task = name;
    for (const column of COLUMNS) {
      const cell = document.createElement("td");
      cell.dataset.field = column.field;
      if (column.numeric) cell.classList.add("num");
      if (column.className) cell.classList.add(column.className);
      if (column.badge) cell.appendChild(document.createElement("span"));
      row.appendChild(cell);
    }
    return row;
  }

  function updateRow(row, task) {
    COLUMNS.forEach((column, index) => {
      const cell = row.cells[index];
      const value = task[column.field];
      cell.dataset.value = value === null || value === undefined ? "" : String(value);
      if (column.badge) {
        cell.firstChild.textContent = formatPlain(value);
        cell.firstChild.className = stateClass(value);
      } else {
        cell.textContent = column.format(value);
      }
    });
    const age = task.heartbeat_age_s;
    row.cells[COLUMNS.findIndex((c) => c.field === "heartbeat_age_s")].classList.toggle(
      "stale", isNumber(age) && age > STALE_HEARTBEAT_S && task.state === "running");
    const exit = row.cells[COLUMNS.findIndex((c) => c.field === "exit_code")];
    // A task stopped on purpose (the job stopped, or scaled away) exits by our SIGTERM: not a failure.
    exit.classList.toggle("bad", isNumber(task.exit_code) && task.exit_code !== 0 && task.state !== "stopped");
  }

  function renderTasks(tasks) {
    const body = byId("task-rows");
    const seen = new Set();
    tasks.forEach((task, index) => {
      const name = String(task.name);
      seen.add(name);
      let row = rows.get(name);
      if (!row) {
        row = createRow(name);
        rows.set(name, row);
      }
      updateRow(row, task);
      if (body.children[index] !== row) body.insertBefore(row, body.children[index] || null);
    });
    for (const [name, row] of rows) {
      if (!seen.has(name)) {
        row.remove();
        rows.delete(name);
      }
    }
    byId("no-tasks").hidden = tasks.length > 0;
    const running = tasks.filter((task) => task.state === "running").length;
    byId("task-count").textContent = tasks.length ? `${running} of ${tasks.length} running` : "";
  }

  // ---- embedding tables ---------------------------------------------------------------------

  const TABLE_COLUMNS = [
    { field: "table", format: formatPlain },
    { field: "task", format: formatPlain },
    { field: "rows", format: formatInteger, numeric: true },
    { field: "bytes", format: formatMegabytes, numeric: true },
    { field: "rows_per_sec", format: formatRate, numeric: true },
    { field: "traffic_share", format: formatShare, numeric: true },
    { field: "admitted", format: formatInteger, numeric: true },
    { field: "refused_updates", format: formatInteger, numeric: true },
    { field: "evicted", format: formatInteger, numeric: true },
  ];

  const tableRows = new Map(); // "table\0task" -> <tr>, updated in place as the task rows are

  const hasTables = (task) =>
    (task.tables !== null && typeof task.tables === "object" && Object.keys(task.tables).length > 0) ||
    isNumber(task.unique_ids);

  // One entry per (table, shard): tables in the order the shards first name them, shards in task order.
  function tableEntries(tasks) {
    const byTable = new Map();
    for (const task of tasks) {
      if (task.tables === null || typeof task.tables !== "object") continue;
      for (const [table, figures] of Object.entries(task.tables)) {
        if (!byTable.has(table)) byTable.set(table, []);
        byTable.get(table).push({ ...(figures || {}), table, task: String(task.name) });
      }
    }
    return [...byTable.values()].flat();
  }

  function renderTables(job, tasks) {
    const shown = tasks.some(hasTables);
    document.body.classList.toggle("has-tables", shown);
    byId("embedding-tables").hidden = !shown;
    const body = byId("table-rows");
    const seen = new Set();
    tableEntries(shown ? tasks : []).forEach((entry, index) => {
      const key = `${entry.table}\u0000${entry.task}`;
      seen.add(key);
      let row = tableRows.get(key);
      if (!row) {
        row = document.createElement("tr");
        row.dataset.table = entry.table;
        row.dataset.shard = entry.task;
        for (const column of TABLE_COLUMNS) {
          const cell = document.createElement("td");
          cell.dataset.field = column.field;
          if (column.numeric) cell.classList.add("num");
          row.appendChild(cell);
        }
        tableRows.set(key, row);
      }
      TABLE_COLUMNS.forEach((column, i) => {
        const value = entry[column.field];
        row.cells[i].dataset.value = value === null || value === undefined ? "" : String(value);
        row.cells[i].textContent = column.format(value);
      });
      if (body.children[index] !== row) body.insertBefore(row, body.children[index] || null);
    });
    for (const [key, row] of tableRows) {
      if (!seen.has(key)) {
        row.remove();
        tableRows.delete(key);
      }
    }
    const total = [];
    if (isNumber(job.table_rows)) total.push(`${formatInteger(job.table_rows)} rows`);
    if (isNumber(job.rows_per_sec)) total.push(`${formatRate(job.rows_per_sec)} rows / s`);
    byId("table-total").textContent = total.join(" · ");
  }

  // ---- charts -------------------------------------------------------------------------------

  // The legend shows the point under the cursor, and the latest point when there is no cursor.
  const legendValue = (format) => (u, value, seriesIndex, index) => {
    if (index !== null && index !== undefined) return format(value);
    const values = u.data[seriesIndex];
    return format(values.length ? values[values.length - 1] : null);
  };

  function makeChart(container, label, color, format) {
    const axis = { stroke: "#6b7280", grid: { stroke: "#eef0f4", width: 1 }, ticks: { stroke: "#e5e7eb", width: 1 } };
    const options = {
      width: Math.max(200, container.clientWidth),
      height: CHART_HEIGHT,
      // Elapsed seconds, not dates, on x; y from 0 so a dip in throughput is not exaggerated.
      scales: { x: { time: false }, y: { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] } },
      legend: { live: true },
      cursor: { drag: { x: false, y: false } },
      series: [
        { label: "elapsed", value: legendValue(formatDuration) },
        {
          label, stroke: color, width: 2, fill: `${color}1f`, spanGaps: true, points: { show: false },
          value: legendValue(format),
        },
      ],
      axes: [
        { ...axis, incrs: TIME_STEPS, values: (u, splits) => splits.map(formatAxisTime) },
        { ...axis, size: 56, values: (u, splits) => splits.map(format) },
      ],
    };
    container.replaceChildren();
    const chart = new uPlot(options, [[], []], container);
    new ResizeObserver(() => chart.setSize({ width: Math.max(200, container.clientWidth), height: CHART_HEIGHT }))
      .observe(container);
    return chart;
  }

  const charts = {
    loss: { id: "loss-chart", label: "loss", key: "loss", color: "#7c3aed", format: formatLoss, chart: null },
    throughput: {
      id: "throughput-chart", label: "examples / s", key: "examples_per_sec", color: "#0284c7", format: formatRate,
      chart: null,
    },
  };
  let lastHistoryKey = "";

  function renderHistory(history) {
    if (typeof uPlot === "undefined") return; // the chart library failed to load: keep the rest working
    const key = history.length ? `${history.length}:${history[0].t}:${history[history.length - 1].t}` : "";
    if (key === lastHistoryKey) return; // nothing new since the last poll
    lastHistoryKey = key;
    const times = history.map((point) => point.t);
    for (const spec of Object.values(charts)) {
      const values = history.map((point) => (isNumber(point[spec.key]) ? point[spec.key] : null));
      if (!spec.chart && !history.length) continue;
      if (!spec.chart) spec.chart = makeChart(byId(spec.id), spec.label, spec.color, spec.format);
      spec.chart.setData([times, values]);
    }
  }

  // ---- connection and polling ---------------------------------------------------------------

  let lastSuccess = null;

  class HttpError extends Error {}

  // ok: the picture came; then jobState says whether it is still live or the job is over.
  function setConnection(ok, reason, jobState) {
    const indicator = byId("connection");
    document.body.classList.toggle("disconnected", !ok);
    if (ok) {
      const finished = FINISHED_JOB_STATES.has(jobState);
      indicator.dataset.state = finished ? "finished" : "ok";
      indicator.textContent = finished ? "Finished" : "Live";
      indicator.removeAttribute("title");
      return;
    }
    indicator.dataset.state = "lost";
    const since = lastSuccess === null ? "" : ` · last update ${formatDuration((Date.now() - lastSuccess) / 1000)} ago`;
    // An HTTP error means the launcher is up but its picture failed: say so, it is a different problem.
    const problem = reason instanceof HttpError ? `The launcher answered ${reason.message}` : "Cannot reach the launcher";
    indicator.textContent = `${problem} — retrying${since}`;
    indicator.title = String(reason);
  }

  function render(picture) {
    renderJob(picture.job || {});
    renderTasks(picture.tasks || []);
    renderTables(picture.job || {}, picture.tasks || []);
    renderHistory(picture.history || []);
  }

  async function fetchStatus() {
    const controller = new AbortController();
    const timer = setTimeout(() => controller.abort(), REQUEST_TIMEOUT_MS);
    try {
      const response = await fetch("api/status", { cache: "no-store", signal: controller.signal });
      if (!response.ok) throw new HttpError(`HTTP ${response.status}`);
      return await response.json();
    } finally {
      clearTimeout(timer);
    }
  }

  async function poll() {
    let picture = null;
    try {
      picture = await fetchStatus();
    } catch (error) {
      setConnection(false, error);
    }
    if (picture) {
      lastSuccess = Date.now();
      setConnection(true, null, picture.job && picture.job.state);
      try {
        render(picture);
      } catch (error) {
        console.error("tensorfleet dashboard: cannot render the snapshot", error);
      }
    }
    setTimeout(poll, POLL_MS);
  }

  poll();
})();
