// spec-replay trace page: per record, the emitted tokens coloured by provenance (hover: q, p, u and
// the values a fixed server would report) and the drafted/accepted counts of every step.
const KINDS = ["outside", "accepted", "resampled", "bonus"];
const KIND_LABEL = { outside: "outside the loop", accepted: "accepted draft", resampled: "resampled", bonus: "bonus" };

function verdictOf(r) {
  if (r.reproduced === true) return el("span", { class: "verdict good" }, "reproduced");
  if (r.reproduced === false) {
    const where = r.first_divergence === null ? "draft totals differ" : "diverges at token " + r.first_divergence;
    return el("span", { class: "verdict bad" }, "not reproduced: " + where);
  }
  return el("span", { class: "verdict none" }, "no transcript to compare");
}

function tokenRows(r, t) {
  const rows = [["token", "#" + t.i + " (id " + t.id + ", step " + t.step + ")"], ["piece", pieceNode(t.piece)],
                ["provenance", KIND_LABEL[t.kind]]];
  if (t.kind === "resampled" && t.rejected_piece !== null) rows.push(["rejected draft", pieceNode(t.rejected_piece)]);
  if (t.q !== null) rows.push([t.kind === "resampled" ? "q (rejected)" : "q (draft)", fmt(t.q)]);
  if (t.p !== null) rows.push([t.kind === "resampled" ? "p (rejected)" : "p (target)", fmt(t.p)]);
  if (t.u !== null) rows.push(["u", t.u.map((u) => fmt(u)).join(", ") + (t.u.length > 1 ? "  (accept, residual)" : "")]);
  rows.push(["logprob", fmt(t.logprob)], ["post p", fmt(t.post_p)], ["top (pre)", topNode(t.top)]);
  if (r.first_divergence === t.i) rows.push(["divergence", r.divergence || "the transcript has another token here"]);
  return rows;
}

function stepTable(r) {
  const maxDraft = Math.max(1, ...r.steps.map((s) => s.drafted));
  const body = el("tbody");
  const frag = document.createDocumentFragment();
  for (const s of r.steps) {
    const bar = el("td", { class: "bar" });
    const a = s.accepted, rej = s.drafted - s.accepted;
    if (a) bar.appendChild(el("i", { class: "a", style: "width:" + (100 * a / maxDraft) + "%" }));
    if (rej) bar.appendChild(el("i", { class: "r", style: "width:" + (100 * rej / maxDraft) + "%" }));
    frag.appendChild(el("tr", {}, el("td", {}, s.index), el("td", {}, s.pos0), el("td", {}, s.drafter || "-"),
      el("td", {}, s.rule), el("td", {}, s.drafted), el("td", {}, s.accepted), bar,
      el("td", {}, s.resampled !== null ? "resampled " + JSON.stringify(s.resampled) :
                   s.bonus !== null ? "bonus " + JSON.stringify(s.bonus) : "-")));
  }
  body.appendChild(frag);
  return el("table", { class: "steps" },
    el("thead", {}, el("tr", {}, ...["step", "pos", "drafter", "rule", "drafted", "accepted", "accepted / rejected", "then"]
      .map((h) => el("th", {}, h)))), body);
}

function renderRecord(r, box) {
  const counts = Object.fromEntries(KINDS.map((k) => [k, 0]));
  for (const t of r.tokens) counts[t.kind] += 1;
  const drafting = r.steps.filter((s) => s.drafted > 0).length;
  box.appendChild(el("div", {}, verdictOf(r)));
  box.appendChild(el("div", { class: "cards" },
    card("tokens", r.tokens.length),
    card("drafted / accepted", r.draft_n + " / " + r.draft_n_accepted,
         r.server_draft_n !== null ? "server: " + r.server_draft_n + " / " + r.server_draft_n_accepted : null),
    card("acceptance", pct(r.draft_n ? r.draft_n_accepted / r.draft_n : null), drafting + " drafting steps"),
    card("placeholders a server sends", counts.accepted + counts.resampled + counts.bonus, "of " + r.tokens.length)));
  box.appendChild(legend(KINDS.map((k) => ["k-" + k, KIND_LABEL[k] + " (" + counts[k] + ")", DATA.provenance[k]])));
  box.appendChild(el("p", { class: "muted" }, "Each step starts at a thin bar; hover a token for its q (draft), " +
                     "p (target) and u (the uniform draw), and the logprob a fixed server would report."));
  const stream = el("div", { class: "stream", "data-testid": "stream" });
  const frag = document.createDocumentFragment();
  let prevStep = null;
  for (const t of r.tokens) {
    const cls = "tok k-" + t.kind + (t.step !== prevStep ? " s0" : "") + (r.first_divergence === t.i ? " diverged" : "");
    prevStep = t.step;
    frag.appendChild(el("span", { class: cls, "data-i": t.i, tabindex: 0 }, visible(t.piece)));
  }
  stream.appendChild(frag);
  tipsFor(stream, (i) => tokenRows(r, r.tokens[i]));
  box.appendChild(stream);
  if (r.divergence) box.appendChild(el("p", {}, "divergence: " + r.divergence));
  if (r.loop) box.appendChild(el("p", { class: "muted" }, "loop: " + r.loop));
  if (r.settings.length) {
    box.appendChild(el("p", { class: "muted" }, "settings: " +
      r.settings.map(([k, v, src]) => k + " " + JSON.stringify(v) + " (" + src + ")").join("; ")));
  }
  const notes = notesList(r.notes);
  if (notes) box.appendChild(notes);
  const steps = el("details", { "data-testid": "steps" },
                   el("summary", {}, r.steps.length + " steps: drafted and accepted per step"));
  steps.addEventListener("toggle", () => { if (steps.open && steps.children.length === 1) steps.appendChild(stepTable(r)); });
  box.appendChild(steps);
  if (r.steps.length <= 300) steps.open = true;  // a long trace's table is drawn when opened
}

function render() {
  app.replaceChildren(el("h1", {}, "spec-replay trace"));
  if (DATA.prompt !== null) app.appendChild(el("p", {}, "prompt: ", el("span", { class: "piece" }, DATA.prompt)));
  DATA.records.forEach((r, k) => {
    const sec = el("section", { "data-record": k });
    sec.appendChild(el("h2", {}, r.where));
    if (DATA.records.length === 1 || k === 0) { renderRecord(r, sec); app.appendChild(sec); return; }
    const d = el("details", {}, el("summary", {}, verdictOf(r), " " + r.tokens.length + " tokens"));
    d.addEventListener("toggle", () => { if (d.open && d.children.length === 1) renderRecord(r, d); });
    sec.appendChild(d);
    app.appendChild(sec);
  });
  document.body.dataset.ready = "1";
}
render();
