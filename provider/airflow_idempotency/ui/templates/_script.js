"use strict";
// Follow Airflow's colour mode when the page is inside Airflow's own (same-origin) page.
try {
  const mode = window.parent.document.documentElement.classList;
  if (mode.contains("dark")) document.documentElement.classList.add("dark");
  else if (mode.contains("light")) document.documentElement.classList.add("light");
} catch (e) { /* not framed by Airflow */ }

// Links to Airflow's own pages open in Airflow's window, not inside this frame. Airflow 3:
// its router is told to go there (the frame may not navigate the top window: Airflow
// sandboxes it). Airflow 2.11 (the view's own frame, data-top-root): the top window goes.
const framing = document.body.dataset;
document.addEventListener("click", (event) => {
  const link = event.target.closest("a[data-airflow]");
  if (!link || window.top === window || event.ctrlKey || event.metaKey || event.shiftKey) return;
  try {
    const top = window.top, url = new URL(link.href, document.baseURI);
    if (framing.topRoot !== undefined) {
      top.location.assign(url.href);
    } else {
      const idx = ((top.history.state && top.history.state.idx) || 0) + 1;
      top.history.pushState({usr: null, key: Math.random().toString(36).slice(2, 10), idx}, "",
                            url.pathname + url.search + url.hash);
      top.dispatchEvent(new PopStateEvent("popstate", {state: top.history.state}));
    }
    event.preventDefault();
  } catch (e) { /* not same-origin: follow the link here */ }
});

// Airflow 2.11: the address bar follows the frame (a reload or a bookmark shows this page).
if (framing.topRoot !== undefined && window.top !== window &&
    location.pathname.startsWith(framing.frameRoot)) {
  try {
    window.top.history.replaceState(window.top.history.state, "",
      framing.topRoot + location.pathname.slice(framing.frameRoot.length) + location.search);
    window.top.document.title = document.title;
  } catch (e) { /* not same-origin */ }
}

// The DAG tab's "Rerun…" buttons show the key's rerun form (no inline handlers: the CSP).
document.querySelectorAll("button.show-rerun").forEach((button) => {
  button.addEventListener("click", () => {
    document.getElementById("rerun-" + button.dataset.key).hidden = false;
  });
});

// Rerun forms: "Trigger" first asks for confirmation, naming the DAG, the key and whether
// Force and Dry run are ticked; only "Yes, trigger" POSTs a DAG run to Airflow's REST API,
// with the user's own session (so Airflow decides whether this user may trigger the DAG).
document.querySelectorAll("form.rerun").forEach((form) => {
  const out = form.querySelector(".result");
  const confirmBox = form.querySelector(".confirm");
  const flags = () => ({force: !!(form.elements.force && form.elements.force.checked),
                        dry_run: !!(form.elements.dry_run && form.elements.dry_run.checked)});
  const ask = () => {
    const f = flags();
    confirmBox.querySelector(".question").textContent =
      "Trigger a run of DAG " + form.dataset.dagId + " for run key " + form.dataset.runKey +
      ", Force " + (f.force ? "ticked: jobs already completed for this key run again"
                            : "not ticked: jobs already completed for this key are no-ops") +
      ", Dry run " + (f.dry_run ? "ticked: the work is rolled back and nothing is sent"
                                : "not ticked") + "?";
    confirmBox.hidden = false;
    confirmBox.querySelector("button.yes").focus();
  };
  form.addEventListener("change", () => { if (!confirmBox.hidden) ask(); });
  confirmBox.querySelector("button.no").addEventListener("click", () => { confirmBox.hidden = true; });
  form.addEventListener("submit", (event) => { event.preventDefault(); ask(); });
  confirmBox.querySelector("button.yes").addEventListener("click", async () => {
    const button = form.querySelector("button[type=submit]");
    const yes = confirmBox.querySelector("button.yes");
    const conf = {run_key: form.dataset.runKey};
    const f = flags();
    if (f.force) conf.force = true;
    if (f.dry_run) conf.dry_run = true;
    confirmBox.hidden = true;
    button.disabled = yes.disabled = true;
    out.textContent = "Triggering…";
    const headers = {"Content-Type": "application/json", "Accept": "application/json"};
    if (form.dataset.csrf) headers["X-CSRFToken"] = form.dataset.csrf;
    const body = {conf, note: "Rerun of run key " + conf.run_key + " from the Run keys view"};
    if (form.dataset.noLogicalDate !== undefined) body.logical_date = null;
    try {
      const response = await fetch(form.dataset.api, {
        method: "POST", credentials: "same-origin", headers, body: JSON.stringify(body)});
      const answer = await response.json().catch(() => ({}));
      if (!response.ok) {
        const detail = typeof answer.detail === "string" ? answer.detail
          : JSON.stringify(answer.detail || answer.title || answer);
        out.innerHTML = "";
        out.append(Object.assign(document.createElement("span"), {className: "err",
          textContent: "Not triggered (" + response.status + "): " + detail}));
        button.disabled = yes.disabled = false;
        return;
      }
      const link = Object.assign(document.createElement("a"), {
        href: form.dataset.runsUrl + encodeURIComponent(answer.dag_run_id),
        textContent: answer.dag_run_id});
      link.dataset.airflow = "";
      out.innerHTML = "";
      out.append("Triggered ", link, " (" + (answer.state || "queued") +
                 (f.force ? ", forced" : "") + (f.dry_run ? ", dry run" : "") + ").");
      yes.disabled = false;
    } catch (e) {
      out.textContent = "Not triggered: " + e;
      button.disabled = yes.disabled = false;
    }
  });
});
