// A job's page: its state kept current (a change of state reloads the page: new buttons, tasks, history)
// and the log of the chosen task streamed from /api/jobs/ID/logs/TASK?offset=N. textContent only.
"use strict";

const STATE_MS = 2000;
const LOG_MS = 1000;
const LOG_KEEP_CHARS = 400000;
const section = document.getElementById("job");
const jobId = section.dataset.job;
const logPane = document.getElementById("log");
let logTask = "";
let logOffset = 0;
let logTimer = null;

async function refreshState() {
  try {
    const response = await fetch(`/api/jobs/${jobId}`, { cache: "no-store", credentials: "same-origin" });
    if (!response.ok) return;
    const job = await response.json();
    if (job.state !== section.dataset.state) { window.location.reload(); return; }
    document.getElementById("job-restarts").textContent = String(job.restarts);
    const reason = document.getElementById("job-reason");
    reason.textContent = job.reason || "";
    reason.hidden = !job.reason;
  } catch (error) {
    // the service is restarting: try again
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
  for (const button of document.querySelectorAll("#log-tabs button")) {
    button.classList.toggle("on", button.dataset.task === task);
  }
  clearInterval(logTimer);
  pollLog();
  logTimer = setInterval(pollLog, LOG_MS);
}

for (const button of document.querySelectorAll("#log-tabs button")) {
  button.addEventListener("click", () => showLog(button.dataset.task));
}
const first = document.querySelector('#log-tabs button[data-task="worker:0"]')
  || document.querySelector("#log-tabs button");
if (first) showLog(first.dataset.task);
setInterval(refreshState, STATE_MS);
