// Quern's dashboard: polls GET /dashboard/state once a second and draws it.
// The state carries the metrics registry as Prometheus text (what /metrics
// serves); rates and percentiles are computed here from its counters and
// histogram buckets, percentiles as Prometheus' histogram_quantile does.
// Text from the server is only ever set as textContent.
"use strict";

(() => {
  const POLL_MS = 1000;
  const HISTORY_S = 70;  // snapshots kept: the longest window plus a margin
  const RATE_S = 5;      // requests/s over about this long

  const $ = (id) => document.getElementById(id);
  let apiKey = sessionStorage.getItem("quern-key") || "";
  let history = [];      // {t: server seconds, samples}, oldest first
  let state = null;      // the last /dashboard/state
  let selected = null;   // "model\u0000version" whose details are open
  let polling = false;

  // --- Prometheus text ---

  function parseValue(text) {
    if (text === "+Inf") return Infinity;
    if (text === "-Inf") return -Infinity;
    return Number(text);
  }

  // [{name, labels: {k: v}, value}] from exposition text.
  function parseMetrics(text) {
    const samples = [];
    for (const line of text.split("\n")) {
      if (line === "" || line[0] === "#") continue;
      let i = 0;
      while (i < line.length && line[i] !== "{" && line[i] !== " ") i++;
      const name = line.slice(0, i);
      const labels = {};
      if (line[i] === "{") {
        i++;
        while (i < line.length && line[i] !== "}") {
          const eq = line.indexOf("=\"", i);
          if (eq < 0) break;
          const label = line.slice(i, eq);
          i = eq + 2;
          let value = "";
          while (i < line.length && line[i] !== "\"") {
            if (line[i] === "\\" && i + 1 < line.length) {
              value += line[i + 1] === "n" ? "\n" : line[i + 1];
              i += 2;
            } else {
              value += line[i++];
            }
          }
          labels[label] = value;
          i++;  // the closing quote
          if (line[i] === ",") i++;
        }
        i++;  // the closing brace
      }
      samples.push({name, labels, value: parseValue(line.slice(i).trim())});
    }
    return samples;
  }

  function matches(labels, want) {
    for (const k in want) {
      if (labels[k] !== want[k]) return false;
    }
    return true;
  }

  // The sum of the samples of `name` whose labels include `want`; null when
  // there is none.
  function total(samples, name, want = {}) {
    let sum = null;
    for (const s of samples) {
      if (s.name === name && matches(s.labels, want)) sum = (sum || 0) + s.value;
    }
    return sum;
  }

  function has(samples, name) {
    return samples.some((s) => s.name === name);
  }

  // {bounds: [finite upper bounds], counts: [cumulative, +Inf last], sum}
  // of histogram `name` (one series: `want` names it), or null.
  function histogram(samples, name, want) {
    const buckets = [];
    let sum = 0;
    for (const s of samples) {
      if (!matches(s.labels, want)) continue;
      if (s.name === name + "_bucket") buckets.push([parseValue(s.labels.le), s.value]);
      if (s.name === name + "_sum") sum = s.value;
    }
    if (buckets.length === 0) return null;
    buckets.sort((a, b) => a[0] - b[0]);
    return {bounds: buckets.slice(0, -1).map((b) => b[0]), counts: buckets.map((b) => b[1]), sum};
  }

  // `now` less `before` (null: nothing to take away).
  function histogramDelta(now, before) {
    if (!now || !before || before.counts.length !== now.counts.length) return now;
    return {
      bounds: now.bounds,
      counts: now.counts.map((c, i) => c - before.counts[i]),
      sum: now.sum - before.sum,
    };
  }

  // Prometheus' histogram_quantile: linear within the bucket the rank falls
  // in; the highest finite bound when it falls in +Inf. NaN with no
  // observations.
  function quantile(q, h) {
    if (!h) return NaN;
    const n = h.counts[h.counts.length - 1];
    if (!(n > 0)) return NaN;
    const rank = q * n;
    let b = 0;
    while (b < h.bounds.length && h.counts[b] < rank) b++;
    if (b === h.bounds.length) return h.bounds[h.bounds.length - 1];
    const upper = h.bounds[b];
    if (b === 0 && upper <= 0) return upper;
    const lower = b === 0 ? 0 : h.bounds[b - 1];
    const below = b === 0 ? 0 : h.counts[b - 1];
    const inBucket = h.counts[b] - below;
    return lower + (upper - lower) * ((rank - below) / inBucket);
  }

  // --- formatting ---

  function fmtMicros(us) {
    if (!Number.isFinite(us)) return "–";
    if (us < 1000) return us.toFixed(0) + " µs";
    if (us < 10000) return (us / 1000).toFixed(2) + " ms";
    if (us < 1e6) return (us / 1000).toFixed(1) + " ms";
    return (us / 1e6).toFixed(2) + " s";
  }

  function fmtCount(n) {
    if (n === null || !Number.isFinite(n)) return "–";
    return Math.round(n).toLocaleString("en-US");
  }

  function fmtRate(r) {
    if (r === null || !Number.isFinite(r)) return "–";
    return r < 10 ? r.toFixed(1) : r.toFixed(0);
  }

  function fmtBytes(b) {
    if (b === null || !Number.isFinite(b)) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (b >= 1024 && i < units.length - 1) {
      b /= 1024;
      i++;
    }
    return (i === 0 ? b.toFixed(0) : b.toFixed(1)) + " " + units[i];
  }

  function fmtDuration(s) {
    if (!Number.isFinite(s) || s < 0) return "–";
    const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600), m = Math.floor((s % 3600) / 60);
    if (d > 0) return d + "d " + h + "h";
    if (h > 0) return h + "h " + m + "m";
    if (m > 0) return m + "m " + Math.floor(s % 60) + "s";
    return Math.floor(s) + "s";
  }

  // --- DOM helpers ---

  function el(tag, props = {}, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(props)) {
      if (k === "class") e.className = v;
      else if (k === "data") for (const [dk, dv] of Object.entries(v)) e.dataset[dk] = String(dv);
      else if (k === "text") e.textContent = v;
      else e.setAttribute(k, v);
    }
    for (const c of children) e.append(c);
    return e;
  }

  // A cell showing `text`, carrying the raw value for scripts and tests.
  function cell(field, value, text) {
    return el("td", {data: {field, value: value === null ? "" : value}, text});
  }

  function pairCell(field, a, b, fmt) {
    return el("td", {data: {field, p50: a, p99: b}, text: fmt(a) + " / " + fmt(b)});
  }

  // --- snapshots and windows ---

  function latest() {
    return history[history.length - 1];
  }

  // The snapshot a window of `seconds` starts at: the oldest one not older
  // than that (null: all time).
  function windowStart(seconds) {
    if (seconds <= 0) return null;
    const now = latest().t;
    for (const snap of history) {
      if (snap.t >= now - seconds - 0.5) return snap === latest() ? null : snap;
    }
    return null;
  }

  // Per second between the snapshot about RATE_S ago and now.
  function rate(name, want) {
    const now = latest();
    let before = null;
    for (let i = history.length - 2; i >= 0; i--) {
      before = history[i];
      if (now.t - before.t >= RATE_S) break;
    }
    if (!before) return null;
    const a = total(now.samples, name, want), b = total(before.samples, name, want);
    if (a === null || b === null || now.t <= before.t) return null;
    return Math.max(0, a - b) / (now.t - before.t);
  }

  function windowed(name, want, start) {
    const h = histogram(latest().samples, name, want);
    return start ? histogramDelta(h, histogram(start.samples, name, want)) : h;
  }

  // --- the status page ---

  function modelKey(m) {
    return m.name + "\u0000" + m.version;
  }

  function drawCards(snap) {
    const s = snap.samples;
    const started = total(s, "process_start_time_seconds");
    $("uptime").textContent = started === null ? "–" : fmtDuration(snap.t - started);
    const cpu = rate("process_cpu_seconds_total", {});
    $("cpu").textContent = cpu === null ? "–" : (cpu * 100).toFixed(1) + " %";
    $("memory").textContent = fmtBytes(total(s, "process_resident_memory_bytes"));
    const ok = rate("quern_request_success_total", {}), failed = rate("quern_request_failure_total", {});
    $("rate").textContent = ok === null ? "–" : fmtRate(ok + (failed || 0));
    $("queued").textContent = fmtCount(total(s, "quern_pending_requests") || 0);
  }

  function layout(m) {
    if (m.platform === "ensemble") return "ensemble, " + m.steps + " steps";
    const parts = [m.platform || "?"];
    if (m.state === "READY") {
      parts.push(m.instances + (m.instances === 1 ? " instance" : " instances"));
      if (m.max_batch_size > 0) parts.push("batch ≤ " + m.max_batch_size);
    }
    if (m.vision) parts.push(m.vision.task);
    return parts.join(", ");
  }

  function drawModels(start) {
    const s = latest().samples;
    const body = $("models").tBodies[0];
    const rows = [];
    for (const m of state.models) {
      const want = {model: m.name, version: String(m.version)};
      const ok = total(s, "quern_request_success_total", want);
      const failed = total(s, "quern_request_failure_total", want);
      const requests = ok === null ? null : ok + (failed || 0);
      const okRate = rate("quern_request_success_total", want);
      const failRate = rate("quern_request_failure_total", want);
      const req = windowed("quern_request_duration_us", want, start);
      const queue = windowed("quern_queue_duration_us", want, start);
      const infer = windowed("quern_compute_infer_duration_us", want, start);
      const row = el("tr", {class: "model", data: {model: m.name, version: m.version}, title: "details"},
          el("td", {text: m.name + " v" + m.version}),
          el("td", {}, el("span", {class: "state " + m.state, data: {field: "state"}, text: m.state})),
          el("td", {class: "muted", data: {field: "layout"}, text: layout(m)}),
          cell("requests", requests, fmtCount(requests)),
          cell("errors", failed, fmtCount(failed)),
          cell("rate", okRate === null ? null : okRate + (failRate || 0),
               okRate === null ? "–" : fmtRate(okRate + (failRate || 0))),
          pairCell("total", quantile(0.5, req), quantile(0.99, req), fmtMicros),
          pairCell("queue", quantile(0.5, queue), quantile(0.99, queue), fmtMicros),
          pairCell("infer", quantile(0.5, infer), quantile(0.99, infer), fmtMicros),
          cell("queued", total(s, "quern_pending_requests", want), fmtCount(total(s, "quern_pending_requests", want))),
          cell("batch_limit", total(s, "quern_batch_size_limit", want),
               fmtCount(total(s, "quern_batch_size_limit", want))));
      row.addEventListener("click", () => {
        selected = selected === modelKey(m) ? null : modelKey(m);
        draw();
      });
      rows.push(row);
      if (m.reason) {
        rows.push(el("tr", {class: "reason", data: {model: m.name, version: m.version}},
            el("td", {colspan: "11", data: {field: "reason"}, text: m.reason})));
      }
    }
    body.replaceChildren(...rows);
    $("no-models").hidden = state.models.length > 0;
  }

  function batchBars(h) {
    const box = el("div", {class: "bars", data: {field: "batch_sizes"}});
    if (!h || !(h.counts[h.counts.length - 1] > 0)) {
      box.append(el("span", {class: "muted", text: "no batches yet"}));
      return box;
    }
    const per = h.counts.map((c, i) => c - (i > 0 ? h.counts[i - 1] : 0));
    const most = Math.max(...per);
    per.forEach((n, i) => {
      if (n === 0) return;
      const low = i === 0 ? 1 : h.bounds[i - 1] + 1;
      const label = i === h.bounds.length ? "> " + h.bounds[i - 1]
          : low === h.bounds[i] ? String(low) : low + "–" + h.bounds[i];
      const bar = el("div", {class: "bar"});
      bar.style.width = (100 * n / most) + "%";
      box.append(el("span", {text: label}), bar, el("span", {data: {bucket: label, count: n}, text: fmtCount(n)}));
    });
    return box;
  }

  function drawDetails(start) {
    const box = $("details");
    const m = state.models.find((x) => modelKey(x) === selected);
    if (!m) {
      selected = null;
      box.replaceChildren();
      return;
    }
    const s = latest().samples;
    const want = {model: m.name, version: String(m.version)};
    const detail = el("div", {class: "detail", data: {model: m.name, version: m.version}},
        el("h2", {text: m.name + " v" + m.version}));
    const grid = el("div", {class: "detail-grid"});
    const failures = el("tbody");
    for (const reason of ["rejected", "cancelled", "timeout", "invalid", "backend"]) {
      const n = total(s, "quern_request_failure_total", {...want, reason});
      const r = rate("quern_request_failure_total", {...want, reason});
      failures.append(el("tr", {}, el("td", {text: reason}), cell("failure_" + reason, n, fmtCount(n)),
          cell("failure_rate_" + reason, r, r === null ? "–" : fmtRate(r) + "/s")));
    }
    grid.append(el("div", {}, el("h3", {text: "Failures by reason: all time, per second now"}),
                   el("table", {}, failures)));
    grid.append(el("div", {}, el("h3", {text: "Batch sizes"}), batchBars(windowed("quern_batch_size", want, start))));
    const stages = el("tbody");
    for (const stage of ["decode", "resize", "queue", "infer", "post"]) {
      const h = windowed("quern_vision_stage_duration_us", {model: m.name, stage}, start);
      if (!h) continue;
      const n = h.counts[h.counts.length - 1];
      stages.append(el("tr", {}, el("td", {text: stage}),
          pairCell("stage_" + stage, quantile(0.5, h), quantile(0.99, h), fmtMicros),
          el("td", {class: "muted", text: n > 0 ? "mean " + fmtMicros(h.sum / n) : ""})));
    }
    if (stages.rows.length > 0) {
      grid.append(el("div", {}, el("h3", {text: "Vision stages, p50 / p99"}), el("table", {}, stages)));
    }
    detail.append(grid);
    box.replaceChildren(detail);
  }

  // Vision pipeline, jobs, streams and Redis: what this server runs.
  function drawServices() {
    const s = latest().samples;
    const panels = [];
    const panel = (title, rows) => {
      const body = el("tbody");
      for (const [name, field, value, fmt] of rows) {
        if (value === null) continue;
        body.append(el("tr", {}, el("td", {text: name}), cell(field, value, (fmt || fmtCount)(value))));
      }
      if (body.rows.length > 0) panels.push(el("div", {class: "detail"}, el("h2", {text: title}), el("table", {}, body)));
    };
    if (has(s, "quern_vision_requests_total")) {
      panel("Vision pipeline", [
        ["images admitted", "vision_requests", total(s, "quern_vision_requests_total")],
        ["refused (busy)", "vision_rejected", total(s, "quern_vision_rejected_overload_total")],
        ["dropped", "vision_dropped", total(s, "quern_vision_dropped_total")],
        ["failed", "vision_failed", total(s, "quern_vision_failed_total")],
        ["in flight", "vision_in_flight", total(s, "quern_vision_in_flight")],
        ["capacity", "vision_capacity", total(s, "quern_vision_queue_capacity")],
      ]);
    }
    if (has(s, "quern_jobs_submitted_total")) {
      panel("Jobs", [
        ["submitted", "jobs_submitted", total(s, "quern_jobs_submitted_total")],
        ["refused", "jobs_rejected", total(s, "quern_jobs_rejected_total")],
        ["pending", "jobs_pending", total(s, "quern_jobs_pending")],
        ["done", "jobs_done", total(s, "quern_jobs_finished_total", {status: "done"})],
        ["failed", "jobs_failed", total(s, "quern_jobs_finished_total", {status: "failed"})],
        ["cancelled", "jobs_cancelled", total(s, "quern_jobs_finished_total", {status: "cancelled"})],
      ]);
    }
    if (has(s, "quern_stream_connected")) {
      const rows = [["connected", "stream_connected", total(s, "quern_stream_connected")],
                    ["in flight", "stream_inflight", total(s, "quern_stream_inflight")]];
      for (const outcome of ["taken", "reclaimed", "done", "failed", "dead", "retried"]) {
        rows.push([outcome, "stream_" + outcome, total(s, "quern_stream_entries_total", {outcome})]);
      }
      panel("Redis streams", rows);
    }
    if (has(s, "quern_redis_connected")) {
      panel("Redis results", [
        ["connected", "redis_connected", total(s, "quern_redis_connected")],
        ["results written", "redis_written", total(s, "quern_redis_results_written_total")],
        ["write errors", "redis_errors", total(s, "quern_redis_write_errors_total")],
        ["backlog", "redis_backlog", total(s, "quern_redis_backlog")],
        ["backlog bytes", "redis_backlog_bytes", total(s, "quern_redis_backlog_bytes"), fmtBytes],
      ]);
    }
    $("services").replaceChildren(...panels);
  }

  function drawTryModels() {
    const select = $("try-model");
    const current = select.value;
    const usable = state.models.filter((m) => m.state === "READY" && m.vision &&
                                              (m.vision.task === "detection" || m.vision.task === "classification"));
    const names = [...new Set(usable.map((m) => m.name))];
    const same = names.length === select.options.length && names.every((n, i) => select.options[i].value === n);
    if (!same) {
      select.replaceChildren(...names.map((n) => {
        const m = usable.find((x) => x.name === n);
        return el("option", {value: n, text: n + " (" + m.vision.task + ")"});
      }));
      if (names.includes(current)) select.value = current;
    }
    $("try-none").hidden = names.length > 0;
    $("try-run").disabled = names.length === 0;
  }

  function draw() {
    if (!state || history.length === 0) return;
    const seconds = Number($("window").value);
    const start = windowStart(seconds);
    const span = history.length > 1 ? latest().t - history[0].t : 0;
    $("window-note").textContent = seconds > 0 && span < seconds ? "(since this page opened)" : "";
    $("version").textContent = "v" + state.version;
    drawCards(latest());
    drawModels(start);
    drawDetails(start);
    drawServices();
    drawTryModels();
  }

  // --- polling ---

  function authHeaders() {
    return apiKey ? {"Authorization": "Bearer " + apiKey} : {};
  }

  function setLive(on, text) {
    $("live").classList.toggle("off", !on);
    $("live").textContent = text;
  }

  async function poll() {
    if (document.visibilityState === "hidden") {
      polling = false;  // resumed by visibilitychange
      return;
    }
    let next = POLL_MS;
    try {
      const resp = await fetch("/dashboard/state", {headers: authHeaders(), cache: "no-store"});
      if (resp.status === 401 || resp.status === 403) {
        const body = await resp.json().catch(() => ({}));
        $("key-form").hidden = false;
        $("key-error").textContent = apiKey ? (body.error || "the key was refused") : "";
        setLive(false, "key needed");
        polling = false;
        return;  // resumed when a key is given
      }
      if (!resp.ok) throw new Error("HTTP " + resp.status);
      state = await resp.json();
      $("key-form").hidden = true;
      history.push({t: state.now_s, samples: parseMetrics(state.metrics)});
      while (history.length > 2 && latest().t - history[0].t > HISTORY_S) history.shift();
      setLive(true, "live");
      draw();
    } catch (e) {
      setLive(false, "disconnected");
      next = 2 * POLL_MS;
    }
    setTimeout(poll, next);
  }

  function startPolling() {
    if (polling) return;
    polling = true;
    poll();
  }

  // --- the test page ---

  async function runTry(event) {
    event.preventDefault();
    const model = $("try-model").value;
    const file = $("try-image").files[0];
    $("try-error").textContent = "";
    if (!model) return;
    if (!file) {
      $("try-error").textContent = "Pick an image first.";
      return;
    }
    const m = state.models.find((x) => x.name === model && x.vision);
    $("try-run").disabled = true;
    try {
      const started = performance.now();
      let resp;
      if (m && m.vision.task === "classification") {
        // POST /predict/{model} {"image": "<data URL>"}
        const image = await new Promise((resolve, reject) => {
          const reader = new FileReader();
          reader.onload = () => resolve(reader.result);
          reader.onerror = () => reject(new Error("the file could not be read"));
          reader.readAsDataURL(file);
        });
        resp = await fetch("/predict/" + encodeURIComponent(model), {
          method: "POST",
          body: JSON.stringify({image}),
          headers: {...authHeaders(), "Content-Type": "application/json"},
        });
      } else {
        // CodeProject.AI's form: the image and the confidence threshold.
        const form = new FormData();
        form.append("image", file, file.name);
        form.append("min_confidence", $("try-confidence").value || "0.4");
        resp = await fetch("/v1/vision/custom/" + encodeURIComponent(model),
                           {method: "POST", body: form, headers: authHeaders()});
      }
      const answer = await resp.json();
      const roundTrip = performance.now() - started;
      // CodeProject.AI answers 200 with success false; /predict with an HTTP error.
      if (!resp.ok || answer.success === false) {
        throw new Error(answer.error || "the request failed (HTTP " + resp.status + ")");
      }
      const image = await createImageBitmap(file);
      // /predict answers its top classes whatever their confidence: the
      // page's threshold applies to them as the detection routes apply it.
      const threshold = Number($("try-confidence").value || "0.4");
      const predictions = (answer.predictions || []).filter((p) => !(p.confidence < threshold));
      drawAnswer(model, image, predictions);
      drawTimings(resp.headers.get("Server-Timing"), answer, roundTrip);
    } catch (e) {
      $("try-error").textContent = model + ": " + e.message;
    } finally {
      $("try-run").disabled = false;
    }
  }

  const COLORS = ["#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#9a6324"];

  function drawAnswer(model, image, predictions) {
    const canvas = $("try-canvas");
    const scale = Math.min(1, 960 / image.width);
    canvas.width = Math.round(image.width * scale);
    canvas.height = Math.round(image.height * scale);
    canvas.dataset.scale = String(scale);
    canvas.dataset.model = model;
    const ctx = canvas.getContext("2d");
    ctx.drawImage(image, 0, 0, canvas.width, canvas.height);
    const lineWidth = Math.max(2, Math.round(canvas.width / 300));
    const fontPx = Math.max(12, Math.round(canvas.width / 55));
    ctx.font = "bold " + fontPx + "px system-ui, sans-serif";
    ctx.textBaseline = "top";
    const rows = [];
    const labels = [];  // the label boxes drawn so far: a label never covers another
    const overlaps = (a, b) => a.x < b.x + b.w && b.x < a.x + a.w && a.y < b.y + b.h && b.y < a.y + a.h;
    predictions.forEach((p, i) => {
      const color = COLORS[i % COLORS.length];
      const boxed = [p.x_min, p.y_min, p.x_max, p.y_max].every(Number.isFinite);
      const text = p.label + " " + (100 * p.confidence).toFixed(0) + "%";
      let labelAt = "";
      if (boxed) {
        const x = p.x_min * scale, y = p.y_min * scale;
        const w = (p.x_max - p.x_min) * scale, h = (p.y_max - p.y_min) * scale;
        ctx.lineWidth = lineWidth;
        ctx.strokeStyle = color;
        ctx.strokeRect(x, y, w, h);
        const tw = ctx.measureText(text).width + 8, th = fontPx + 6;
        // Above the box, or inside it at its top when there is no room
        // (a box from the image's edge); moved down past labels already
        // there (boxes that share a corner, such as whole-image ones).
        const label = {x, y: y >= th ? y - th : y, w: tw, h: th};
        while (labels.some((o) => overlaps(o, label)) && label.y + 2 * th <= canvas.height) label.y += th;
        labels.push(label);
        labelAt = JSON.stringify([label.x, label.y, label.w, label.h]);
        const ty = label.y;
        ctx.fillStyle = color;
        ctx.fillRect(x, ty, tw, th);
        ctx.fillStyle = "#fff";
        ctx.fillText(text, x + 4, ty + 3);
      }
      const box = boxed ? [p.x_min, p.y_min, p.x_max, p.y_max].join(", ") : "–";
      const swatch = el("span", {class: "state", text: p.label});
      swatch.style.color = color;
      rows.push(el("tr", {data: {label: p.label, confidence: p.confidence, color, labelAt,
                                 box: boxed ? JSON.stringify([p.x_min, p.y_min, p.x_max, p.y_max]) : ""}},
          el("td", {}, swatch), el("td", {text: (100 * p.confidence).toFixed(1) + " %"}), el("td", {text: box})));
    });
    if (rows.length === 0) {
      rows.push(el("tr", {}, el("td", {colspan: "3", class: "muted", text: "nothing found above the confidence"})));
    }
    $("try-predictions").tBodies[0].replaceChildren(...rows);
  }

  function drawTimings(serverTiming, answer, roundTrip) {
    const rows = [];
    for (const part of (serverTiming || "").split(",")) {
      const m = /^\s*([a-z]+);dur=([0-9.]+)/.exec(part);
      if (m) rows.push([m[1], Number(m[2])]);
    }
    rows.push(["round trip (this browser)", roundTrip]);
    $("try-timings").tBodies[0].replaceChildren(...rows.map(([name, ms]) =>
        el("tr", {data: {stage: name, ms}}, el("td", {text: name}), el("td", {text: ms.toFixed(1) + " ms"}))));
  }

  // --- wiring ---

  function show(tab) {
    $("status").hidden = tab !== "status";
    $("try").hidden = tab !== "try";
    $("show-status").classList.toggle("on", tab === "status");
    $("show-try").classList.toggle("on", tab === "try");
  }

  $("show-status").addEventListener("click", () => show("status"));
  $("show-try").addEventListener("click", () => show("try"));
  $("window").addEventListener("change", draw);
  $("try-form").addEventListener("submit", runTry);
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    apiKey = $("key").value.trim();
    sessionStorage.setItem("quern-key", apiKey);
    startPolling();
  });
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible") startPolling();
  });
  startPolling();
})();
