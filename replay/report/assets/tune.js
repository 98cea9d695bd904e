// spec-replay tune page: every setting's predicted speed-up, acceptance by draft position (counted and
// expected), and the spread over records of target decodes per token. Everything from DATA, as text.
const PALETTE = ["#1c7ed6", "#d9480f", "#2b8a3e", "#862e9c", "#e67700", "#0b7285", "#c2255c", "#5c940d", "#364fc7", "#a61e4d"];
const colour = (k) => PALETTE[k % PALETTE.length];

function speedChart(settings) {
  const rows = settings.filter((s) => s.speedup !== null);
  if (!rows.length) return el("p", { class: "muted" }, "No speed prediction (give --measure, or a transcript with timings).");
  const W = 1000, rowH = 26, left = 330, right = 60, H = rows.length * rowH + 40;
  const hi = Math.max(1.2, ...rows.map((s) => (s.interval ? s.interval[1] : s.speedup)));
  const x = (v) => left + (W - left - right) * v / hi;
  const root = svg("svg", { class: "chart speed", viewBox: `0 0 ${W} ${H}`, role: "img", style: `height:${H}px` });
  rows.forEach((s, k) => {
    const y = 20 + k * rowH;
    root.appendChild(svg("text", { x: left - 8, y: y + 15, "text-anchor": "end", "font-size": 12, fill: "#1d2230" }, s.name));
    root.appendChild(svg("rect", { x: left, y: y + 4, width: Math.max(1, x(s.speedup) - left), height: rowH - 10,
                                   fill: s.speedup >= 1 ? "#40c057" : "#fa5252", "data-i": k, class: "bar" }));
    if (s.interval) root.appendChild(svg("line", { x1: x(s.interval[0]), x2: x(s.interval[1]), y1: y + 13, y2: y + 13,
                                                   stroke: "#1d2230", "stroke-width": 2 }));
    root.appendChild(svg("text", { x: x(s.speedup) + 6, y: y + 15, "font-size": 12, fill: "#5d6475" }, s.speedup.toFixed(2) + "x"));
  });
  root.appendChild(svg("line", { x1: x(1), x2: x(1), y1: 10, y2: H - 14, stroke: "#1d2230", "stroke-dasharray": "4 3" }));
  root.appendChild(svg("text", { x: x(1) + 4, y: H - 2, "font-size": 11, fill: "#5d6475" }, "1.0x: no speculation"));
  return root;
}

function positionChart(settings) {
  const W = 1000, H = 240, pad = 34;
  const n = Math.max(1, ...settings.map((s) => s.by_position.length));
  const x = (i) => pad + (W - 2 * pad) * (n === 1 ? 0.5 : i / (n - 1)), y = (v) => H - pad - (H - 2 * pad) * v;
  const root = svg("svg", { class: "chart positions", viewBox: `0 0 ${W} ${H}`, role: "img", style: `height:${H}px` });
  for (const v of [0, 0.5, 1]) {
    root.appendChild(svg("line", { x1: pad, x2: W - pad, y1: y(v), y2: y(v), stroke: "#d9dde6" }));
    root.appendChild(svg("text", { x: 4, y: y(v) + 4, "font-size": 11, fill: "#5d6475" }, v.toFixed(1)));
  }
  for (let i = 0; i < n; i++) root.appendChild(svg("text", { x: x(i) - 3, y: H - 8, "font-size": 11, fill: "#5d6475" }, i + 1));
  settings.forEach((s, k) => {
    for (const [key, dash] of [["by_position", null], ["expected_by_position", "5 4"]]) {
      const pts = (s[key] || []).map((v, i) => (v === null ? null : x(i) + "," + y(v).toFixed(1))).filter((p) => p);
      if (!pts.length) continue;
      root.appendChild(svg("polyline", { points: pts.join(" "), fill: "none", stroke: colour(k), "stroke-width": 2,
                                         "stroke-dasharray": dash || "none", class: "series", "data-setting": k }));
      for (const p of pts) { const [cx, cy] = p.split(","); root.appendChild(svg("circle", { cx, cy, r: 2.5, fill: colour(k) })); }
    }
  });
  return root;
}

function spreadChart(settings) {
  const rowH = 24, left = 330, W = 1000, right = 30, H = settings.length * rowH + 40;
  const vals = settings.flatMap((s) => s.records.map((r) => r.decodes_per_token)).filter((v) => v !== null);
  const hi = Math.max(1.05, ...vals);
  const x = (v) => left + (W - left - right) * v / hi;
  const root = svg("svg", { class: "chart spread", viewBox: `0 0 ${W} ${H}`, role: "img", style: `height:${H}px` });
  settings.forEach((s, k) => {
    const y = 20 + k * rowH + 12;
    root.appendChild(svg("text", { x: left - 8, y: y + 4, "text-anchor": "end", "font-size": 12, fill: "#1d2230" }, s.name));
    root.appendChild(svg("line", { x1: left, x2: W - right, y1: y, y2: y, stroke: "#d9dde6" }));
    s.records.forEach((r, j) => {
      if (r.decodes_per_token === null) return;
      root.appendChild(svg("circle", { cx: x(r.decodes_per_token), cy: y + ((j % 3) - 1) * 4, r: 4, fill: colour(k),
                                       "fill-opacity": 0.7, class: "dot", "data-i": k * 100000 + j }));
    });
  });
  root.appendChild(svg("line", { x1: x(1), x2: x(1), y1: 10, y2: H - 14, stroke: "#1d2230", "stroke-dasharray": "4 3" }));
  root.appendChild(svg("text", { x: x(1) - 4, y: H - 2, "font-size": 11, fill: "#5d6475", "text-anchor": "end" },
                       "1 decode per token: no speculation"));
  return root;
}

function table(settings) {
  const head = ["setting", "predicted tok/s", "speed-up", "acceptance", "expected", "decodes/token (prompt incl.)", "drafted", "accepted"];
  const t = el("table", { class: "steps ranked" }, el("thead", {}, el("tr", {}, ...head.map((h) => el("th", {}, h)))));
  const body = el("tbody");
  for (const s of settings) {
    body.appendChild(el("tr", { class: s.baseline ? "baseline" : null },
      el("td", {}, s.name), el("td", {}, fmt(s.tps, 1) + (s.tps_interval ? " [" + fmt(s.tps_interval[0], 1) + ", " + fmt(s.tps_interval[1], 1) + "]" : "")),
      el("td", {}, s.speedup === null ? "-" : s.speedup.toFixed(2) + "x"), el("td", {}, fmt(s.acceptance, 3)),
      el("td", {}, fmt(s.expected, 3)), el("td", {}, fmt(s.decodes_per_token, 3)), el("td", {}, s.drafted), el("td", {}, s.accepted)));
  }
  t.appendChild(body);
  return t;
}

function render() {
  const S = DATA.settings;
  app.appendChild(el("h1", {}, "spec-replay tune"));
  app.appendChild(el("div", { class: "cards" }, card("settings", S.length), card("records", DATA.records),
                     card("tokens (as recorded)", DATA.tokens)));
  app.appendChild(el("p", { class: "muted model" }, DATA.speed_model ? "Speed model: " + DATA.speed_model : "No speed model."));
  app.appendChild(table(S));
  app.appendChild(el("h2", {}, "Predicted speed-up against no speculation"));
  app.appendChild(speedChart(S));
  app.appendChild(el("h2", {}, "Acceptance by draft position (solid: counted; dashed: expected)"));
  app.appendChild(legend(S.map((s, k) => ["sw-" + k, s.name, s.name])));
  app.appendChild(positionChart(S));
  app.appendChild(el("h2", {}, "Target decodes per token after the first, record by record (the span timings.predicted_ms measures)"));
  app.appendChild(spreadChart(S));
  const notes = notesList(DATA.notes);
  if (notes) app.appendChild(notes);
  // swatches take the series colours
  app.querySelectorAll(".legend .sw").forEach((sw, k) => { sw.style.background = colour(k); });
  const dots = app.querySelector("svg.spread");
  tipsFor(dots, (i) => {
    const s = S[Math.floor(i / 100000)], r = s.records[i % 100000];
    return [["setting", s.name], ["record", r.record], ["tokens", r.tokens], ["decodes/token after the first", fmt(r.decodes_per_token, 3)],
            ["acceptance", fmt(r.acceptance, 3)]];
  });
  tipsFor(app.querySelector("svg.speed") || app, (i) => {
    const s = S.filter((x) => x.speedup !== null)[i];
    return [["setting", s.name], ["predicted tok/s", fmt(s.tps, 1)], ["speed-up", s.speedup.toFixed(3) + "x"]];
  });
  document.body.dataset.ready = "1";
}
render();
