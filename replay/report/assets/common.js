"use strict";
// Shared by both pages: the data, DOM helpers (text only: nothing from the data is ever parsed as
// markup), number formats, and one tooltip driven by event delegation (no listener per token).
const DATA = JSON.parse(document.getElementById("data").textContent);
const app = document.getElementById("app");
const tip = document.getElementById("tip");

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v; else e.setAttribute(k, String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    e.appendChild(typeof c === "object" ? c : document.createTextNode(String(c)));
  }
  return e;
}

function fmt(x, digits = 4) { return (x === null || x === undefined) ? "-" : Number(x).toFixed(digits); }
function pct(x) { return (x === null || x === undefined) ? "-" : (100 * x).toFixed(1) + "%"; }

// A token's text as it reads in a stream: control characters made visible, the text itself as text.
function visible(piece) {
  return piece.replace(/\n/g, "\u21b5\n").replace(/\t/g, "\u2192\t").replace(/\r/g, "\u240d");
}

function card(label, value, sub) {
  return el("div", { class: "card" }, el("div", { class: "k" }, label),
            el("div", { class: "v" }, value, sub ? el("small", {}, " " + sub) : null));
}

function legend(entries) {
  const box = el("div", { class: "legend" });
  for (const [cls, label, title] of entries) {
    box.appendChild(el("span", { title }, el("span", { class: "sw " + cls }), label));
  }
  return box;
}

// rows: [label, value] pairs; a value may be a Node
function showTip(rows, x, y) {
  const t = el("table");
  for (const [k, v] of rows) t.appendChild(el("tr", {}, el("td", {}, k), el("td", {}, v)));
  tip.replaceChildren(t);
  tip.hidden = false;
  const w = tip.offsetWidth, h = tip.offsetHeight;
  tip.style.left = Math.max(4, Math.min(x + 14, window.innerWidth - w - 4)) + "px";
  tip.style.top = (y + 18 + h > window.innerHeight ? Math.max(4, y - h - 10) : y + 18) + "px";
}
function hideTip() { tip.hidden = true; }

// Hover (and keyboard focus) over any [data-i] inside `container` calls rowsOf(index) for the tip.
function tipsFor(container, rowsOf) {
  const show = (ev) => {
    const t = ev.target.closest("[data-i]");
    if (!t || !container.contains(t)) return;
    const r = t.getBoundingClientRect();
    showTip(rowsOf(Number(t.dataset.i), t), ev.clientX || r.left, ev.clientY || r.bottom);
  };
  container.addEventListener("mouseover", show);
  container.addEventListener("focusin", show);
  container.addEventListener("mouseleave", hideTip);
  container.addEventListener("focusout", hideTip);
}

function pieceNode(piece) { return el("span", { class: "piece" }, JSON.stringify(piece)); }

function topNode(top) {
  return top && top.length ? el("span", { class: "piece" }, top.map(([p, lp]) => JSON.stringify(p) + " " + fmt(lp, 3)).join(", ")) : "-";
}

function notesList(notes) {
  if (!notes || !notes.length) return null;
  return el("ul", { class: "notes" }, ...notes.map((n) => el("li", {}, n)));
}

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = String(text);
  return e;
}
