// onnxforge console: plain JavaScript, no build step, no dependency. Served by app/api/console.py.
//
// Pages (hash routes): #/ upload form and live job list; #/jobs/<id> one job, its report and downloads.
// Every /v1 call carries `Authorization: Bearer <key>` when a key is set (sessionStorage: it lives as long
// as the tab). Everything the API returns is treated as hostile: it reaches the page only through
// textContent, attribute setters or the sandboxed report iframe; no string is ever parsed as markup here.
"use strict";

(() => {
  const KEY_STORAGE = "onnxforge.apiKey";
  const POLL_MS = 2000;
  const PAGE_SIZE = 20;
  const TERMINAL = new Set(["succeeded", "failed", "canceled"]);
  const STATES = new Set(["queued", "running", "succeeded", "failed", "canceled"]);
  // report.html's own policy (app/api/jobs.py REPORT_HTML_HEADERS), carried into the srcdoc iframe.
  const REPORT_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:";

  const $ = (id) => document.getElementById(id);
  let jobsOffset = 0;
  let jobsInFlight = false;
  let jobsShown = ""; // the last list rendered: unchanged lists are not redrawn (keeps selections and focus)
  let jobPoll = null;
  let catalogue = null;

  // ------------------------------------------------------------------------------------------ helpers

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props || {})) {
      if (value === null || value === undefined) continue;
      if (name === "className") node.className = value;
      else if (name === "text") node.textContent = value;
      else node.setAttribute(name, String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function getKey() {
    return sessionStorage.getItem(KEY_STORAGE) || "";
  }

  function authHeaders() {
    const key = getKey();
    return key ? { Authorization: "Bearer " + key } : {};
  }

  function banner(message) {
    const node = $("banner");
    node.textContent = message || "";
    node.hidden = !message;
  }

  class ApiError extends Error {
    constructor(status, code, detail) {
      super(detail);
      this.status = status;
      this.code = code;
      this.detail = detail;
    }
  }

  async function problemOf(response) {
    let body = {};
    try {
      body = await response.json();
    } catch (_) {
      body = {};
    }
    if (!body || typeof body !== "object") body = {};
    const code = typeof body.code === "string" ? body.code : "HTTP_" + response.status;
    const detail = typeof body.detail === "string" ? body.detail : response.statusText || "request failed";
    return new ApiError(response.status, code, detail);
  }

  function explain(error) {
    if (error instanceof ApiError) {
      if (error.status === 401) {
        banner("The server needs an API key: enter your team's key above (" + error.detail + ").");
      }
      return error.code + ": " + error.detail;
    }
    return String(error && error.message ? error.message : error);
  }

  async function api(path, options = {}) {
    const response = await fetch(path, {
      ...options,
      headers: { Accept: "application/json", ...authHeaders(), ...(options.headers || {}) },
      credentials: "omit",
      cache: "no-store",
    });
    if (!response.ok) throw await problemOf(response);
    return response;
  }

  function fmtSeconds(value) {
    return typeof value === "number" ? value.toFixed(1) : "";
  }

  function fmtValue(value) {
    if (typeof value === "number" && !Number.isInteger(value)) return String(Number(value.toPrecision(4)));
    if (value !== null && typeof value === "object") return JSON.stringify(value);
    return String(value);
  }

  function fmtTime(iso) {
    const date = new Date(iso);
    return isNaN(date) ? "" : date.toLocaleString();
  }

  function fmtBytes(n) {
    if (typeof n !== "number") return "";
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) {
      n /= 1024;
      i += 1;
    }
    return n.toFixed(i ? 1 : 0) + " " + units[i];
  }

  function jobPath(id, suffix = "") {
    return "/v1/jobs/" + encodeURIComponent(id) + suffix;
  }

  function filenameFrom(response, fallback) {
    const header = response.headers.get("Content-Disposition") || "";
    const star = /filename\*=UTF-8''([^;]+)/i.exec(header);
    if (star) {
      try {
        return decodeURIComponent(star[1]);
      } catch (_) {
        /* fall through */
      }
    }
    const plain = /filename="?([^";]+)"?/i.exec(header);
    return plain ? plain[1] : fallback;
  }

  // With a key the browser cannot send it on a plain link, so the file is fetched and handed over as a blob.
  async function downloadWithKey(path, fallbackName) {
    const response = await api(path, { headers: { Accept: "*/*" } });
    const blob = await response.blob();
    const url = URL.createObjectURL(blob);
    const link = el("a", { href: url, download: filenameFrom(response, fallbackName) });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  }

  function downloadLink(path, label, fallbackName) {
    const link = el("a", { href: path, download: "", className: "download" }, label);
    link.addEventListener("click", (event) => {
      if (!getKey()) return; // open mode: the browser streams the file itself
      event.preventDefault();
      downloadWithKey(path, fallbackName).catch((error) => banner(explain(error)));
    });
    return link;
  }

  // ------------------------------------------------------------------------------------------ API key

  function showKeyState() {
    $("key-state").textContent = getKey() ? "key set for this tab" : "no key (open mode)";
    $("api-key").value = "";
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("api-key").value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    showKeyState();
    banner("");
    loadCatalogue();
    route();
  });

  $("key-clear").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    showKeyState();
    route();
  });

  // ---------------------------------------------------------------------------------------- catalogue

  async function loadCatalogue() {
    try {
      catalogue = await (await api("/v1/passes")).json();
    } catch (error) {
      $("preset-summary").textContent = explain(error);
      return;
    }
    const select = $("preset");
    const previous = select.value;
    select.replaceChildren(el("option", { value: "" }, "(server default)"));
    for (const preset of catalogue.presets || []) {
      select.append(el("option", { value: preset.name }, preset.name));
    }
    select.value = previous;
    showPresetSummary();

    const list = $("pass-list");
    const text = el("input", {
      id: "pass-names",
      type: "text",
      size: 80,
      spellcheck: "false",
      placeholder: "pass names, comma-separated, run in this order",
    });
    // Options travel as {"name": ..., "options": {...}} entries, the same JSON as the API and the CLI's
    // --config; the server validates them against each pass's schema and answers 422 naming the option.
    const options = el("textarea", {
      id: "pass-options",
      rows: 4,
      cols: 80,
      spellcheck: "false",
      placeholder: 'options per pass, a JSON object: {"constant_folding": {"max_output_bytes": 4096}}',
    });
    const help = el("div", { id: "pass-options-help", className: "muted" });
    const buttons = el("div", { className: "pass-buttons" });
    for (const info of catalogue.passes || []) {
      const add = el("button", { type: "button", title: info.summary || "" }, "+ " + info.name);
      add.addEventListener("click", () => {
        text.value = text.value.trim() ? text.value.replace(/\s*,?\s*$/, ", ") + info.name : info.name;
        help.replaceChildren(...describeOptions(info));
      });
      buttons.append(el("label", {}, add, " ", el("span", { className: "muted" }, info.summary || "")));
    }
    list.replaceChildren(text, options, help, buttons);
  }

  // One line per option of a pass, from its JSON schema: name, required or default, description.
  function describeOptions(info) {
    const schema = info.options_schema || {};
    const props = schema.properties || {};
    const required = new Set(schema.required || []);
    const names = Object.keys(props);
    if (!names.length) return [el("div", {}, info.name + " takes no options.")];
    const lines = [el("div", {}, "Options of " + info.name + ":")];
    for (const name of names) {
      const prop = props[name] || {};
      const state = required.has(name)
        ? "required"
        : "default " + JSON.stringify(prop.default === undefined ? null : prop.default);
      lines.push(el("div", {}, "  " + name + " (" + state + ")" + (prop.description ? ": " + prop.description : "")));
    }
    return lines;
  }

  // The explicit list as API entries: a bare name, or {"name", "options"} where options were given.
  function passEntries(names) {
    const raw = (($("pass-options") || {}).value || "").trim();
    if (!raw) return names;
    let byName;
    try {
      byName = JSON.parse(raw);
    } catch (error) {
      throw new Error("Pass options are not valid JSON: " + error.message);
    }
    if (byName === null || typeof byName !== "object" || Array.isArray(byName)) {
      throw new Error('Pass options must be a JSON object of pass name to options, e.g. {"prepost": {...}}.');
    }
    for (const [name, value] of Object.entries(byName)) {
      if (!names.includes(name)) throw new Error("Options given for " + name + ", which is not in the list.");
      if (value === null || typeof value !== "object" || Array.isArray(value)) {
        throw new Error("The options of " + name + " must be a JSON object.");
      }
    }
    return names.map((name) => (name in byName ? { name: name, options: byName[name] } : name));
  }

  function showPresetSummary() {
    const name = $("preset").value;
    const preset = ((catalogue && catalogue.presets) || []).find((p) => p.name === name);
    $("preset-summary").textContent = preset ? preset.summary + " Passes: " + preset.passes.join(", ") : "";
  }

  $("preset").addEventListener("change", showPresetSummary);
  for (const radio of document.querySelectorAll("input[name=pass-mode]")) {
    radio.addEventListener("change", () => {
      $("pass-list").hidden = !$("mode-explicit").checked;
    });
  }

  // ------------------------------------------------------------------------------------------- upload

  const modelInput = $("model-file");
  const dropzone = $("dropzone");

  function showChosenModel() {
    const file = modelInput.files[0];
    $("model-chosen").textContent = file ? file.name + " (" + fmtBytes(file.size) + ")" : "No model chosen.";
  }

  modelInput.addEventListener("change", showChosenModel);
  dropzone.addEventListener("dragover", (event) => {
    event.preventDefault();
    dropzone.classList.add("over");
  });
  dropzone.addEventListener("dragleave", () => dropzone.classList.remove("over"));
  dropzone.addEventListener("drop", (event) => {
    event.preventDefault();
    dropzone.classList.remove("over");
    if (event.dataTransfer && event.dataTransfer.files.length) {
      modelInput.files = event.dataTransfer.files;
      showChosenModel();
    }
  });

  function numberField(id) {
    const raw = $(id).value.trim();
    return raw === "" ? undefined : Number(raw);
  }

  function buildConfig() {
    const config = { target: $("target").value };
    if ($("mode-explicit").checked) {
      const names = (($("pass-names") || {}).value || "")
        .split(",")
        .map((s) => s.trim())
        .filter(Boolean);
      if (!names.length) throw new Error("Name at least one pass, or choose a preset.");
      config.passes = passEntries(names);
    } else if ($("preset").value) {
      config.preset = $("preset").value;
    }
    const tolerance = {};
    for (const [id, key] of [["tol-atol", "atol"], ["tol-rtol", "rtol"], ["tol-cos", "min_cosine"]]) {
      const value = numberField(id);
      if (value !== undefined) {
        if (!Number.isFinite(value)) throw new Error(key + " must be a number.");
        tolerance[key] = value;
      }
    }
    if (Object.keys(tolerance).length) config.tolerance = tolerance;
    if ($("fail-on-regression").checked) config.fail_on_regression = true;
    if ($("rollback-slower").value) config.rollback_slower = $("rollback-slower").value === "true";
    return config;
  }

  $("upload-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const status = $("upload-status");
    const model = modelInput.files[0];
    if (!model) {
      status.textContent = "Choose or drop a model first.";
      return;
    }
    let config;
    try {
      config = buildConfig();
    } catch (error) {
      status.textContent = error.message;
      return;
    }
    const form = new FormData();
    form.append("model", model, model.name);
    const samples = $("samples-file").files[0];
    if (samples) form.append("samples", samples, samples.name);
    form.append("config", JSON.stringify(config));

    // XMLHttpRequest rather than fetch: it reports upload progress.
    const xhr = new XMLHttpRequest();
    const bar = $("upload-progress");
    xhr.open("POST", "/v1/jobs");
    for (const [name, value] of Object.entries(authHeaders())) xhr.setRequestHeader(name, value);
    xhr.setRequestHeader("Accept", "application/json");
    xhr.upload.addEventListener("progress", (e) => {
      if (e.lengthComputable) bar.value = e.loaded / e.total;
    });
    xhr.addEventListener("load", () => {
      bar.hidden = true;
      $("submit").disabled = false;
      let body = {};
      try {
        body = JSON.parse(xhr.responseText);
      } catch (_) {
        body = {};
      }
      if (xhr.status === 202 && body && typeof body.id === "string") {
        status.textContent = "Submitted job " + body.id + ".";
        refreshJobs();
      } else {
        const error = new ApiError(
          xhr.status,
          body && typeof body.code === "string" ? body.code : "HTTP_" + xhr.status,
          body && typeof body.detail === "string" ? body.detail : xhr.statusText || "upload failed",
        );
        status.textContent = "Refused: " + explain(error);
      }
    });
    xhr.addEventListener("error", () => {
      bar.hidden = true;
      $("submit").disabled = false;
      status.textContent = "Upload failed: the server could not be reached.";
    });
    bar.value = 0;
    bar.hidden = false;
    $("submit").disabled = true;
    status.textContent = "Uploading " + model.name + "…";
    xhr.send(form);
  });

  // ----------------------------------------------------------------------------------------- job list

  function stateCell(state) {
    const span = el("span", { className: "state" }, state);
    if (STATES.has(state)) span.classList.add("state-" + state);
    return span;
  }

  function progressCell(job) {
    const value = job.state === "succeeded" ? 1 : Math.max(0, Math.min(1, Number(job.progress) || 0));
    return el(
      "span",
      {},
      el("progress", { max: 1, value: value }),
      " " + Math.round(value * 100) + "%",
    );
  }

  function jobRow(job) {
    const id = String(job.id);
    const actions = el("td", {}, el("a", { href: "#/jobs/" + encodeURIComponent(id), className: "report-link" }, "report"));
    if (job.state === "succeeded") {
      actions.append(" · ", downloadLink(jobPath(id, "/artifact"), "artifact", "model.optimized.onnx"));
    }
    const error = job.error ? el("div", { className: "error" }, job.error.code + ": " + job.error.message) : null;
    const speedup = job.summary && typeof job.summary.speedup === "number" ? job.summary.speedup.toFixed(2) + "×" : "";
    return el(
      "tr",
      { "data-job-id": id, "data-state": job.state },
      el("td", {}, fmtTime(job.created_at)),
      el("td", {}, (job.model && job.model.filename) || "", el("div", { className: "muted" }, fmtBytes(job.model && job.model.size))),
      el("td", {}, stateCell(String(job.state)), error),
      el("td", {}, job.stage || ""),
      el("td", {}, progressCell(job)),
      el("td", { className: "num" }, fmtSeconds(job.durations && job.durations.queued_seconds)),
      el("td", { className: "num" }, fmtSeconds(job.durations && job.durations.run_seconds)),
      el("td", { className: "num" }, speedup),
      actions,
    );
  }

  async function refreshJobs() {
    if (jobsInFlight || $("page-jobs").hidden) return;
    jobsInFlight = true;
    try {
      const text = await (await api("/v1/jobs?limit=" + PAGE_SIZE + "&offset=" + jobsOffset)).text();
      $("jobs-updated").textContent = "Last update " + new Date().toLocaleTimeString() + ".";
      banner("");
      if (text === jobsShown) return;
      jobsShown = text;
      const list = JSON.parse(text);
      const rows = (list.jobs || []).map(jobRow);
      $("jobs-body").replaceChildren(
        ...(rows.length ? rows : [el("tr", {}, el("td", { colspan: 9, className: "muted" }, "No jobs yet."))]),
      );
      $("jobs-total").textContent = "(" + list.total + ")";
      $("jobs-prev").disabled = jobsOffset === 0;
      $("jobs-next").disabled = !list.next;
    } catch (error) {
      $("jobs-updated").textContent = "Update failed: " + explain(error);
    } finally {
      jobsInFlight = false;
    }
  }

  $("jobs-prev").addEventListener("click", () => {
    jobsOffset = Math.max(0, jobsOffset - PAGE_SIZE);
    refreshJobs();
  });
  $("jobs-next").addEventListener("click", () => {
    jobsOffset += PAGE_SIZE;
    refreshJobs();
  });

  // ------------------------------------------------------------------------------------------ job page

  function fact(list, name, value) {
    list.append(el("dt", {}, name), el("dd", {}, value));
  }

  function showJob(job) {
    const facts = $("job-facts");
    facts.replaceChildren();
    fact(facts, "state", stateCell(String(job.state)));
    fact(facts, "stage", job.stage || "-");
    fact(facts, "progress", progressCell(job));
    fact(facts, "model", ((job.model && job.model.filename) || "") + " (" + fmtBytes(job.model && job.model.size) + ")");
    fact(facts, "model sha256", (job.model && job.model.sha256) || "");
    fact(facts, "queue", job.queue || "");
    fact(facts, "attempts", String(job.attempts));
    fact(facts, "created", fmtTime(job.created_at));
    fact(facts, "queued / run / total s", [job.durations.queued_seconds, job.durations.run_seconds, job.durations.total_seconds].map(fmtSeconds).join(" / "));
    fact(facts, "config", el("code", { className: "wrap" }, JSON.stringify(job.config)));
    if (job.error) {
      const where = job.error.pass ? " (pass " + job.error.pass + ")" : "";
      fact(facts, "error", el("span", { className: "error" }, job.error.code + ": " + job.error.message + where));
    }
    if (job.summary) {
      for (const [key, value] of Object.entries(job.summary)) fact(facts, key, fmtValue(value));
    }
    const done = job.state === "succeeded";
    const artifact = $("artifact-link");
    artifact.hidden = !done;
    artifact.setAttribute("href", jobPath(job.id, "/artifact"));
    artifact.setAttribute("download", "");
    $("report-json").hidden = !done;
    $("report-html-download").hidden = !done;
    $("cancel-job").hidden = TERMINAL.has(job.state);
  }

  async function showReport(id) {
    const html = await (await api(jobPath(id, "/report.html"), { headers: { Accept: "text/html" } })).text();
    // The frame is sandboxed (no script, opaque origin) and srcdoc inherits the console's CSP; the meta
    // element adds report.html's own stricter policy on top.
    const meta = '<meta http-equiv="Content-Security-Policy" content="' + REPORT_CSP + '">';
    const withPolicy = /<head[^>]*>/i.test(html) ? html.replace(/<head[^>]*>/i, (m) => m + meta) : meta + html;
    const frame = $("report-frame");
    frame.srcdoc = withPolicy;
    frame.hidden = false;
  }

  async function loadJob(id, reportShown) {
    try {
      const job = await (await api(jobPath(id))).json();
      if (location.hash !== "#/jobs/" + encodeURIComponent(id)) return;
      showJob(job);
      $("job-status").textContent = "";
      if (job.state === "succeeded" && !reportShown) {
        await showReport(id);
        reportShown = true;
      }
      if (!TERMINAL.has(job.state)) jobPoll = setTimeout(() => loadJob(id, reportShown), POLL_MS);
    } catch (error) {
      $("job-status").textContent = explain(error);
    }
  }

  function currentJobId() {
    const match = /^#\/jobs\/([^/]+)$/.exec(location.hash);
    return match ? decodeURIComponent(match[1]) : null;
  }

  $("artifact-link").addEventListener("click", (event) => {
    if (!getKey()) return;
    event.preventDefault();
    downloadWithKey(jobPath(currentJobId(), "/artifact"), "model.optimized.onnx").catch((e) => banner(explain(e)));
  });
  $("report-json").addEventListener("click", () => {
    downloadWithKey(jobPath(currentJobId(), "/report"), "report.json").catch((e) => banner(explain(e)));
  });
  $("report-html-download").addEventListener("click", () => {
    downloadWithKey(jobPath(currentJobId(), "/report.html"), "report.html").catch((e) => banner(explain(e)));
  });
  $("cancel-job").addEventListener("click", async () => {
    const id = currentJobId();
    try {
      // POST /cancel stops the job and keeps it; DELETE would remove the job and its files.
      showJob(await (await api(jobPath(id, "/cancel"), { method: "POST" })).json());
    } catch (error) {
      $("job-status").textContent = explain(error);
    }
  });

  // --------------------------------------------------------------------------------------------- route

  function route() {
    jobsShown = "";
    if (jobPoll) clearTimeout(jobPoll);
    jobPoll = null;
    const id = currentJobId();
    $("page-jobs").hidden = id !== null;
    $("page-job").hidden = id === null;
    if (id === null) {
      refreshJobs();
      return;
    }
    $("job-id").textContent = id;
    $("job-facts").replaceChildren();
    const frame = $("report-frame");
    frame.hidden = true;
    frame.removeAttribute("srcdoc");
    for (const name of ["artifact-link", "report-json", "report-html-download", "cancel-job"]) $(name).hidden = true;
    loadJob(id, false);
  }

  window.addEventListener("hashchange", route);
  setInterval(() => {
    if (!document.hidden) refreshJobs();
  }, POLL_MS);
  showKeyState();
  loadCatalogue();
  route();
})();
