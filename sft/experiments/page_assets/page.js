// The page of a run or a sweep (sft.experiments.pages): built from the JSON beside this script, every text shown
// through textContent (never as markup), every chart drawn by Plotly. When it is done, <body> carries
// data-rendered-ms (the time since navigation), data-errors (any script error) and each chart data-points (the
// points it drew), which the browser tests read.
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("sft-data").textContent);
  const page = document.getElementById("page");
  const errors = [];
  window.addEventListener("error", (e) => errors.push(String(e.message)));

  function el(tag, text, attrs) {
    const node = document.createElement(tag);
    if (text !== undefined && text !== null) node.textContent = String(text);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    return node;
  }
  function add(parent, tag, text, attrs) { const n = el(tag, text, attrs); parent.appendChild(n); return n; }
  function section(title) { add(page, "h2", title); return page; }
  function note(text) { add(page, "p", text, { class: "note" }); }
  function num(v) { return typeof v === "number" ? (Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(3) : +v.toPrecision(4)) : v; }
  function interval(v) {
    if (v && typeof v === "object" && "mean" in v) {
      return v.low === null || v.low === undefined ? String(num(v.mean)) : `${num(v.mean)} [${num(v.low)}, ${num(v.high)}]`;
    }
    return v === null || v === undefined ? "" : String(num(v));
  }
  const LONG_CELL = 160;  // a longer text shows its first characters, the whole in its tooltip: rows stay a line or two
  function table(parent, columns, rows, rowClass, cellClass) {
    const box = add(parent, "div", null, { class: "table-box" });  // scrolls inside itself, never off the page
    const t = add(box, "table");
    const head = add(t, "tr");
    columns.forEach((c) => add(head, "th", c));
    rows.forEach((row, i) => {
      const tr = add(t, "tr", null, rowClass ? { class: rowClass(row) || "" } : {});
      columns.forEach((c) => {
        const text = interval(row[c]), attrs = cellClass ? { class: cellClass(row, c) || "" } : {};
        if (text.length > LONG_CELL) Object.assign(attrs, { title: text });
        add(tr, "td", text.length > LONG_CELL ? text.slice(0, LONG_CELL) + "…" : text, attrs);
      });
    });
    return t;
  }
  const charts = [];
  function chart(parent, title, traces, yTitle, xTitle) {
    const div = add(parent, "div", null, { class: "chart", "data-title": title });
    if (traces.length > 2) div.style.height = `${270 + 24 * traces.length}px`;  // room for a legend line a trace
    charts.push([div, traces, {
      title: { text: title, font: { size: 14 }, x: 0.01, xanchor: "left" }, margin: { l: 55, r: 10, t: 36, b: 36 },
      xaxis: { title: { text: xTitle === undefined ? "step" : xTitle } }, yaxis: { title: { text: yTitle || "" } },
      legend: { orientation: "h", yanchor: "top", y: -0.3 }, showlegend: traces.length > 1 }]);  // below "step"
  }
  const MARKED = 200;  // a curve of more points is drawn as a line alone: a marker a point made a long run's page slow
  function line(name, s, extra) {
    return Object.assign({ type: "scatter", mode: s.x.length > MARKED ? "lines" : "lines+markers", name: name,
                           x: s.x, y: s.y, connectgaps: false, marker: { size: 4 } }, extra || {});
  }
  // the points a chart drew: its curves' finite values (a gap, null, draws nothing), the smoothed one aside
  function drawn(div) {
    return div.data.filter((t) => t.name !== "smoothed")
      .reduce((n, t) => n + t.y.filter((v) => typeof v === "number" && isFinite(v)).length, 0);
  }

  add(page, "h1", data.title);
  if (data.kind === "run") run(); else sweep();
  Promise.all(charts.map(([div, traces, layout]) => Plotly.newPlot(div, traces, layout,
                                                                   { displaylogo: false, displayModeBar: "hover" })
    .then(() => div.setAttribute("data-points", String(drawn(div))))))
    .catch((e) => errors.push(String(e)))
    .finally(() => {
      document.body.setAttribute("data-errors", JSON.stringify(errors));
      document.body.setAttribute("data-rendered-ms", String(Math.round(performance.now())));
    });

  function run() {
    add(page, "p", data.run_dir);
    const r = data.results;
    section("Summary");
    if (r) {
      add(page, "p", `status: ${r.status}` + (r.error ? ` — ${r.error}` : ""), r.status === "ok" ? {} : { class: "note" });
    } else {
      note("no results.json: the run has not ended (or was interrupted)");
    }
    if (data.summary) add(page, "pre", data.summary);
    if (r && r.preemptions && r.preemptions.length) {
      add(page, "p", "stopped at a signal and continued:");
      table(page, ["signal", "step", "checkpoint", "slurm_job", "attempt", "time"], r.preemptions);
    }
    section("Recipe (what differs from the defaults)");
    if (data.recipe) add(page, "pre", data.recipe); else note("no saved config (.hydra/config.yaml)");
    section("Curves");
    if (!data.has_metrics) {
      note("no metrics.jsonl: nothing was logged, so there are no curves");
    } else {
      const s = data.series, box = add(page, "div", null, { class: "charts" });
      const loss = [];
      if (s["train loss"]) loss.push(line("train loss", s["train loss"], { opacity: 0.5 }));
      if (s["train loss (smoothed)"]) loss.push(line("smoothed", s["train loss (smoothed)"], { mode: "lines" }));
      if (loss.length) chart(box, "loss", loss, "loss");
      if (s["eval loss"]) chart(box, "eval loss", [line("eval loss", s["eval loss"])], "loss");
      if (s["learning rate"]) chart(box, "learning rate", [line("learning rate", s["learning rate"])]);
      if (s["grad norm"]) {
        const g = [line("gradient norm", s["grad norm"])];
        if (s["clip threshold"]) g.push(line("clip threshold", s["clip threshold"], { mode: "lines" }));
        chart(box, "gradient norm", g);
      }
      const buckets = Object.keys(s).filter((k) => k.startsWith("bucket "));
      if (buckets.length) chart(box, "eval loss by bucket", buckets.map((k) => line(k, s[k])), "loss");
      if (data.throughput.x.length) chart(box, "throughput", [line("tokens/s", data.throughput)], "tokens/s");
      if (data.memory.x.length) chart(box, "peak memory", [line("GB", data.memory)], "GB");
    }
    answers();
  }

  function answers() {
    const a = data.answers;
    section("Answers before and after (sft compare)");
    if (!a) { note("no compare.json: sft compare run=<this run> rows=<chats.jsonl> writes it"); return; }
    const buckets = [...new Set(a.buckets.filter((b) => b !== null))].sort((x, y) => x - y);
    const filter = add(page, "p");
    add(filter, "label", "difficulty bucket ");
    const select = add(filter, "select", null, { id: "bucket" });
    add(select, "option", "all", { value: "" });
    buckets.forEach((b) => add(select, "option", String(b), { value: String(b) }));
    const rows = a.references.map((ref, i) => ({
      bucket: a.buckets[i] === null ? "" : a.buckets[i], prompt: (a.prompts || [])[i] || "", reference: ref,
      before: a.before.texts[i], after: a.after.texts[i],
      beforeExact: a.before.texts[i].trim() === ref.trim(), afterExact: a.after.texts[i].trim() === ref.trim() }));
    const shown = add(page, "div", null, { id: "answers" });
    function draw() {
      shown.textContent = "";
      const keep = rows.filter((r) => select.value === "" || String(r.bucket) === select.value);
      table(shown, ["bucket", "prompt", "reference", "before", "after"], keep, null,
            (row, c) => (c === "before" && row.beforeExact) || (c === "after" && row.afterExact) ? "exact" : "");
      add(shown, "p", `exact: before ${keep.filter((r) => r.beforeExact).length}/${keep.length}, ` +
                      `after ${keep.filter((r) => r.afterExact).length}/${keep.length}`);
    }
    select.addEventListener("change", draw);
    draw();
  }

  function sweep() {
    add(page, "p", data.sweep_dir);
    section("Verdict");
    const v = add(page, "ul", null, { class: "verdict", id: "verdict" });
    data.verdict.forEach((line) => {  // **better** and the like in bold, every piece as text
      const item = add(v, "li");
      line.split("**").forEach((piece, i) => add(item, i % 2 ? "strong" : "span", piece));
    });
    if (data.failed.length) {
      section("Failed jobs");
      const f = add(page, "ul", null, { id: "failed" });
      data.failed.forEach((line) => add(f, "li", line));
    }
    section("Settings: each against the baseline (diff_: paired difference [95% interval], its verdict), then the means");
    if (data.settings.length) {
      const keys = [...new Set(data.settings.flatMap((r) => Object.keys(r)))]
        .filter((k) => !k.endsWith("_std") && k !== "baseline" && k !== "judged");
      // the setting, then each difference to the baseline with its verdict, then the means
      const columns = [...data.parameters, "seeds", ...keys.filter((k) => k.startsWith("diff_")),
                       ...keys.filter((k) => !k.startsWith("diff_") && k !== "seeds" && !data.parameters.includes(k))];
      const shown = data.settings.map((row) => Object.fromEntries(columns.map((c) => {
        const judged = (row.judged || {})[c.replace("diff_", "")];
        if (!c.startsWith("diff_")) return [c, row[c]];
        return [c, row.baseline ? "baseline" : (row[c] ? interval(row[c]) + (judged ? ` ${judged}` : "") : "")];
      })));
      table(page, columns, shown, null, (row, c) => {
        const words = String(row[c] || "");
        return c.startsWith("diff_") ? (words.endsWith(" better") ? "better" : words.endsWith(" worse") ? "worse" : "") : "";
      });
    }
    section("Curves of every job (click a name to show or hide it)");
    const box = add(page, "div", null, { class: "charts" });
    function jobName(job) {  // "job 2: loss=hard_sample trainer.seed=1": the overrides that differ between jobs
      const row = data.jobs.find((r) => String(r.job) === job);
      const keys = row ? Object.keys(row) : [];  // the job's overrides: the columns between "job" and "status"
      const differ = keys.slice(1, Math.max(keys.indexOf("status"), 1))
        .filter((p) => new Set(data.jobs.map((r) => String(r[p]))).size > 1);
      const said = differ.map((p) => `${p}=${row[p]}`).join(" ");
      return said ? `job ${job}: ${said}` : `job ${job}`;
    }
    for (const metric of ["train loss", "eval loss"]) {
      const traces = Object.entries(data.curves).filter(([, c]) => c[metric])
        .map(([job, c]) => line(jobName(job), c[metric]));
      if (traces.length) chart(box, metric, traces, "loss");
    }
    const bucketKeys = [...new Set(data.settings.flatMap((r) => Object.keys(r)))]
      .filter((k) => /^eval_loss_bucket_\d+$/.test(k))  // not the columns beside them (_std, ...)
      .sort((a, b) => Number(a.split("_").pop()) - Number(b.split("_").pop()));
    if (bucketKeys.length) {
      const params = data.parameters;
      const traces = data.settings.map((row) => ({
        type: "scatter", mode: "lines+markers", name: params.map((p) => `${p}=${row[p]}`).join(" ") || "setting",
        x: bucketKeys.map((k) => k.replace("eval_loss_bucket_", "bucket ")),
        y: bucketKeys.map((k) => row[k] ? row[k].mean : null),
        error_y: { type: "data", symmetric: false,
                   array: bucketKeys.map((k) => row[k] && row[k].high !== null ? row[k].high - row[k].mean : 0),
                   arrayminus: bucketKeys.map((k) => row[k] && row[k].low !== null ? row[k].mean - row[k].low : 0) } }));
      chart(box, "eval loss by bucket, per setting", traces, "loss", "difficulty bucket");
    }
    section("Jobs");
    const columns = data.jobs.length ? Object.keys(data.jobs[0]) : [];
    const t = table(page, columns, data.jobs, (row) => row.status === "ok" ? "" : "failed");
    const pages = data.pages;
    [...t.querySelectorAll("tr")].slice(1).forEach((tr, i) => {
      const job = String(data.jobs[i].job);
      if (pages[job]) {
        const cell = tr.firstChild;
        cell.textContent = "";
        add(cell, "a", job, { href: pages[job] });
      }
    });
  }
})();
