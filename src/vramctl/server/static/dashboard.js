/* vramctl dashboard: loads /api/state, then follows /api/stream (Server-Sent Events). */
(function () {
  "use strict";

  var WINDOW = 600;        // points kept per chart (the server sends at most this many)
  var FEED_LIMIT = 100;    // alerts and activity entries kept
  var SERIES = [
    { key: "used", label: "used (device)", color: "#0969da", width: 2 },
    { key: "process_used", label: "this process", color: "#1a7f37", width: 1.5 },
    { key: "allocated", label: "allocated", color: "#bf8700", width: 1.5 },
    { key: "reserved", label: "reserved", color: "#8250df", width: 1.5, dash: [5, 3] },
    { key: "total", label: "capacity", color: "#6e7781", width: 1, dash: [8, 4] },
  ];
  var GiB = Math.pow(2, 30), MiB = Math.pow(2, 20);

  var meta = document.querySelector('meta[name="vramctl-token"]');
  var token = (meta && meta.content) || new URLSearchParams(location.search).get("token") || "";
  var devices = new Map();       // id -> device view
  var active = new Map();        // "rule|device" -> alert
  var statusEl = document.getElementById("status");
  var source = null;
  var hadError = false;
  var retryTimer = null;
  var RETRY_MS = 2000;

  function api(path) {
    var url = new URL(path, document.baseURI);
    if (token) url.searchParams.set("token", token);
    return url.toString();
  }

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      if (k === "text") node.textContent = attrs[k];
      else if (k === "class") node.className = attrs[k];
      else node.setAttribute(k, attrs[k]);
    });
    (children || []).forEach(function (c) { if (c) node.appendChild(c); });
    return node;
  }

  function setStatus(state, text) {
    statusEl.dataset.state = state;
    statusEl.textContent = text || state;
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return "N/A";
    var units = ["B", "KiB", "MiB", "GiB", "TiB"];
    var i = 0, v = Math.abs(n);
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (n < 0 ? "-" : "") + (i === 0 ? v.toFixed(0) : v.toFixed(v < 10 ? 2 : 1)) + " " + units[i];
  }

  function fmtSeconds(s) {
    if (s === null || s === undefined) return "N/A";
    return s < 1 ? (1000 * s).toFixed(s < 0.01 ? 2 : 0) + " ms" : s.toFixed(2) + " s";
  }

  function fmtTime(ts) {
    return new Date(ts * 1000).toLocaleTimeString();
  }

  function unitFor(total) {
    return total && total >= 4 * GiB ? { name: "GiB", scale: GiB } : { name: "MiB", scale: MiB };
  }

  // -- devices --------------------------------------------------------------------------

  function chartData(d) {
    var s = d.unit.scale;
    return [d.data.t].concat(SERIES.map(function (ser) {
      return d.data[ser.key].map(function (v) { return v === null || v === undefined ? null : v / s; });
    }));
  }

  function makeChart(d) {
    var width = Math.max(300, d.chartEl.clientWidth || 600);
    var unit = d.unit;
    var axisColor = getComputedStyle(document.body).color;
    var opts = {
      width: width,
      height: 220,
      scales: {
        x: { time: true },
        y: {
          range: function (u, min, max) {
            var top = d.total ? d.total / unit.scale : max;
            return [0, Math.max(top, max || 0, 1e-9) * 1.04];
          },
        },
      },
      axes: [
        { stroke: axisColor },
        {
          stroke: axisColor,
          label: unit.name,
          size: 60,
          values: function (u, ticks) {
            return ticks.map(function (v) { return v >= 100 ? v.toFixed(0) : +v.toFixed(2); });
          },
        },
      ],
      series: [{}].concat(SERIES.map(function (ser) {
        return {
          label: ser.label,
          stroke: ser.color,
          width: ser.width,
          dash: ser.dash,
          spanGaps: false,
          points: { show: false },
          value: function (u, v, si, idx) {
            if (idx === null || idx === undefined) {  // cursor away: the newest reading
              var col = u.data[si] || [];
              v = col.length ? col[col.length - 1] : null;
            }
            return v === null || v === undefined ? "N/A" : v.toFixed(2) + " " + unit.name;
          },
        };
      })),
      legend: { live: true },
    };
    return new uPlot(opts, chartData(d), d.chartEl);
  }

  function deviceView(info) {
    var figure = el("span", { class: "figure", text: "N/A" });
    var barFill = el("span");
    var bar = el("div", { class: "bar", role: "meter", "aria-label": "memory in use" }, [barFill]);
    var chartEl = el("div", { class: "chart", "data-points": "0", "data-device": info.id });
    var peak = el("div", { class: "peak muted" });
    var tbody = el("tbody");
    var table = el("table", { class: "procs" }, [
      el("caption", { text: "Processes" }),
      el("thead", {}, [el("tr", {}, [
        el("th", { text: "pid", class: "num" }), el("th", { text: "name" }),
        el("th", { text: "user" }), el("th", { text: "memory", class: "num" }),
      ])]),
      tbody,
    ]);
    var box = el("article", { class: info.simulated ? "device simulated" : "device", "data-device": info.id }, [
      el("header", {}, [
        el("h2", { text: info.name || info.id }),
        el("span", { class: "id muted", text: info.id + " \u00b7 " + info.kind }),
        info.simulated ? el("span", { class: "badge sim", text: "simulated" }) : null,
        figure,
      ]),
      info.note ? el("p", { class: "note muted", text: info.note }) : null,
      bar, chartEl, peak, table,
    ]);
    var data = { t: [] };
    SERIES.forEach(function (s) { data[s.key] = []; });
    return {
      id: info.id, info: info, box: box, figure: figure, bar: bar, barFill: barFill,
      chartEl: chartEl, peak: peak, tbody: tbody, data: data, total: info.total,
      unit: unitFor(info.total), chart: null, peakSeen: {},
    };
  }

  function loadHistory(d, h) {
    d.data.t = h.t.slice(-WINDOW);
    SERIES.forEach(function (s) { d.data[s.key] = (h[s.key] || []).slice(-WINDOW); });
  }

  function redraw(d) {
    if (d.chart) d.chart.setData(chartData(d));
    d.chartEl.setAttribute("data-points", String(d.data.t.length));
  }

  function showReading(d, mem, procs, peak) {
    if (mem) {
      if (mem.total && mem.total !== d.total) {
        var rebuild = unitFor(mem.total).name !== d.unit.name;
        d.total = mem.total;
        d.unit = unitFor(mem.total);
        if (rebuild && d.chart) { d.chart.destroy(); d.chart = makeChart(d); }
      }
      var pct = mem.total && mem.used !== null ? mem.used / mem.total : null;
      d.figure.textContent = pct === null ? fmtBytes(mem.used) + " in use"
        : fmtBytes(mem.used) + " of " + fmtBytes(mem.total) + " (" + (100 * pct).toFixed(1) + "%)";
      d.barFill.style.width = pct === null ? "0" : Math.min(100, 100 * pct).toFixed(1) + "%";
      d.bar.dataset.level = barLevel(d.id, pct);
      d.bar.setAttribute("aria-valuenow", pct === null ? "" : (100 * pct).toFixed(1));
    }
    if (peak) {
      d.peak.textContent = "peak: " + fmtBytes(peak.used) + " in use" +
        (peak.allocated !== null && peak.allocated !== undefined ? ", " + fmtBytes(peak.allocated) + " allocated" : "") +
        (peak.reserved !== null && peak.reserved !== undefined ? ", " + fmtBytes(peak.reserved) + " reserved" : "");
    }
    if (procs) {
      d.tbody.textContent = "";
      if (!procs.length) {
        d.tbody.appendChild(el("tr", {}, [el("td", { colspan: "4", class: "muted", text: "none listed" })]));
      }
      procs.forEach(function (p) {
        d.tbody.appendChild(el("tr", {}, [
          el("td", { class: "num", text: String(p.pid) }),
          el("td", { text: p.name || "N/A", title: p.command || "" }),
          el("td", { text: p.user || "N/A" }),
          el("td", { class: "num", text: fmtBytes(p.used) }),
        ]));
      });
    }
  }

  function mergePeak(d, seen) {
    ["used", "allocated", "reserved"].forEach(function (k) {
      var v = seen[k];
      if (v !== null && v !== undefined && (d.peakSeen[k] === null || d.peakSeen[k] === undefined || v > d.peakSeen[k])) {
        d.peakSeen[k] = v;
      }
    });
    return d.peakSeen;
  }

  function barLevel(device, pct) {
    var worst = pct === null ? 0 : pct >= 0.95 ? 2 : pct >= 0.8 ? 1 : 0;
    active.forEach(function (a) {
      if (a.device !== device) return;
      worst = Math.max(worst, a.level === "warning" ? 1 : a.level === "info" ? 0 : 2);
    });
    return ["ok", "warning", "critical"][worst];
  }

  function appendSample(s) {
    var d = devices.get(s.device);
    if (!d) return;
    var t = s.timestamp, last = d.data.t[d.data.t.length - 1];
    if (last !== undefined && t <= last) return;
    d.data.t.push(t);
    SERIES.forEach(function (ser) {
      var v = s.memory[ser.key];
      d.data[ser.key].push(v === undefined ? null : v);
    });
    var extra = d.data.t.length - WINDOW;
    if (extra > 0) {
      d.data.t.splice(0, extra);
      SERIES.forEach(function (ser) { d.data[ser.key].splice(0, extra); });
    }
    var mem = s.memory;
    showReading(d, mem, s.processes, mergePeak(d, {
      used: mem.used,
      allocated: mem.peak_allocated !== null ? mem.peak_allocated : mem.allocated,
      reserved: mem.peak_reserved !== null ? mem.peak_reserved : mem.reserved,
    }));
    redraw(d);
  }

  // -- alerts and activity ------------------------------------------------------------------

  function prepend(list, item) {
    var empty = list.querySelector("li.empty");
    if (empty) empty.remove();
    list.insertBefore(item, list.firstChild);
    while (list.children.length > FEED_LIMIT) list.removeChild(list.lastChild);
  }

  function showActiveCount() {
    var n = active.size, counter = document.getElementById("active-count");
    counter.textContent = n ? "(" + n + " firing)" : "(none firing)";
    counter.classList.toggle("firing", n > 0);
  }

  function addAlert(a) {
    var key = a.rule + "|" + a.device;
    if (a.resolved) active.delete(key); else active.set(key, a);
    showActiveCount();
    var level = a.resolved ? "resolved" : a.level;
    var item = el("li", { class: "alert level-" + a.level + (a.resolved ? " resolved" : ""), "data-rule": a.rule }, [
      el("time", { text: fmtTime(a.timestamp) }),
      el("span", { class: "badge", text: level }),
      el("b", { text: a.device + " " }),
      el("span", { class: "rule muted", text: a.rule + ": " }),
      el("span", { class: "message", text: a.message }),
      a.suggestion && !a.resolved ? el("div", { class: "suggestion", text: a.suggestion }) : null,
    ]);
    prepend(document.getElementById("alerts"), item);
  }

  function describe(kind, d) {
    if (kind === "guard") {
      var act = d.event || d.kind;  // what the guard did: "oom", "grow", "offload" ...
      var what = {
        oom: "OOM recovered", peer_oom: "ran again after another rank's OOM",
        grow: "batch pieces grown back", offload: "activations offloaded to host memory",
        optimizer_oom: "optimizer step ran out of memory", gave_up: "gave up after OOMs",
      }[act] || act;
      var parts = [what];
      if (d.step !== undefined) parts.push("step " + d.step);
      if (d.batch_size) parts.push("batch " + d.batch_size + (d.pieces > 1 ? " in " + d.pieces + " pieces" : ""));
      if (d.time_lost_s) parts.push(fmtSeconds(d.time_lost_s) + " lost");
      var bad = act === "gave_up" || act === "optimizer_oom";
      return { level: bad ? "error" : "info", text: parts.join(", "), detail: d.detail };
    }
    if (kind === "leak") {
      var rate = d.rate_bytes_per_step;
      var text = "memory leak" + (d.device ? " on " + d.device : "") +
        (rate !== undefined && rate !== null ? ": " + fmtBytes(rate) + " per step" : "");
      var causes = Array.isArray(d.causes) ? d.causes.join("; ") : (d.message || "");
      return { level: "error", text: text, detail: causes };
    }
    var rest = Object.keys(d).filter(function (k) { return k !== "timestamp"; }).slice(0, 6)
      .map(function (k) { return k + "=" + JSON.stringify(d[k]); }).join(" ");
    return { level: "info", text: kind + (rest ? ": " + rest : ""), detail: "" };
  }

  function addActivity(kind, ts, data) {
    var info = describe(kind, data);
    var item = el("li", { class: "event level-" + info.level, "data-kind": kind }, [
      el("time", { text: fmtTime(ts) }),
      el("span", { class: "badge", text: kind }),
      el("span", { text: info.text }),
      info.detail ? el("div", { class: "suggestion", text: info.detail }) : null,
    ]);
    prepend(document.getElementById("activity"), item);
  }

  var counts = null;

  function showMeta(st) {
    if (st) counts = { pid: st.pid, interval: st.interval_s, cost: st.sample_cost_s, samples: st.samples };
    if (!counts) return;
    document.getElementById("meta").textContent =
      "pid " + counts.pid + " \u00b7 every " + counts.interval + " s";
    document.getElementById("footer").textContent =
      "sampling every " + counts.interval + " s, " + (1000 * counts.cost).toFixed(2) +
      " ms per sample \u00b7 " + counts.samples + " samples \u00b7 charts keep the last " + WINDOW + " points";
  }

  // -- jobs (vramctl serve): polls the queue's summary ------------------------------------

  var QUEUE_LIMIT = 50;    // queued jobs listed (the rest are counted)
  var SEGMENT_COLORS = 6;  // .seg.c0 ... .c5 in the stylesheet
  var jobs = { path: null, timer: null, pollMs: 2000, polls: 0 };

  function fmtAge(s) {
    if (s === null || s === undefined || !isFinite(s)) return "N/A";
    s = Math.max(0, s);
    if (s < 60) return s.toFixed(0) + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + Math.floor(s % 60) + " s";
    return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  }

  function share(part, whole) {
    return whole ? Math.min(100, Math.max(0, 100 * part / whole)) : 0;
  }

  function jobDeviceView(dev, running, now) {
    var reserved = dev.allocated_bytes || 0, total = dev.capacity_bytes;
    var bar = el("div", {
      class: "resbar", role: "img", "data-total": String(total || 0),
      "aria-label": "jobs' reservations on " + dev.id,
    });
    var list = el("ul", { class: "joblist" });
    running.forEach(function (j, i) {
      var color = "c" + (i % SEGMENT_COLORS);
      var bytes = j.reserved_bytes || 0;
      var seg = el("span", {
        class: "seg " + color, "data-job": j.id, "data-reserved": String(bytes),
        title: j.name + " (" + j.id + "): " + fmtBytes(bytes),
      }, [el("span", { text: j.name })]);
      seg.style.width = share(bytes, total).toFixed(3) + "%";
      bar.appendChild(seg);
      var since = j.started_at || j.admitted_at;
      list.appendChild(el("li", { "data-job": j.id }, [
        el("span", { class: "swatch " + color }),
        el("b", { text: j.name + " " }),
        el("span", { class: "id muted", text: j.id + " " }),
        el("span", { class: "state", text: j.state }),
        el("span", { class: "num", text: fmtBytes(bytes) +
          (since ? " \u00b7 for " + fmtAge(now - since) : "") }),
      ]));
    });
    if (!running.length) list.appendChild(el("li", { class: "empty muted", text: "no job running" }));
    return el("div", { class: "jobdev", "data-device": dev.id }, [
      el("div", { class: "jobdev-head" }, [
        el("b", { text: dev.name && dev.name !== dev.id ? dev.id + " (" + dev.name + ")" : dev.id }),
        el("span", { class: "figure", text: fmtBytes(reserved) + " reserved" + (total
          ? " of " + fmtBytes(total) + " (" + share(reserved, total).toFixed(1) + "%)" : "") }),
      ]),
      bar, list,
    ]);
  }

  function showJobs(st) {
    var now = st.time;
    var byDevice = new Map();
    st.active.forEach(function (j) {
      if (!byDevice.has(j.device)) byDevice.set(j.device, []);
      byDevice.get(j.device).push(j);
    });
    var box = document.getElementById("job-devices");
    box.textContent = "";
    st.devices.forEach(function (dev) {
      box.appendChild(jobDeviceView(dev, byDevice.get(dev.id) || [], now));
      byDevice.delete(dev.id);
    });
    byDevice.forEach(function (running, id) {  // held by a scheduler on devices not served here
      var reserved = running.reduce(function (n, j) { return n + (j.reserved_bytes || 0); }, 0);
      var dev = { id: id || "no device", name: null, capacity_bytes: null, allocated_bytes: reserved };
      box.appendChild(jobDeviceView(dev, running, now));
    });

    var tbody = document.querySelector("#queue tbody");
    tbody.textContent = "";
    if (!st.pending.length) {
      tbody.appendChild(el("tr", { class: "empty" }, [el("td", { colspan: "4", class: "muted", text: "No job waiting." })]));
    }
    st.pending.slice(0, QUEUE_LIMIT).forEach(function (j) {
      var need = j.need_bytes !== null && j.need_bytes !== undefined ? fmtBytes(j.need_bytes)
        : j.need_kind === "estimate" ? "estimated" : j.need_kind === "learned" ? "learned" : "N/A";
      tbody.appendChild(el("tr", { "data-job": j.id }, [
        el("td", {}, [
          el("b", { text: j.name + " " }), el("span", { class: "id muted", text: j.id }),
          j.reason ? el("div", { class: "reason muted", text: j.reason }) : null,
        ]),
        el("td", { class: "num need", text: need }),
        el("td", { class: "num", text: String(j.priority) }),
        el("td", { class: "num", text: fmtAge(now - j.submitted_at) }),
      ]));
    });
    var more = st.pending_jobs - Math.min(st.pending.length, QUEUE_LIMIT);  // the server sends a page
    if (more > 0) {
      tbody.appendChild(el("tr", { class: "more" }, [el("td", {
        colspan: "4", class: "muted", text: "and " + more + " more",
      })]));
    }

    var failures = document.getElementById("failures");
    failures.textContent = "";
    if (!st.recent_failures.length) failures.appendChild(el("li", { class: "empty", text: "No failed jobs." }));
    st.recent_failures.forEach(function (j) {
      failures.appendChild(el("li", { class: "failure level-error", "data-job": j.id }, [
        j.finished_at ? el("time", { text: fmtTime(j.finished_at) }) : null,
        el("span", { class: "badge", text: j.state }),
        el("b", { text: j.name + " " }),
        el("span", { class: "id muted", text: j.id + (j.device ? " on " + j.device : "") }),
        el("div", { class: "reason", text: j.reason || "no reason recorded" }),
      ]));
    });

    document.getElementById("jobs-count").textContent = "(" + st.active_jobs + " running \u00b7 " +
      st.pending_jobs + " queued \u00b7 " + st.failed_jobs + " failed)";
    document.getElementById("queue-count").textContent = "(" + st.pending_jobs + ", in submission order)";
    document.getElementById("failures-count").textContent = st.failed_jobs > st.recent_failures.length
      ? "(the last " + st.recent_failures.length + " of " + st.failed_jobs + ")" : "";
  }

  function jobsProblem(text) {
    var note = document.getElementById("jobs-problem");
    note.hidden = !text;
    note.textContent = text || "";
    document.getElementById("jobs").dataset.state = text ? "stale" : "live";
  }

  function pollJobs() {
    jobs.timer = null;
    if (!jobs.path) return;
    var url = new URL(api(jobs.path));
    url.searchParams.set("limit", String(QUEUE_LIMIT));  // the rows it lists; the rest are counted
    fetch(url.toString(), { cache: "no-store" }).then(function (r) {
      if (!r.ok) throw new Error("the server answered " + r.status);
      return r.json();
    }).then(function (st) {
      showJobs(st);
      jobs.polls += 1;
      document.getElementById("jobs").dataset.polls = String(jobs.polls);
      jobsProblem(null);
    }).catch(function (err) {
      jobsProblem("could not read the queue (" + err.message + "); trying again");
    }).then(function () {
      if (jobs.path && jobs.timer === null) jobs.timer = setTimeout(pollJobs, jobs.pollMs);
    });
  }

  function followJobs(path, intervalS) {
    // The app says whether it serves a job queue (vramctl serve) and where its summary is.
    jobs.path = path || null;
    jobs.pollMs = Math.max(1000, 1000 * (intervalS || 1));
    document.getElementById("jobs").hidden = !jobs.path;
    clearTimeout(jobs.timer);
    jobs.timer = null;
    if (jobs.path) pollJobs();
  }

  // -- state and stream -------------------------------------------------------------------------

  function applyState(st) {
    var container = document.getElementById("devices");
    var loading = document.getElementById("loading");
    if (loading) loading.remove();
    st.devices.forEach(function (info) {
      var d = devices.get(info.id);
      if (!d) {
        d = deviceView(info);
        devices.set(info.id, d);
        container.appendChild(d.box);
      }
      d.total = info.total || d.total;
      d.unit = unitFor(d.total);
      loadHistory(d, info.history);
      if (d.chart) d.chart.destroy();
      d.chart = makeChart(d);
      d.peakSeen = {};
      showReading(d, info.latest, info.processes, mergePeak(d, info.peak || {}));
      redraw(d);
    });
    active.clear();
    var alerts = document.getElementById("alerts");
    alerts.textContent = "";
    alerts.appendChild(el("li", { class: "empty", text: "No alerts." }));
    st.alerts.forEach(addAlert);
    active.clear();
    st.active_alerts.forEach(function (a) { active.set(a.rule + "|" + a.device, a); });
    showActiveCount();
    var activity = document.getElementById("activity");
    activity.textContent = "";
    activity.appendChild(el("li", { class: "empty", text: "No OOM recoveries or leaks." }));
    st.events.forEach(function (e) { addActivity(e.kind, e.timestamp, e.data); });
    showMeta(st);
    followJobs(st.jobs, st.interval_s);
  }

  function loadState() {
    return fetch(api("api/state"), { cache: "no-store" }).then(function (r) {
      if (r.status === 401) throw new Error("this dashboard needs its token: open the URL it printed (with ?token=...)");
      if (!r.ok) throw new Error("the server answered " + r.status);
      return r.json();
    }).then(applyState);
  }

  function connect() {
    if (source) source.close();
    var url = new URL(api("api/stream"));
    url.searchParams.set("others", "record");  // recorded events of any kind, as "record"
    source = new EventSource(url.toString());
    source.onopen = function () {
      if (hadError) {
        hadError = false;
        loadState().catch(function () { /* the next event or error reports it */ });
      }
      setStatus("live");
    };
    source.onerror = function () {
      hadError = true;
      setStatus("reconnecting", "reconnecting...");
      // The browser retries a dropped connection itself, but gives up for good on an answer
      // that is not an event stream (a proxy's 502 while the server restarts): retry here.
      if (source.readyState === EventSource.CLOSED) {
        clearTimeout(retryTimer);
        retryTimer = setTimeout(connect, RETRY_MS);
      }
    };
    source.addEventListener("sample", function (ev) {
      var doc = JSON.parse(ev.data);
      (doc.samples || []).forEach(appendSample);
      if (counts) { counts.samples += 1; showMeta(null); }
    });
    source.addEventListener("alert", function (ev) { addAlert(JSON.parse(ev.data)); });
    ["guard", "leak"].forEach(function (kind) {
      source.addEventListener(kind, function (ev) {
        var d = JSON.parse(ev.data);
        addActivity(kind, d.timestamp, d);
      });
    });
    source.addEventListener("record", function (ev) {
      var e = JSON.parse(ev.data);
      addActivity(e.kind, e.timestamp, e.data || {});
    });
  }

  var resizeTimer = null;
  window.addEventListener("resize", function () {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(function () {
      devices.forEach(function (d) {
        if (d.chart) d.chart.setSize({ width: Math.max(300, d.chartEl.clientWidth), height: 220 });
      });
    }, 150);
  });

  loadState().then(connect, function (err) {
    setStatus("error", err.message);
    var loading = document.getElementById("loading");
    if (loading) loading.textContent = err.message;
  });
})();
