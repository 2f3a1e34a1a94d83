// A job's page: its state kept current (a change of state loads the page again: new buttons, tasks, history),
// its tasks and log tabs following a scale (from /api/jobs/ID/tasks, no reload), and the log of the chosen
// task streamed from /api/jobs/ID/logs/TASK?offset=N. textContent only.
"use strict";

const STATE_MS = 2000;
const TASKS_MS = 2000;
const LOG_MS = 1000;
const LOG_KEEP_CHARS = 400000;
const section = document.getElementById("job");
const jobId = section.dataset.job;
const logPane = document.getElementById("log");
const logTabs = document.getElementById("log-tabs");
const taskRows = document.getElementById("task-rows");
let logTask = "";
let logOffset = 0;
let logTimer = null;
let tasksSeen = "";

function showText(id, text) {
  const element = document.getElementById(id);
  element.textContent = text || "";
  element.hidden = !text;
}

function formatMetric(value) {  // as the launcher's summary and the jobs list write it
  const size = Math.abs(value);
  return size >= 1e4 || (size > 0 && size < 1e-3) ? value.toPrecision(4) : value.toFixed(4);
}

async function refreshState() {
  try {
    const response = await fetch(`/api/jobs/${jobId}`, { cache: "no-store", credentials: "same-origin" });
    if (!response.ok) return;
    const job = await response.json();
    // The job's own address, not reload(): this page may be the answer to a POST (an error, a question),
    // which a reload would send again.
    if (job.state !== section.dataset.state) { window.location.assign(`/jobs/${jobId}`); return; }
    document.getElementById("job-restarts").textContent = String(job.restarts);
    const metrics = Object.entries(job.metrics || {}).map(([name, value]) => `${name} ${formatMetric(value)}`);
    document.getElementById("job-metrics").textContent = metrics.join(", ") || "none reported yet";
    document.getElementById("job-reason-box").hidden = !job.reason;
    showText("job-error-line", job.error_line);
    document.getElementById("job-reason").textContent = job.summary || "";
    showText("job-traceback", job.traceback);
  } catch (error) {
    // the service is restarting: try again
  }
}

function tabLabel(task) {
  return task.state === "removed" ? `${task.name} (removed)` : task.name;
}

function taskRow(task) {
  const tr = document.createElement("tr");
  tr.dataset.task = task.name;
  tr.dataset.state = task.state || "";
  for (const [field, text] of [["name", task.name], ["state", task.state || ""], ["role", task.role]]) {
    const td = document.createElement("td");
    td.textContent = text;
    if (field === "state") td.dataset.field = "state";
    tr.appendChild(td);
  }
  const command = document.createElement("td");
  const code = document.createElement("code");
  code.textContent = task.command.join(" ");
  command.appendChild(code);
  const env = document.createElement("td");
  const pre = document.createElement("pre");
  pre.textContent = Object.entries(task.env).map(([key, value]) => `${key}=${value}\n`).join("");
  env.appendChild(pre);
  tr.append(command, env);
  return tr;
}

function tabButton(name, state, label) {
  const button = document.createElement("button");
  button.type = "button";
  button.dataset.task = name;
  button.dataset.state = state || "";
  button.textContent = label;
  button.classList.toggle("on", name === logTask);
  button.addEventListener("click", () => showLog(name));
  return button;
}

async function refreshTasks() {
  try {
    const response = await fetch(`/api/jobs/${jobId}/tasks`, { cache: "no-store", credentials: "same-origin" });
    if (!response.ok) return;
    const { tasks } = await response.json();
    const seen = JSON.stringify(tasks);
    if (seen === tasksSeen) return;
    tasksSeen = seen;
    taskRows.replaceChildren(...tasks.map(taskRow));
    const tabs = tasks.map((task) => tabButton(task.name, task.state, tabLabel(task)));
    logTabs.replaceChildren(...tabs, tabButton("launcher", "", "launcher"));
    if (!logTask) pickFirstLog();
  } catch (error) {
    // try again on the next tick
  }
}

async function pollLog() {
  const task = logTask;
  try {
    const response = await fetch(`/api/jobs/${jobId}/logs/${encodeURIComponent(task)}?offset=${logOffset}`,
                                 { cache: "no-store", credentials: "same-origin" });
    if (task !== logTask || !response.ok) return;
    const chunk = await response.json();
    if (chunk.text) {
      const atBottom = logPane.scrollTop + logPane.clientHeight >= logPane.scrollHeight - 8;
      let text = logPane.textContent + chunk.text;
      if (text.length > LOG_KEEP_CHARS) text = text.slice(text.length - LOG_KEEP_CHARS);
      logPane.textContent = text;
      if (atBottom) logPane.scrollTop = logPane.scrollHeight;
    }
    logOffset = chunk.next_offset;
  } catch (error) {
    // try again on the next tick
  }
}

function showLog(task) {
  logTask = task;
  logOffset = 0;
  logPane.textContent = "";
  logPane.dataset.task = task;
  for (const button of logTabs.querySelectorAll("button")) {
    button.classList.toggle("on", button.dataset.task === task);
  }
  clearInterval(logTimer);
  pollLog();
  logTimer = setInterval(pollLog, LOG_MS);
}

function pickFirstLog() {
  const first = logTabs.querySelector('button[data-task="worker:0"]') || logTabs.querySelector("button");
  if (first) showLog(first.dataset.task);
}

for (const button of logTabs.querySelectorAll("button")) {
  button.addEventListener("click", () => showLog(button.dataset.task));
}
pickFirstLog();
setInterval(refreshState, STATE_MS);
setInterval(refreshTasks, TASKS_MS);
