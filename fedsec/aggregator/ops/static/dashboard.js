// The fedsec operator dashboard: read-only views of the aggregator's DashboardSnapshot
// (fedsec/protocol/wire.py), pushed over /dashboard/api/events, polled from
// /dashboard/api/snapshot while the stream is down.
//
// The page runs under a strict CSP (script-src 'self'; style-src 'self'): no inline
// script or style, no eval, no style attributes.  Every value from the aggregator is
// put in the page as text (textContent, createTextNode, attribute values), never as
// markup, so a member id or an alert detail cannot inject anything.
"use strict";

(function () {
  const EVENTS_URL = "/dashboard/api/events";
  const SNAPSHOT_URL = "/dashboard/api/snapshot";
  // Polling interval while the event stream is down, and how often a closed stream
  // (one the browser gave up on, e.g. after a 5xx) is reopened.
  const POLL_MS = 2000;
  const REOPEN_MS = 10000;
  const VIEWS = ["now", "rounds", "members", "alerts", "models"];
  // The stages an attempt passes through, by secure-summation mode (protocol/stages.py).
  const STAGES_OF = {
    secagg: ["open", "advertise", "share_keys", "masked_input", "unmask", "closed"],
    he: ["open", "masked_input", "decrypt", "closed"],
    none: ["open", "masked_input", "closed"],
  };
  const STAGE_NAMES = {
    open: "open",
    advertise: "advertise keys",
    share_keys: "share keys",
    masked_input: "masked input",
    unmask: "unmask",
    decrypt: "decrypt (key custodian)",
    closed: "closed",
    aborted: "aborted",
  };
  // The stepper's labels: short enough for six to share one card.
  const STEP_NAMES = {
    open: "join",
    advertise: "keys",
    share_keys: "shares",
    masked_input: "input",
    unmask: "unmask",
    decrypt: "decrypt",
    closed: "closed",
  };
  const SVG_NS = "http://www.w3.org/2000/svg";

  let snapshot = null;
  // Server time minus local time (seconds), measured at each snapshot's receipt, so
  // countdowns follow the aggregator's clock rather than this machine's.
  let clockOffset = 0;
  let lastChartKey = "";

  // -- small DOM helpers -------------------------------------------------------------

  function $(sel) {
    return document.querySelector(sel);
  }

  function byTestId(id) {
    return document.querySelector('[data-testid="' + id + '"]');
  }

  // el("td", {class: "n", title: "..."}, "text", childNode, ...): attributes are set with
  // setAttribute (never "style"), string children become text nodes.
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    setAttrs(node, attrs);
    for (const child of children) {
      if (child === null || child === undefined || child === false) continue;
      node.append(typeof child === "string" ? document.createTextNode(child) : child);
    }
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    setAttrs(node, attrs);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function setAttrs(node, attrs) {
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "style" || key.startsWith("on")) throw new Error("refused attribute " + key);
      node.setAttribute(key, String(value));
    }
  }

  function setText(target, value) {
    const node = typeof target === "string" ? byTestId(target) || $("#" + target) : target;
    if (node && node.textContent !== value) node.textContent = value;
  }

  function replaceRows(tbody, rows, emptyText, columns) {
    const frag = document.createDocumentFragment();
    if (rows.length === 0) {
      frag.append(el("tr", { class: "empty" }, el("td", { colspan: columns }, emptyText)));
    }
    for (const row of rows) frag.append(row);
    tbody.replaceChildren(frag);
  }

  // -- formatting --------------------------------------------------------------------

  function serverNow() {
    return Date.now() / 1000 + clockOffset;
  }

  function pad(n) {
    return String(n).padStart(2, "0");
  }

  function clockTime(t) {
    if (t === null || t === undefined) return "\u2014";
    const d = new Date(t * 1000);
    return pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds());
  }

  function fullTime(t) {
    if (t === null || t === undefined) return "";
    const d = new Date(t * 1000);
    return (
      d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " + clockTime(t)
    );
  }

  function ago(t) {
    if (t === null || t === undefined) return "never";
    const s = Math.max(0, Math.round(serverNow() - t));
    if (s < 120) return s + "s ago";
    if (s < 7200) return Math.floor(s / 60) + "m ago";
    if (s < 172800) return Math.floor(s / 3600) + "h ago";
    return Math.floor(s / 86400) + "d ago";
  }

  function countdown(seconds) {
    const s = Math.max(0, Math.ceil(seconds));
    if (s < 60) return s + " s";
    const m = Math.floor(s / 60);
    return m + ":" + pad(s % 60) + " min";
  }

  function num(v, digits) {
    return v === null || v === undefined ? "\u2014" : v.toFixed(digits);
  }

  function pct(v, digits) {
    return v === null || v === undefined ? "\u2014" : (100 * v).toFixed(digits) + "%";
  }

  // The task's primary metric of a round summary or model view (accuracy for summaries
  // written before metrics were named), and how to show it: a share as a percentage.
  function score(r) {
    // a model view the members evaluated (validation.federated): their pooled value
    if (r.evaluated && Object.prototype.hasOwnProperty.call(r.evaluated, r.primary_metric)) {
      return r.evaluated[r.primary_metric];
    }
    if (r.metrics && Object.prototype.hasOwnProperty.call(r.metrics, r.primary_metric)) {
      return r.metrics[r.primary_metric];
    }
    return r.primary_metric === "accuracy" || !r.primary_metric ? r.accuracy : null;
  }

  function isShare(name) {
    return /accuracy/.test(name || "accuracy");
  }

  function showScore(name, v) {
    return isShare(name) ? pct(v, 2) : num(v, 4);
  }

  function seconds(v) {
    return v === null || v === undefined ? "\u2014" : v.toFixed(2) + " s";
  }

  function perMember(bytes, participants) {
    return participants > 0 ? bytes / participants / 1024 : null;
  }

  function stageName(stage) {
    return STAGE_NAMES[stage] || stage;
  }

  function badge(text, kind, title) {
    return el("span", { class: "badge " + kind, title: title }, text);
  }

  // -- connection: event stream, polling fallback ----------------------------------------

  let source = null;
  let pollTimer = null;
  let reopenTimer = null;

  function setConnection(state, detail) {
    const node = byTestId("connection-state");
    node.dataset.state = state;
    setText(node, state);
    node.title = detail || "";
  }

  function receive(text) {
    const data = JSON.parse(text);
    clockOffset = data.generated_at - Date.now() / 1000;
    snapshot = data;
    try {
      render();
      hideBanner();
    } catch (err) {
      showBanner("The dashboard could not show the aggregator's data: " + err.message);
      throw err;
    }
  }

  function openStream() {
    if (typeof EventSource === "undefined") {
      startPolling();
      return;
    }
    source = new EventSource(EVENTS_URL);
    source.addEventListener("open", () => {
      stopPolling();
      setConnection("live", "updates pushed by the aggregator");
    });
    source.addEventListener("snapshot", (ev) => {
      stopPolling();
      setConnection("live", "updates pushed by the aggregator");
      receive(ev.data);
    });
    source.addEventListener("error", () => {
      // CONNECTING: the browser retries by itself (the aggregator ends each stream after
      // a while).  CLOSED: it gave up (an error status); reopen it ourselves later.
      startPolling();
      if (source.readyState === EventSource.CLOSED && reopenTimer === null) {
        reopenTimer = setTimeout(() => {
          reopenTimer = null;
          openStream();
        }, REOPEN_MS);
      }
    });
  }

  function startPolling() {
    if (pollTimer !== null) return;
    setConnection("polling", "the event stream is down; polling every 2 s");
    const tick = async () => {
      // A stream that reopened meanwhile (stopPolling) has the last word on the state.
      const report = (state, detail) => {
        if (pollTimer !== null) setConnection(state, detail);
      };
      let text = null;
      try {
        const resp = await fetch(SNAPSHOT_URL, { cache: "no-store", credentials: "same-origin" });
        if (resp.status === 401 || resp.status === 403) {
          report("disconnected", "not authorised");
          showBanner(
            "The aggregator refused this session (HTTP " +
              resp.status +
              "): open the " +
              "dashboard again (reload) and sign in with a fresh token (fedsec aggregator " +
              "dashboard-token).",
          );
        } else if (!resp.ok) {
          report("disconnected", "the aggregator answered HTTP " + resp.status);
        } else {
          text = await resp.text();
        }
      } catch (err) {
        report("disconnected", "the aggregator cannot be reached");
      }
      try {
        if (text !== null) {
          report("polling", "the event stream is down; polling every 2 s");
          receive(text);
        }
      } finally {
        if (pollTimer !== null) pollTimer = setTimeout(tick, POLL_MS);
      }
    };
    pollTimer = setTimeout(tick, 0);
  }

  function stopPolling() {
    if (pollTimer !== null) clearTimeout(pollTimer);
    pollTimer = null;
  }

  function showBanner(text) {
    const node = $("#banner");
    setText(node, text);
    node.hidden = false;
  }

  function hideBanner() {
    $("#banner").hidden = true;
  }

  // -- routing -------------------------------------------------------------------------

  function currentView() {
    const name = location.hash.replace(/^#/, "");
    return VIEWS.includes(name) ? name : "now";
  }

  function route() {
    const view = currentView();
    for (const section of document.querySelectorAll("main > section")) {
      section.hidden = section.dataset.view !== view;
    }
    for (const tab of document.querySelectorAll(".tabs a")) {
      tab.classList.toggle("active", tab.dataset.view === view);
      if (tab.dataset.view === view) tab.setAttribute("aria-current", "page");
      else tab.removeAttribute("aria-current");
    }
    document.title = "fedsec \u00b7 " + view;
  }

  // -- rendering -----------------------------------------------------------------------

  function render() {
    setText("federation-id", snapshot.federation_id);
    setText(
      "replica-role",
      snapshot.fencing == null
        ? snapshot.role
        : snapshot.role + " \u00b7 token " + snapshot.fencing
    );
    setText("updated", "updated " + clockTime(snapshot.generated_at));
    renderNow(snapshot.now);
    renderRounds(snapshot.rounds);
    renderMembers(snapshot.members);
    renderAlerts(snapshot.alerts);
    renderModels(snapshot.models);
    tick();
  }

  function renderNow(now) {
    setText("now-round", String(now.round));
    setText("now-attempt", String(now.attempt));
    setText("now-stage", stageName(now.stage));
    setText("now-cohort", String(now.cohort));
    setText("now-joined", String(now.joined));
    setText("now-accepted", String(now.accepted));
    setText("now-refused", String(now.refused));
    setText("now-dropped", String(now.dropped));
    setText("rounds-completed", now.rounds_completed + " / " + now.rounds_target);
    setText("now-model", "v" + now.model_version);
    setText("now-secure-sum", now.secure_sum);
    setText("now-mode", now.mode);
    setText("now-opened", fullTime(now.opened_at));
    setText("now-stage-started", fullTime(now.stage_started_at));
    byTestId("now-finished").hidden = !now.finished;
    const left = Math.max(0, now.rounds_target - now.rounds_completed);
    $("#now-progress").replaceChildren(
      progressBar(now.rounds_target ? now.rounds_completed / now.rounds_target : 0, "progress"),
      el(
        "div",
        { class: "bar-note" },
        now.finished ? "all rounds done" : left + (left === 1 ? " round" : " rounds") + " to go",
      ),
    );
    renderStepper(now.stage, now.secure_sum);
    const scored = snapshot.rounds.filter((r) => r.stage === "closed" && score(r) !== null);
    const last = scored.length ? scored[scored.length - 1] : null;
    // federated evaluation: the newest version the members scored (models: newest first)
    const evaluated = (snapshot.models || []).find((m) => m.evaluators > 0 && score(m) !== null);
    const shown = evaluated || last;
    const metric = shown ? shown.primary_metric || "accuracy" : "accuracy";
    setText("now-metric-name", "Last " + metric);
    setText("rounds-metric", metric);
    setText("models-metric", metric);
    let where = "";
    if (evaluated) {
      where = " (v" + evaluated.version + ", " + evaluated.evaluators + " members)";
    } else if (last) {
      where = " (round " + last.round + ")";
    }
    setText("now-accuracy", shown ? showScore(metric, score(shown)) + where : "\u2014");
    renderNowAlerts();
  }

  function renderStepper(stage, mode) {
    const stages = STAGES_OF[mode] || STAGES_OF.secagg;
    const at = stages.indexOf(stage);
    const items = stages.map((s, i) => {
      let cls = "todo";
      if (stage === "aborted") cls = "aborted";
      else if (i < at) cls = "done";
      else if (i === at) cls = "current";
      return el("li", { class: cls, title: stageName(s) }, STEP_NAMES[s]);
    });
    $("#stepper").replaceChildren(...items);
  }

  function renderNowAlerts() {
    const open = snapshot.alerts.filter((a) => a.acked_at === null);
    open.sort((a, b) => b.raised_at - a.raised_at);
    const items = open
      .slice(0, 5)
      .map((a) =>
        el(
          "li",
          {},
          el("a", { href: "#alerts" }, a.kind),
          " ",
          el("span", { class: "muted" }, a.subject + " \u00b7 " + clockTime(a.raised_at)),
        ),
      );
    if (open.length > 5)
      items.push(el("li", { class: "muted" }, "and " + (open.length - 5) + " more"));
    if (items.length === 0) items.push(el("li", { class: "muted" }, "none"));
    $("#now-alerts").replaceChildren(...items);
  }

  // Deadline countdown and "last seen": recomputed every second from the last snapshot.
  function tick() {
    if (!snapshot) return;
    const now = snapshot.now;
    const live = !now.finished && now.stage !== "closed" && now.stage !== "aborted";
    const node = byTestId("now-deadline");
    if (live && now.deadline_at !== null) {
      const left = now.deadline_at - serverNow();
      setText(node, left > 0 ? countdown(left) : "closing");
      node.classList.toggle("urgent", left < 5);
      setText("now-deadline-at", "closes by " + clockTime(now.deadline_at));
    } else {
      setText(node, "\u2014");
      node.classList.remove("urgent");
      setText(
        "now-deadline-at",
        now.stage === "open" ? "waiting for members to join" : live ? "no deadline" : "\u00a0",
      );
    }
    for (const cell of document.querySelectorAll("[data-seen]")) {
      const t = cell.dataset.seen === "" ? null : Number(cell.dataset.seen);
      setText(cell, ago(t));
    }
  }

  function progressBar(fraction, cls, title) {
    const f = Math.max(0, Math.min(1, fraction || 0));
    const bar = svg("svg", {
      class: "bar " + cls,
      viewBox: "0 0 100 8",
      preserveAspectRatio: "none",
      role: "img",
      "aria-label": title || Math.round(100 * f) + "%",
    });
    bar.append(svg("rect", { class: "track", x: 0, y: 0, width: 100, height: 8, rx: 2 }));
    bar.append(
      svg("rect", { class: "fill", x: 0, y: 0, width: (100 * f).toFixed(2), height: 8, rx: 2 }),
    );
    if (title) bar.append(svg("title", {}, title));
    return bar;
  }

  // A sum's coordinates at the ring's edge (likely wrapped, so corrupted in the aggregate)
  // of those summed, for sums that can wrap (distributed DP, fewer codec headroom bits);
  // "—" for a round that summed no such coordinates.
  function wrapCell(r) {
    const wrapped = r.edge_count > 0;
    const attrs = { class: "n" + (wrapped ? " fail" : ""), "data-col": "wraps" };
    if (!(r.coordinates > 0)) return el("td", attrs, "\u2014");
    attrs.title =
      (100 * (r.edge_count / r.coordinates)).toPrecision(2) +
      "% of the summed coordinates at the ring's edge" +
      (wrapped ? " (likely wrapped: those coordinates of the aggregate are corrupted)" : "");
    return el(
      "td",
      attrs,
      r.edge_count.toLocaleString("en-US") + " / " + r.coordinates.toLocaleString("en-US"),
    );
  }

  function renderRounds(rounds) {
    const rows = rounds
      .slice()
      .sort((a, b) => b.round - a.round || b.attempt - a.attempt)
      .map((r) => {
        const closed = r.stage === "closed";
        const cls = [closed ? "" : "aborted", r.edge_count > 0 ? "wrapped" : ""].join(" ").trim();
        return el(
          "tr",
          {
            "data-testid": "round-row",
            "data-round": r.round,
            "data-attempt": r.attempt,
            "data-stage": r.stage,
            class: cls,
          },
          el("td", { class: "n" }, String(r.round)),
          el("td", { class: "n" }, String(r.attempt)),
          el("td", {}, closed ? badge("closed", "ok") : badge(stageName(r.stage), "bad")),
          el("td", { class: "n", "data-col": "cohort" }, String(r.cohort)),
          el("td", { class: "n", "data-col": "survivors" }, String(r.survivors)),
          el("td", { class: "ids" }, r.dropped.join(", ") || "\u2014"),
          el("td", { class: "n" }, r.model_version === null ? "\u2014" : "v" + r.model_version),
          el("td", { class: "n" }, showScore(r.primary_metric, score(r))),
          el("td", { class: "n" }, num(r.loss, 4)),
          el("td", { class: "n" }, num(r.epsilon_max, 2)),
          el(
            "td",
            { class: "n", "data-col": "noise" },
            r.noise_multiplier > 0 ? num(r.noise_multiplier, 3) : "\u2014",
          ),
          wrapCell(r),
          el("td", { class: "n" }, seconds(r.aggregation_s)),
          el("td", { class: "n" }, seconds(r.duration_s)),
          el("td", { class: "n" }, num(perMember(r.bytes_up, r.participants), 1)),
          el("td", { class: "n" }, num(perMember(r.bytes_down, r.participants), 1)),
          el("td", { class: "detail", title: r.detail }, r.detail || ""),
        );
      });
    replaceRows($("#rounds-body"), rows, "No attempt has ended yet.", 17);
    renderCharts(rounds);
  }

  function renderCharts(rounds) {
    const last = rounds[rounds.length - 1];
    const key = rounds.length + ":" + (last ? last.round + "." + last.attempt : "");
    if (key === lastChartKey) return;
    lastChartKey = key;
    const ordered = rounds.slice().sort((a, b) => a.round - b.round || a.attempt - b.attempt);
    const closed = ordered.filter((r) => r.stage === "closed");
    const point = (r, y) => ({
      x: r.round,
      y: y,
      bad: r.stage !== "closed",
      label: r.round + "." + r.attempt,
    });
    const metric = last ? last.primary_metric || "accuracy" : "accuracy";
    const share = isShare(metric);
    const accuracy = {
      title: "Validation " + metric + " per round",
      yLabel: share ? metric + " (%)" : metric,
      series: [
        {
          name: metric,
          points: closed
            .filter((r) => score(r) !== null)
            .map((r) => point(r, share ? 100 * score(r) : score(r))),
        },
      ],
      yFormat: (v) => (share ? v.toFixed(1) : v.toFixed(3)),
      unit: share ? "%" : "",
    };
    $("#now-chart").replaceChildren(lineChart(accuracy));
    const charts = [
      accuracy,
      {
        title: "Round duration and aggregation time",
        yLabel: "seconds",
        yMin: 0,
        series: [
          {
            name: "duration",
            points: ordered.filter((r) => r.duration_s !== null).map((r) => point(r, r.duration_s)),
          },
          {
            name: "aggregation",
            points: ordered
              .filter((r) => r.aggregation_s !== null)
              .map((r) => point(r, r.aggregation_s)),
          },
        ],
        yFormat: (v) => v.toFixed(v < 10 ? 1 : 0),
        unit: " s",
      },
      {
        title: "Participation (survivors / cohort)",
        yLabel: "participation (%)",
        yMin: 0,
        yMax: 100,
        series: [
          {
            name: "participation",
            points: ordered
              .filter((r) => r.cohort > 0)
              .map((r) => point(r, (100 * r.survivors) / r.cohort)),
          },
        ],
        yFormat: (v) => v.toFixed(0),
        unit: "%",
      },
      {
        title: "Traffic per member",
        yLabel: "KiB per member",
        yMin: 0,
        series: [
          {
            name: "up (received)",
            points: ordered
              .filter((r) => r.participants > 0)
              .map((r) => point(r, perMember(r.bytes_up, r.participants))),
          },
          {
            name: "down (sent)",
            points: ordered
              .filter((r) => r.participants > 0)
              .map((r) => point(r, perMember(r.bytes_down, r.participants))),
          },
        ],
        yFormat: (v) => v.toFixed(v < 10 ? 1 : 0),
        unit: " KiB",
      },
    ];
    $("#round-charts").replaceChildren(
      ...charts.map((c) => el("div", { class: "panel chart-panel" }, lineChart(c))),
    );
  }

  // -- charts: hand-written SVG ------------------------------------------------------------

  // Round numbers for ticks: 1, 2 or 5 times a power of ten, about `count` of them.
  function niceTicks(lo, hi, count) {
    if (!(hi > lo)) {
      const pad = Math.abs(lo) > 0 ? Math.abs(lo) * 0.1 : 1;
      lo -= pad;
      hi += pad;
    }
    const raw = (hi - lo) / count;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
    const ticks = [];
    // from the last tick at or below lo to the first at or above hi
    for (let v = Math.floor(lo / step) * step; ticks.length <= 20; v += step) {
      ticks.push(Number(v.toPrecision(12)));
      if (v >= hi - step * 1e-9) break;
    }
    return ticks;
  }

  function lineChart(spec) {
    const W = 560;
    const H = 230;
    const m = { top: 30, right: 16, bottom: 40, left: 56 };
    const root = svg("svg", {
      class: "chart",
      viewBox: "0 0 " + W + " " + H,
      role: "img",
      "aria-label": spec.title,
    });
    root.append(svg("text", { class: "chart-title", x: m.left, y: 18 }, spec.title));
    const all = spec.series.flatMap((s) => s.points);
    if (all.length === 0) {
      root.append(
        svg(
          "text",
          { class: "chart-empty", x: W / 2, y: H / 2, "text-anchor": "middle" },
          "no data yet",
        ),
      );
      return root;
    }
    const ys = all.map((p) => p.y);
    const xs = all.map((p) => p.x);
    let yLo = spec.yMin !== undefined ? spec.yMin : Math.min(...ys);
    let yHi = spec.yMax !== undefined ? spec.yMax : Math.max(...ys);
    if (spec.yMax === undefined && yHi < yLo) yHi = yLo;
    const yTicks = niceTicks(yLo, yHi, 4);
    yLo = Math.min(yLo, yTicks[0]);
    yHi = Math.max(yHi, yTicks[yTicks.length - 1]);
    let xLo = Math.min(...xs);
    let xHi = Math.max(...xs);
    if (xHi === xLo) {
      xLo -= 1;
      xHi += 1;
    }
    const xTicks = niceTicks(xLo, xHi, 8).filter(
      (v) => v >= xLo && v <= xHi && Number.isInteger(v),
    );
    const px = (x) => m.left + ((x - xLo) / (xHi - xLo)) * (W - m.left - m.right);
    const py = (y) => H - m.bottom - ((y - yLo) / (yHi - yLo)) * (H - m.top - m.bottom);

    // tick labels as precise as their step, all alike (0, 5, 10; 0.5, 1.0, 1.5)
    const step = yTicks.length > 1 ? yTicks[1] - yTicks[0] : 1;
    const tickDigits = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
    const grid = svg("g", { class: "grid" });
    for (const t of yTicks) {
      grid.append(svg("line", { x1: m.left, x2: W - m.right, y1: py(t), y2: py(t) }));
      grid.append(
        svg(
          "text",
          { class: "tick", x: m.left - 6, y: py(t) + 4, "text-anchor": "end" },
          t.toFixed(tickDigits),
        ),
      );
    }
    for (const t of xTicks) {
      grid.append(
        svg(
          "text",
          { class: "tick", x: px(t), y: H - m.bottom + 16, "text-anchor": "middle" },
          String(t),
        ),
      );
    }
    root.append(grid);
    root.append(
      svg("line", {
        class: "axis",
        x1: m.left,
        x2: W - m.right,
        y1: H - m.bottom,
        y2: H - m.bottom,
      }),
      svg("line", { class: "axis", x1: m.left, x2: m.left, y1: m.top, y2: H - m.bottom }),
      svg(
        "text",
        { class: "axis-label", x: (m.left + W - m.right) / 2, y: H - 6, "text-anchor": "middle" },
        "round",
      ),
      svg(
        "text",
        {
          class: "axis-label",
          x: 0,
          y: 0,
          transform: "translate(14 " + (m.top + (H - m.top - m.bottom) / 2) + ") rotate(-90)",
          "text-anchor": "middle",
        },
        spec.yLabel,
      ),
    );

    spec.series.forEach((s, i) => {
      const g = svg("g", { class: "series s" + i });
      if (s.points.length > 1) {
        const d = s.points
          .map((p, j) => (j ? "L" : "M") + px(p.x).toFixed(1) + " " + py(p.y).toFixed(1))
          .join(" ");
        g.append(svg("path", { class: "line", d: d }));
      }
      const r = s.points.length > 40 ? 2 : 3;
      for (const p of s.points) {
        const dot = svg("circle", {
          class: p.bad ? "dot bad" : "dot",
          cx: px(p.x).toFixed(1),
          cy: py(p.y).toFixed(1),
          r: r,
        });
        dot.append(
          svg("title", {}, s.name + ", round " + p.label + ": " + spec.yFormat(p.y) + spec.unit),
        );
        g.append(dot);
      }
      root.append(g);
    });

    if (spec.series.length > 1) {
      let x = W - m.right;
      const legend = svg("g", { class: "legend" });
      for (let i = spec.series.length - 1; i >= 0; i--) {
        const name = spec.series[i].name;
        const width = 22 + name.length * 6.5;
        x -= width;
        const item = svg("g", { class: "series s" + i });
        item.append(svg("line", { class: "line", x1: x, x2: x + 14, y1: 14, y2: 14 }));
        item.append(svg("text", { class: "legend-text", x: x + 18, y: 18 }, name));
        legend.append(item);
        x -= 10;
      }
      root.append(legend);
    }
    return root;
  }

  // -- members, alerts, models ---------------------------------------------------------

  function renderMembers(members) {
    const rows = members
      .slice()
      .sort((a, b) => a.id.localeCompare(b.id, undefined, { numeric: true }))
      .map((mb) =>
        el(
          "tr",
          { "data-testid": "member-row", "data-member": mb.id, class: mb.active ? "" : "inactive" },
          el("td", { class: "ids" }, mb.id),
          el("td", {}, mb.role),
          el("td", {}, mb.active ? badge("active", "ok") : badge("revoked", "muted-badge")),
          el(
            "td",
            {
              class: "n",
              "data-seen": mb.last_seen === null ? "" : mb.last_seen,
              title: fullTime(mb.last_seen),
            },
            ago(mb.last_seen),
          ),
          el("td", { class: "n" }, String(mb.rounds_contributed)),
          el("td", { class: "eps" }, epsilonCell(mb)),
          el("td", { class: "n" }, String(mb.audits_passed)),
          el("td", { class: "n" + (mb.audits_failed ? " fail" : "") }, String(mb.audits_failed)),
          el("td", { class: "detail", title: mb.last_failure }, mb.last_failure || "\u2014"),
          el(
            "td",
            { class: "n", "data-testid": "member-data" },
            mb.records === null || mb.records === undefined
              ? "\u2014"
              : `${mb.records} \u00b7 q ${mb.quality.toFixed(2)}`,
          ),
        ),
      );
    replaceRows($("#members-body"), rows, "No member is enrolled.", 10);
  }

  function epsilonCell(mb) {
    const wrap = el("div", { class: "eps-cell" });
    if (mb.epsilon === null) {
      wrap.append(el("span", { class: "muted" }, "none reported"));
      return wrap;
    }
    const text =
      mb.epsilon_budget === null
        ? num(mb.epsilon, 2)
        : num(mb.epsilon, 2) + " / " + num(mb.epsilon_budget, 2);
    wrap.append(el("span", { class: "eps-text" }, text));
    if (mb.epsilon_budget !== null && mb.epsilon_budget > 0) {
      const f = mb.epsilon / mb.epsilon_budget;
      const level = f >= 1 ? "over" : f >= 0.9 ? "near" : "within";
      wrap.append(
        progressBar(f, "eps-bar " + level, Math.round(100 * f) + "% of the budget spent"),
      );
    }
    return wrap;
  }

  function renderAlerts(alerts) {
    const open = alerts
      .filter((a) => a.acked_at === null)
      .sort((a, b) => b.raised_at - a.raised_at);
    const acked = alerts
      .filter((a) => a.acked_at !== null)
      .sort((a, b) => b.raised_at - a.raised_at);
    const row = (a) => {
      const isOpen = a.acked_at === null;
      return el(
        "tr",
        {
          "data-testid": "alert-row",
          "data-kind": a.kind,
          "data-state": isOpen ? "open" : "acknowledged",
          class: isOpen ? "open" : "acked",
        },
        el("td", {}, isOpen ? badge("open", "bad") : badge("acknowledged", "muted-badge")),
        el("td", { class: "kind" }, a.kind),
        el("td", { class: "ids" }, a.subject),
        el("td", { class: "detail wrap" }, a.detail),
        el(
          "td",
          { title: fullTime(a.raised_at) },
          clockTime(a.raised_at),
          " ",
          el("span", { class: "muted", "data-seen": a.raised_at }, ago(a.raised_at)),
        ),
        el(
          "td",
          { title: fullTime(a.acked_at) },
          isOpen ? "\u2014" : (a.acked_by || "?") + " at " + clockTime(a.acked_at),
        ),
      );
    };
    replaceRows(
      $("#alerts-body"),
      open.map(row).concat(acked.map(row)),
      "No alert has been raised.",
      6,
    );
    const count = byTestId("alerts-badge");
    setText(count, String(open.length));
    count.classList.toggle("zero", open.length === 0);
  }

  function renderModels(models) {
    const rows = models
      .slice()
      .sort((a, b) => b.version - a.version)
      .map((md) => {
        const cls = [md.latest ? "latest" : "", md.rollback ? "rollback" : ""].join(" ").trim();
        return el(
          "tr",
          {
            "data-testid": "model-row",
            "data-version": md.version,
            "data-latest": md.latest ? "true" : "false",
            class: cls,
          },
          el(
            "td",
            { class: "version" },
            "v" + md.version,
            md.latest ? el("span", {}, " ", badge("latest", "ok")) : null,
          ),
          el("td", { class: "n" }, md.parent === null ? "\u2014" : "v" + md.parent),
          el("td", { class: "n" }, md.round === null ? "\u2014" : String(md.round)),
          el(
            "td",
            {},
            md.kind,
            md.rollback
              ? el("span", {}, " ", badge("rollback", "warn", "holds an earlier version's weights"))
              : null,
          ),
          el("td", { class: "hash", title: md.sha256 }, md.sha256.slice(0, 12) + "\u2026"),
          el("td", { title: fullTime(md.created) }, fullTime(md.created)),
          el(
            "td",
            { class: "n", title: md.evaluators ? "pooled from " + md.evaluators + " members" : "" },
            showScore(md.primary_metric, score(md)) + (md.evaluators ? " (" + md.evaluators + "m)" : ""),
          ),
          el("td", { class: "n" }, num(md.loss, 4)),
          el("td", { class: "detail", title: md.note }, md.note || ""),
        );
      });
    replaceRows($("#models-body"), rows, "No model version yet.", 9);
  }

  // -- start ---------------------------------------------------------------------------

  function start() {
    window.addEventListener("hashchange", route);
    route();
    openStream();
    setInterval(tick, 1000);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
