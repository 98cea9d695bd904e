// spec-replay recover page: per record, what the server sent against the true logprob of every
// token (placeholders marked), and the mean logprob and perplexity of both side by side.
const STATUS_LABEL = { ok: "real, checked", placeholder: "placeholder (recovered)", missing: "missing (recovered)",
                       mismatch: "disagrees", unaligned: "unaligned" };
// server (orange) and true (blue) logprob per token; a placeholder is a hollow orange dot at 0
function chart(r) {
  const W = 1000, H = 200, pad = 24, n = Math.max(1, r.tokens.length - 1);
  const vals = r.tokens.flatMap((t) => [t.server, t.true]).filter((v) => v !== null);
  const lo = Math.min(-1, ...vals), x = (i) => pad + (W - 2 * pad) * i / n, y = (v) => pad + (H - 2 * pad) * (v / lo);
  const root = svg("svg", { class: "chart", viewBox: "0 0 " + W + " " + H, preserveAspectRatio: "none", role: "img" });
  root.appendChild(svg("line", { x1: pad, x2: W - pad, y1: y(0), y2: y(0), stroke: "#aab2c5", "stroke-width": 1 }));
  for (const [key, cls] of [["true", "true"], ["server", "server"]]) {
    const pts = r.tokens.filter((t) => t[key] !== null).map((t) => x(t.i) + "," + y(t[key]).toFixed(1));
    root.appendChild(svg("polyline", { points: pts.join(" "), fill: "none", class: cls, "stroke-width": 1.5,
                                       "vector-effect": "non-scaling-stroke" }));
  }
  for (const t of r.tokens) {
    if (t.status === "placeholder") root.appendChild(svg("circle", { cx: x(t.i), cy: y(0), r: 3, fill: "none", class: "server", stroke: "#d9480f" }));
  }
  const label = svg("text", { x: pad, y: H - 6, "font-size": 11, fill: "#5d6475" });
  label.textContent = "logprob per token: server (orange; hollow dots: placeholders), true (blue); lowest " + lo.toFixed(2);
  root.appendChild(label);
  return root;
}

function tokenRows(t) {
  const rows = [["token", "#" + t.i + (t.id !== null ? " (id " + t.id + ")" : "")], ["piece", pieceNode(t.piece)],
                ["status", STATUS_LABEL[t.status] || t.status], ["server", fmt(t.server)], ["true", fmt(t.true)]];
  if (t.server !== null && t.true !== null && t.status !== "placeholder") rows.push(["|diff|", Math.abs(t.server - t.true).toExponential(1)]);
  rows.push(["true top", topNode(t.top)]);
  if (t.note) rows.push(["note", t.note]);
  return rows;
}

function renderRecord(r, box) {
  box.appendChild(el("p", { class: "muted" }, r.endpoint + (r.stream ? " (stream)" : "") + ", " +
    (r.field_kind === "prob" ? "post-sampling probabilities" : "pre-sampling logprobs")));
  if (r.error) box.appendChild(el("p", { class: "failure" }, r.error));
  const c = r.counts;
  box.appendChild(el("div", { class: "cards" },
    card("mean logprob", fmt(r.true_mean), "true; server " + fmt(r.server_mean)),
    card("perplexity", fmt(r.true_ppl, 3), "true; server " + fmt(r.server_ppl, 3)),
    card("tokens", r.n_tokens, c.placeholder + " placeholder, " + c.missing + " missing"),
    card("real values checked", c.ok, (c.mismatch + c.unaligned) + " disagree; max |diff| " +
         (r.max_abs_diff_real === null ? "-" : r.max_abs_diff_real.toExponential(1)))));
  if (r.tokens.length) box.appendChild(chart(r));
  box.appendChild(legend(Object.keys(STATUS_LABEL).filter((s) => s !== "unaligned")
    .map((s) => ["s-" + s, STATUS_LABEL[s] + " (" + c[s] + ")", ""])));
  const stream = el("div", { class: "stream", "data-testid": "stream" });
  const frag = document.createDocumentFragment();
  for (const t of r.tokens) frag.appendChild(el("span", { class: "tok s-" + t.status, "data-i": t.i, tabindex: 0 }, visible(t.piece)));
  stream.appendChild(frag);
  tipsFor(stream, (i) => tokenRows(r.tokens[i]));
  box.appendChild(stream);
  const notes = notesList(r.notes);
  if (notes) box.appendChild(notes);
}

function render() {
  app.replaceChildren(el("h1", {}, "spec-replay recover"));
  if (DATA.failure) app.appendChild(el("p", { class: "failure" }, DATA.failure));
  DATA.records.forEach((r, k) => {
    const sec = el("section", { "data-record": k });
    sec.appendChild(el("h2", {}, r.where));
    if (DATA.records.length === 1 || k === 0) { renderRecord(r, sec); app.appendChild(sec); return; }
    const d = el("details", {}, el("summary", {}, "mean logprob " + fmt(r.true_mean) + " true, " + fmt(r.server_mean) +
                                  " server; " + r.counts.placeholder + " placeholders"));
    d.addEventListener("toggle", () => { if (d.open && d.children.length === 1) renderRecord(r, d); });
    sec.appendChild(d);
    app.appendChild(sec);
  });
  document.body.dataset.ready = "1";
}
render();
