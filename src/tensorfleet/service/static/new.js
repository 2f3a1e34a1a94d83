// The new-job form: the script list filtered as the user types (every word must be part of the path);
// the scripts that run as a job come first. Without this file the list still works, unfiltered. textContent only.
"use strict";

const filter = document.getElementById("script-filter");
const select = document.getElementById("script");
const count = document.getElementById("script-count");

function applyFilter() {
  const words = filter.value.toLowerCase().split(/\s+/).filter(Boolean);
  let shown = 0;
  let total = 0;
  let firstShown = null;
  for (const option of select.querySelectorAll("option")) {
    if (!option.value) continue;
    total += 1;
    const path = option.value.toLowerCase();
    const match = words.every((word) => path.includes(word));
    option.hidden = !match;
    if (match) {
      shown += 1;
      if (firstShown === null) firstShown = option;
    }
  }
  for (const group of select.querySelectorAll("optgroup")) {
    group.hidden = !group.querySelector("option:not([hidden])");
  }
  const chosen = select.selectedOptions[0];
  if (words.length && firstShown !== null && (!chosen || !chosen.value || chosen.hidden)) {
    select.value = firstShown.value;
  }
  count.textContent = words.length ? `${shown} of ${total} match` : `${total} Python files`;
}

filter.addEventListener("input", applyFilter);
filter.addEventListener("keydown", (event) => {
  if (event.key === "Enter") {  // Enter in the filter picks the first match, it does not submit the form
    event.preventDefault();
    select.focus();
  }
});
applyFilter();
