/* CGA Explorer page logic. Plain JS, no dependencies: it asks the server for numbers and draws them.
 * The attention arithmetic lives in Python (cgavit.attention); nothing here recomputes it. */
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const HEAD_COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f"];
const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];

function headColor(j) { return HEAD_COLORS[j % HEAD_COLORS.length]; }
/* readable text on a head's colour: dark on the light ones */
function inkOn(hex) {
  const n = parseInt(hex.slice(1), 16);
  return 0.299 * (n >> 16) + 0.587 * ((n >> 8) & 255) + 0.114 * (n & 255) > 162 ? "#1d2330" : "#ffffff";
}

function viridis(t) {
  t = Math.min(1, Math.max(0, t));
  const x = t * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const f = x - i;
  const c = VIRIDIS[i].map((v, k) => Math.round(v + f * (VIRIDIS[i + 1][k] - v)));
  return c;
}
function rgb(c, a) { return a === undefined ? `rgb(${c[0]},${c[1]},${c[2]})` : `rgba(${c[0]},${c[1]},${c[2]},${a})`; }

/* create an SVG element with attributes (and text), appended to parent */
function el(tag, attrs, parent, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) if (v !== null && v !== undefined) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}
function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
function $(id) { return document.getElementById(id); }
function niceMax(v) { return Math.max(0.05, Math.ceil(v * 20 - 1e-9) / 20); }

const BUSY_RETRIES = 2; // a GET answered 503 with a Retry-After (the server busy for a moment) is asked again this often
const MAX_RETRY_AFTER_S = 10; // a longer Retry-After is not waited for: the user is told at once

function sleep(ms) { return new Promise((resolve) => setTimeout(resolve, ms)); }

/* the seconds a 503's Retry-After asks to wait before asking again, or null (another status, no such header, a date,
 * or longer than the page waits) */
function retryAfter(res) {
  const text = (res.headers.get("Retry-After") || "").trim();
  if (res.status !== 503 || !/^[0-9]{1,5}$/.test(text)) return null;
  const seconds = Number(text);
  return seconds <= MAX_RETRY_AFTER_S ? seconds : null;
}

/* The JSON of a request, or an Error saying what went wrong in words. A GET the server was too busy for (503 with
 * Retry-After) is asked again after the seconds it asks for, up to BUSY_RETRIES times, before the error is shown. */
async function getJSON(url, init) {
  const again = !init || !init.method || init.method === "GET";
  for (let attempt = 0; ; attempt++) {
    let res;
    try {
      res = await fetch(url, init);
    } catch (err) { // no HTTP answer at all: the browser says only "Failed to fetch"
      throw new Error("no answer from the explorer: is cgavit explore still running? (it also cuts off a request that takes too long)");
    }
    const wait = again && attempt < BUSY_RETRIES ? retryAfter(res) : null;
    if (wait !== null) {
      await sleep(1000 * wait);
      continue;
    }
    let body = null;
    try { body = await res.json(); } catch (e) { body = null; }
    if (res.ok) return body;
    if (body && body.error) throw new Error(body.error);
    throw new Error(res.status === 503 ? "the explorer is busy (HTTP 503); retry in a moment" : `HTTP ${res.status}`);
  }
}

/* ---------------------------------------------------------------- six tokens */
const state = { heads: 4, cascade: true, groups: true, seed: 0, head: 0, cascadeWanted: true };
let toyData = null;
let toySeq = 0;

function toyQuery() {
  return `heads=${state.heads}&cascade=${state.cascade ? 1 : 0}&groups=${state.groups ? 1 : 0}&seed=${state.seed}`;
}

async function refreshToy() {
  const seq = ++toySeq;
  const q = toyQuery();
  const main = $("toy");
  main.dataset.busy = "1";
  main.classList.add("busy");
  try {
    const data = await getJSON(`/api/cga?${q}`);
    if (seq !== toySeq) return; // a newer request is on its way
    toyData = data;
    state.head = Math.min(state.head, data.heads - 1);
    renderToy();
    $("status").textContent = data.module;
    $("status").classList.remove("error");
    main.dataset.state = q;
  } catch (err) {
    if (seq !== toySeq) return;
    if (toyData) { // the panels still show the last setting that was answered: so do the controls
      Object.assign(state, { heads: toyData.heads, cascade: toyData.cascade, groups: toyData.groups, seed: toyData.seed });
      renderControls();
    }
    $("status").textContent = `error: ${err.message}`;
    $("status").classList.add("error");
    main.dataset.state = `error:${q}`;
  } finally {
    if (seq === toySeq) { main.dataset.busy = "0"; main.classList.remove("busy"); }
  }
}

function segButtons(container, items, pressed, onPick, decorate) {
  // rebuild only when the set of items changes, so focus and layout stay put
  const key = items.map((it) => it.label).join("|");
  if (container.dataset.key !== key) {
    clear(container);
    items.forEach((it, i) => {
      const b = document.createElement("button");
      b.type = "button";
      b.textContent = it.label;
      b.dataset.value = String(it.value);
      b.setAttribute("role", "radio");
      b.addEventListener("click", () => onPick(it.value));
      if (decorate) decorate(b, i);
      container.appendChild(b);
    });
    container.dataset.key = key;
  }
  for (const b of container.children) {
    const on = b.dataset.value === String(pressed);
    b.setAttribute("aria-pressed", on ? "true" : "false");
    b.setAttribute("aria-checked", on ? "true" : "false");
  }
}

function renderControls() {
  const choices = toyData ? toyData.head_choices : [1, 2, 3, 4, 6, 8];
  segButtons($("heads"), choices.map((h) => ({ label: String(h), value: h })), state.heads, (h) => {
    state.heads = h;
    refreshToy();
    renderControls();
  });
  const n = toyData ? toyData.heads : state.heads;
  const heads = Array.from({ length: n }, (_, j) => ({ label: `H${j + 1}`, value: j }));
  segButtons($("head-pick"), heads, state.head, selectHead, (b, i) => { b.style.borderLeftColor = headColor(i); });
  const cascade = $("cascade");
  cascade.disabled = !state.groups;
  cascade.checked = state.cascade;
  $("cascade-wrap").classList.toggle("disabled", !state.groups);
  $("cascade-wrap").title = state.groups ? "" : "the cascade needs channel groups";
  $("cascade-note").textContent = state.groups ? "" : "needs channel groups";
  $("groups").checked = state.groups;
  $("seed").value = String(state.seed);
}

function selectHead(j) {
  state.head = j;
  renderControls();
  if (toyData) renderToy();
}

function renderToy() {
  renderControls();
  renderSlices(toyData);
  renderHeatmap(toyData);
  renderSimBars($("simbars"), $("sim-box"), toyData.similarity, state.head, toyData.mean_similarity);
}

/* panel 1: channel slices and the cascade */
function renderSlices(d) {
  const svg = $("slices");
  const W = Math.max(320, Math.round($("slices-box").clientWidth));
  const H = 178;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  clear(svg);
  const defs = el("defs", {}, svg);
  const marker = el("marker", { id: "arrow", viewBox: "0 0 10 10", refX: "8", refY: "5", markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse" }, defs);
  el("path", { d: "M0,0 L10,5 L0,10 z", fill: "#3a4252" }, marker);

  const pad = 14, C = d.channels, cw = (W - 2 * pad) / C;
  const stripY = 26, stripH = 18, boxY = 92, boxH = 46;
  el("text", { x: pad, y: 16, class: "axis" }, svg, `input tokens: C = ${C} channels`);
  el("text", { x: W - pad, y: 16, class: "axis", "text-anchor": "end" }, svg,
    d.groups ? `${C / d.heads} channels per head` : "every head reads all channels");
  const owner = (c) => (d.groups ? Math.floor(c / (C / d.heads)) : -1);
  for (let c = 0; c < C; c++) {
    el("rect", {
      x: (pad + c * cw + 0.5).toFixed(2), y: stripY, width: Math.max(1, cw - 1).toFixed(2), height: stripH, rx: 2,
      fill: owner(c) >= 0 ? headColor(owner(c)) : "#9aa3b5",
    }, svg);
  }
  // slice boundaries under the strip
  const bounds = d.groups ? d.slices.map((s) => s.start).concat([C]) : [0, C];
  for (const b of bounds) {
    el("text", { x: pad + b * cw, y: stripY + stripH + 13, class: "tick", "text-anchor": "middle" }, svg, String(b));
  }
  const boxes = d.slices.map((s, j) => {
    let x0, x1;
    if (d.groups) { x0 = pad + s.start * cw + 2; x1 = pad + s.stop * cw - 2; }
    else { const bw = (W - 2 * pad) / d.heads; x0 = pad + j * bw + 3; x1 = pad + (j + 1) * bw - 3; }
    return { x0, x1, cx: (x0 + x1) / 2, s };
  });
  // fans from the channels a head reads to the head
  boxes.forEach((b, j) => {
    const sx0 = pad + b.s.start * cw, sx1 = pad + b.s.stop * cw;
    el("polygon", {
      points: `${sx0},${stripY + stripH + 16} ${sx1},${stripY + stripH + 16} ${b.x1},${boxY} ${b.x0},${boxY}`,
      fill: headColor(j), "fill-opacity": d.groups ? 0.16 : 0.1,
    }, svg);
  });
  boxes.forEach((b, j) => {
    const g = el("g", { class: "headbox", "data-head": j, cursor: "pointer" }, svg);
    const w = b.x1 - b.x0;
    el("rect", {
      x: b.x0, y: boxY, width: w, height: boxH, rx: 6, fill: headColor(j),
      stroke: j === state.head ? "#1d2330" : "none", "stroke-width": 3,
    }, g);
    el("text", { x: b.cx, y: boxY + (w >= 34 ? 19 : 28), "text-anchor": "middle", fill: inkOn(headColor(j)), "font-weight": 700, "font-size": 14 }, g, `H${j + 1}`);
    if (w >= 34) {
      const range = `${b.s.start}–${b.s.stop - 1}`;
      el("text", { x: b.cx, y: boxY + 36, "text-anchor": "middle", fill: inkOn(headColor(j)), "font-size": 11 }, g, w >= 62 ? `ch ${range}` : range);
    }
    el("title", {}, g, `head ${j + 1}: channels ${b.s.start}–${b.s.stop - 1}${b.s.reads_previous ? " + output of head " + j : ""}`);
    g.addEventListener("click", () => selectHead(j));
  });
  const yArc = boxY + boxH;
  if (d.cascade) {
    for (let j = 0; j + 1 < boxes.length; j++) {
      const a = boxes[j], b = boxes[j + 1];
      const x1 = a.cx + Math.min(8, (a.x1 - a.x0) / 4), x2 = b.cx - Math.min(8, (b.x1 - b.x0) / 4);
      el("path", {
        d: `M${x1},${yArc + 2} C${x1},${yArc + 34} ${x2},${yArc + 34} ${x2},${yArc + 5}`,
        fill: "none", stroke: "#3a4252", "stroke-width": 2, "marker-end": "url(#arrow)", class: "cascade-arrow",
      }, svg);
    }
  }
  const per = C / d.heads;
  $("slices-cap").textContent = d.heads === 1
    ? `One head reads all ${C} channels: nothing to split or cascade. `
    : !d.groups
      ? `No channel groups: every head reads all ${C} channels (standard multi-head attention), so there is no slice to cascade into. Click a head to inspect it.`
      : d.cascade
        ? `Each head reads its own ${per} of the ${C} channels; each arrow adds head j's output to head j+1's slice before its Q/K/V projection. Click a head to inspect it.`
        : `Each head reads only its own ${per} of the ${C} channels; with the cascade off no head sees another's output. Click a head to inspect it.`;
}

/* panel 2: the selected head's 6x6 attention map */
function renderHeatmap(d) {
  const svg = $("heatmap");
  clear(svg);
  const j = state.head;
  $("map-head").textContent = String(j + 1);
  $("map-head").style.color = headColor(j);
  const map = d.maps[j];
  const n = map.length;
  const vmax = niceMax(Math.max(...d.maps.flat(2)));
  const left = 78, top = 56, cell = 46;
  el("text", { x: left + (n * cell) / 2, y: 18, "text-anchor": "middle", class: "axis" }, svg, "key token (attended to) →");
  el("text", { x: 20, y: top + (n * cell) / 2, "text-anchor": "middle", class: "axis", transform: `rotate(-90 20 ${top + (n * cell) / 2})` }, svg, "query token (attending) →");
  for (let i = 0; i < n; i++) {
    el("text", { x: left + i * cell + cell / 2, y: top - 10, "text-anchor": "middle", class: "tick" }, svg, `t${i + 1}`);
    el("text", { x: left - 10, y: top + i * cell + cell / 2 + 4, "text-anchor": "end", class: "tick" }, svg, `t${i + 1}`);
  }
  const g = el("g", { id: "cells" }, svg);
  for (let q = 0; q < n; q++) {
    for (let k = 0; k < n; k++) {
      const v = map[q][k];
      const c = viridis(v / vmax);
      const x = left + k * cell, y = top + q * cell;
      const r = el("rect", { x: x + 1, y: y + 1, width: cell - 2, height: cell - 2, rx: 3, fill: rgb(c), class: "cell", "data-q": q, "data-k": k, "data-value": String(v) }, g);
      el("title", {}, r, `query t${q + 1} → key t${k + 1}: ${v.toFixed(4)}`);
      const light = (0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2]) > 150;
      el("text", { x: x + cell / 2, y: y + cell / 2 + 5, "text-anchor": "middle", class: "cell-val", fill: light ? "#1d2330" : "#ffffff", "data-q": q, "data-k": k }, g, v.toFixed(2));
    }
  }
  // legend: the colour scale, shared by all heads of this setting
  const ly = top + n * cell + 18, lw = n * cell;
  const defs = el("defs", {}, svg);
  const grad = el("linearGradient", { id: "legend-grad", x1: "0", x2: "1", y1: "0", y2: "0" }, defs);
  for (let s = 0; s <= 10; s++) el("stop", { offset: `${s * 10}%`, "stop-color": rgb(viridis(s / 10)) }, grad);
  el("rect", { x: left, y: ly, width: lw, height: 12, rx: 2, fill: "url(#legend-grad)" }, svg);
  el("text", { x: left - 10, y: ly + 10, "text-anchor": "end", class: "tick" }, svg, "weight");
  [0, 0.5, 1].forEach((f) => {
    el("text", { x: left + f * lw, y: ly + 28, "text-anchor": f === 0 ? "start" : f === 1 ? "end" : "middle", class: "tick", id: f === 1 ? "legend-max" : null }, svg, (f * vmax).toFixed(2));
  });
  el("text", { x: left + lw / 2, y: ly + 42, "text-anchor": "middle", class: "axis" }, svg, "colour scale shared by all heads");
}

/* panel 3 (and the image section): pairwise head-similarity bars */
function renderSimBars(svg, box, sim, selected, mean) {
  const W = Math.max(300, Math.round(box.clientWidth));
  const H = 236;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  clear(svg);
  const h = sim.length;
  const left = 40, right = 12, top = 30, plotH = 146, base = top + plotH;
  const plotW = W - left - right;
  for (const t of [0, 0.25, 0.5, 0.75, 1]) {
    const y = base - t * plotH;
    el("line", { x1: left, x2: W - right, y1: y, y2: y, stroke: t === 0 ? "#9aa3b5" : "#e6e9ef" }, svg);
    el("text", { x: left - 6, y: y + 4, "text-anchor": "end", class: "tick" }, svg, t.toFixed(2).replace(/0$/, ""));
  }
  el("text", { x: 4, y: 12, class: "axis" }, svg, "cosine similarity");
  if (h < 2) {
    el("text", { x: left + plotW / 2, y: top + plotH / 2, "text-anchor": "middle", class: "axis" }, svg, "one head: no pairs to compare");
    return;
  }
  const pairs = [];
  for (let i = 0; i < h; i++) for (let j = i + 1; j < h; j++) pairs.push([i, j]);
  const slot = plotW / pairs.length;
  const bw = Math.min(slot * 0.72, 46);
  const showValues = slot >= 30;
  const g = el("g", { class: "bars" }, svg);
  pairs.forEach(([i, j], k) => {
    const v = sim[i][j];
    const x = left + k * slot + (slot - bw) / 2;
    const y = base - Math.max(0, v) * plotH;
    const hot = selected === null || i === selected || j === selected;
    const bar = el("g", { class: "bar", "data-pair": `${i + 1}-${j + 1}`, "data-value": String(v), opacity: hot ? 1 : 0.3 }, g);
    el("rect", { x, y, width: bw / 2, height: base - y, fill: headColor(i) }, bar);
    el("rect", { x: x + bw / 2, y, width: bw / 2, height: base - y, fill: headColor(j) }, bar);
    el("title", {}, bar, `heads ${i + 1} and ${j + 1}: ${v.toFixed(4)}`);
    if (showValues) el("text", { x: x + bw / 2, y: y - 4, "text-anchor": "middle", class: "tick bar-val" }, bar, v.toFixed(2));
    el("text", { x: x + bw / 2, y: base + 14, "text-anchor": "middle", class: "tick", fill: headColor(i) }, bar, String(i + 1));
    el("text", { x: x + bw / 2, y: base + 27, "text-anchor": "middle", class: "tick", fill: headColor(j) }, bar, String(j + 1));
  });
  el("text", { x: left - 6, y: base + 14, "text-anchor": "end", class: "axis" }, svg, "head");
  el("text", { x: left - 6, y: base + 27, "text-anchor": "end", class: "axis" }, svg, "with");
  if (mean !== null && mean !== undefined) {
    const y = base - mean * plotH;
    el("line", { x1: left, x2: W - right, y1: y, y2: y, stroke: "#1d2330", "stroke-dasharray": "5 4", "stroke-width": 1.2 }, svg);
    el("text", { x: W - right, y: top - 8, "text-anchor": "end", class: "tick", id: `${svg.id}-mean`, "data-value": String(mean) }, svg, `mean ${mean.toFixed(3)}`);
  }
  el("text", { x: left + plotW / 2, y: H - 4, "text-anchor": "middle", class: "axis" }, svg, `${pairs.length} pair${pairs.length > 1 ? "s" : ""} of heads`);
}

/* ---------------------------------------------------------------- a real block over an image */
const real = { info: null, imageId: null, preview: null, block: 0, mode: "query", query: null, data: null };
let realAsking = false; // an attention request is in flight
let realAgain = false; // the block, mode or query changed while it was: its answer is stale, ask again

/* the model and its blocks; returns null, or why they did not load */
async function loadModelInfo() {
  try {
    real.info = await getJSON("/api/model");
  } catch (err) {
    $("about").textContent = `unavailable (${err.message})`;
    return err.message;
  }
  $("about").textContent = real.info.about;
  const sel = $("block");
  clear(sel);
  real.info.blocks.forEach((b) => {
    const o = document.createElement("option");
    o.value = String(b.index);
    o.textContent = `stage ${b.stage} · block ${b.block} — ${b.channels} ch, ${b.heads} heads, ${b.grid[0]}×${b.grid[1]} tokens, window ${b.window}`;
    sel.appendChild(o);
  });
  showPlaceholder("Upload an image to see each head's attention over it.");
  const sim = $("real-sim");
  const W = Math.max(300, Math.round($("real-sim-box").clientWidth));
  sim.setAttribute("viewBox", `0 0 ${W} 236`);
  clear(sim);
  el("text", { x: W / 2, y: 118, "text-anchor": "middle", class: "axis" }, sim, "the block's head similarity appears here");
  return null;
}

function showPlaceholder(text, isError) {
  const grid = $("head-grid");
  clear(grid);
  const p = document.createElement("div");
  p.className = "placeholder" + (isError ? " error" : "");
  p.textContent = text;
  grid.appendChild(p);
}

async function upload(file) {
  const failed = real.info ? null : await loadModelInfo(); // it did not load with the page (a busy server): again now
  if (failed) {
    $("real-status").textContent = `error: the model's blocks did not load (${failed}); choose the image again in a moment`;
    $("real-status").classList.add("error");
    return;
  }
  const max = real.info.max_upload_bytes;
  if (file.size > max) {
    $("real-status").textContent = `error: ${(file.size / 1048576).toFixed(1)} MiB is over the ${(max / 1048576).toFixed(0)} MiB limit; choose a smaller image`;
    $("real-status").classList.add("error");
    return;
  }
  const section = $("real");
  section.dataset.busy = "1";
  $("real-status").textContent = "uploading…";
  try {
    const res = await getJSON("/api/image", { method: "POST", body: file, headers: { "Content-Type": file.type || "application/octet-stream" } });
    real.imageId = res.image_id;
    real.preview = await loadImage(res.preview);
    real.query = null;
    await refreshReal();
  } catch (err) {
    $("real-status").textContent = `error: ${err.message}`;
    $("real-status").classList.add("error");
    section.dataset.state = "error";
  } finally {
    if (!realAsking) section.dataset.busy = "0";
  }
}

function loadImage(src) {
  return new Promise((resolve, reject) => {
    const img = new Image();
    img.onload = () => resolve(img);
    img.onerror = () => reject(new Error("preview did not load"));
    img.src = src;
  });
}

function blockInfo() { return real.info.blocks[real.block]; }

/* One attention request at a time: a large model takes seconds a request and the server computes one at a time, so
 * clicks that each sent their own request queued up there until the last was cut off at the request time limit.
 * Changes made while one is in flight are asked for together, once it ends. */
async function refreshReal() {
  if (!real.imageId) return;
  if (realAsking) { realAgain = true; return; }
  realAsking = true;
  try {
    do {
      realAgain = false;
      await askReal();
    } while (realAgain);
  } finally {
    realAsking = false;
    $("real").dataset.busy = "0";
    $("real").classList.remove("busy");
  }
}

/* the maps of the current block, mode and query; drawn unless they changed meanwhile */
async function askReal() {
  const b = blockInfo();
  if (real.query === null || real.query >= b.grid[0] * b.grid[1]) {
    real.query = Math.floor(b.grid[0] / 2) * b.grid[1] + Math.floor(b.grid[1] / 2); // centre token
  }
  const q = `image=${real.imageId}&block=${real.block}&query=${real.mode === "mean" ? "mean" : real.query}`;
  const section = $("real");
  section.dataset.busy = "1";
  section.classList.add("busy");
  try {
    const data = await getJSON(`/api/attention?${q}`);
    if (realAgain) return;
    real.data = data;
    renderReal();
    const s = $("real-status");
    s.classList.remove("error");
    const what = real.mode === "mean" ? "mean attention received, per window" : `query token (${Math.floor(real.query / data.grid[1])}, ${real.query % data.grid[1]}) of ${data.grid[0]}×${data.grid[1]}`;
    const pad = data.padding_share ? Math.max(...data.padding_share) : 0;
    const padText = pad > 0.005 ? `; up to ${(100 * pad).toFixed(0)}% of this query's attention falls on the zero padding past the map's edge` : "";
    s.textContent = `stage ${data.stage} · block ${data.block_in_stage}: ${what}; mean head similarity ${data.mean_similarity === null ? "–" : data.mean_similarity.toFixed(3)}${padText}`;
    section.dataset.state = q;
  } catch (err) {
    if (realAgain) return;
    if (real.data) { // the maps still show the last answered block and query: so do the controls
      real.block = real.data.block;
      real.mode = real.data.query === null ? "mean" : "query";
      if (real.data.query !== null) real.query = real.data.query;
      $("block").value = String(real.block);
      markMode();
    }
    $("real-status").textContent = `error: ${err.message}`;
    $("real-status").classList.add("error");
    section.dataset.state = `error:${q}`;
  }
}

function realMax(d) {
  let m = 0;
  for (const head of d.maps) for (const row of head) for (const v of row) if (v !== null && v > m) m = v;
  return m;
}

function renderReal() {
  const d = real.data;
  const grid = $("head-grid");
  if (grid.children.length !== d.heads || !grid.querySelector("canvas")) {
    clear(grid);
    const [imgH, imgW] = real.info.img_size; // the model's view, which the preview is: not always square
    for (let j = 0; j < d.heads; j++) {
      const fig = document.createElement("figure");
      const cv = document.createElement("canvas");
      cv.width = 224; cv.height = Math.max(1, Math.round((224 * imgH) / imgW));
      cv.addEventListener("click", (ev) => pickToken(ev, cv));
      const cap = document.createElement("figcaption");
      fig.appendChild(cv); fig.appendChild(cap);
      grid.appendChild(fig);
    }
  }
  const vmax = realMax(d) || 1;
  const [H, W] = d.grid;
  [...grid.children].forEach((fig, j) => {
    const cv = fig.querySelector("canvas");
    const ctx = cv.getContext("2d");
    const ch = cv.height / H, cw = cv.width / W;
    ctx.clearRect(0, 0, cv.width, cv.height);
    ctx.drawImage(real.preview, 0, 0, cv.width, cv.height);
    let hmax = 0, hsum = 0;
    for (let y = 0; y < H; y++) {
      for (let x = 0; x < W; x++) {
        const v = d.maps[j][y][x];
        if (v === null) { ctx.fillStyle = "rgba(15,18,26,0.5)"; }
        else {
          hmax = Math.max(hmax, v); hsum += v;
          ctx.fillStyle = rgb(viridis(v / vmax), 0.25 + 0.6 * (v / vmax));
        }
        ctx.fillRect(x * cw, y * ch, cw, ch);
      }
    }
    ctx.lineWidth = 1;
    ctx.strokeStyle = "rgba(255,255,255,0.7)";
    for (const [y0, x0, bh, bw] of d.windows) ctx.strokeRect(x0 * cw + 0.5, y0 * ch + 0.5, bw * cw - 1, bh * ch - 1);
    if (d.query !== null) {
      const qy = Math.floor(d.query / W), qx = d.query % W;
      ctx.lineWidth = 3; ctx.strokeStyle = "#ffffff";
      ctx.strokeRect(qx * cw + 1.5, qy * ch + 1.5, cw - 3, ch - 3);
      ctx.lineWidth = 1; ctx.strokeStyle = "#e15759";
      ctx.strokeRect(qx * cw + 1.5, qy * ch + 1.5, cw - 3, ch - 3);
    }
    fig.dataset.head = String(j);
    fig.dataset.max = String(hmax);
    fig.dataset.sum = String(hsum);
    const cap = fig.querySelector("figcaption");
    cap.textContent = `head ${j + 1} · max ${hmax.toFixed(3)}`;
    cap.style.color = headColor(j);
  });
  renderSimBars($("real-sim"), $("real-sim-box"), d.similarity, null, d.mean_similarity);
  renderLegend($("real-legend"), vmax, real.mode === "mean" ? "mean attention received" : "attention from the query token");
}

/* a horizontal colour bar 0 .. vmax, as wide as its box */
function renderLegend(svg, vmax, label) {
  const W = Math.max(240, Math.round(svg.parentNode.clientWidth));
  svg.setAttribute("viewBox", `0 0 ${W} 46`);
  clear(svg);
  const defs = el("defs", {}, svg);
  const grad = el("linearGradient", { id: `${svg.id}-grad`, x1: "0", x2: "1", y1: "0", y2: "0" }, defs);
  for (let s = 0; s <= 10; s++) el("stop", { offset: `${s * 10}%`, "stop-color": rgb(viridis(s / 10)) }, grad);
  const x0 = 8, w = Math.min(260, W - 16);
  el("rect", { x: x0, y: 4, width: w, height: 10, rx: 2, fill: `url(#${svg.id}-grad)` }, svg);
  el("text", { x: x0, y: 27, class: "tick" }, svg, "0");
  el("text", { x: x0 + w, y: 27, "text-anchor": "end", class: "tick", id: `${svg.id}-max`, "data-value": String(vmax) }, svg, vmax.toFixed(3));
  const note = real.mode === "query" && W >= 600 ? "; dimmed: outside the query's window" : "";
  el("text", { x: x0, y: 42, class: "axis" }, svg, `colour: ${label}, shared by all heads${note}`);
}

function pickToken(ev, cv) {
  if (!real.data) return;
  const r = cv.getBoundingClientRect();
  const [H, W] = real.data.grid;
  const x = Math.min(W - 1, Math.floor(((ev.clientX - r.left) / r.width) * W));
  const y = Math.min(H - 1, Math.floor(((ev.clientY - r.top) / r.height) * H));
  real.query = y * W + x;
  setMode("query");
}

function setMode(mode) {
  real.mode = mode;
  markMode();
  refreshReal();
}

function markMode() {
  for (const b of $("mode").children) b.setAttribute("aria-pressed", b.dataset.mode === real.mode ? "true" : "false");
}

/* ---------------------------------------------------------------- wiring */
function init() {
  $("groups").addEventListener("change", (e) => {
    state.groups = e.target.checked;
    state.cascade = state.groups ? state.cascadeWanted : false;
    renderControls();
    refreshToy();
  });
  $("cascade").addEventListener("change", (e) => {
    state.cascade = e.target.checked;
    state.cascadeWanted = state.cascade;
    refreshToy();
  });
  $("seed").addEventListener("change", (e) => {
    const v = Number(e.target.value); // what the number field holds: "1e3" is 1000 (parseInt read 1)
    state.seed = Number.isFinite(v) && v >= 0 ? Math.min(Math.floor(v), 2147483647) : 0;
    refreshToy();
  });
  $("reseed").addEventListener("click", () => {
    state.seed = Math.floor(Math.random() * 100000);
    refreshToy();
  });
  $("upload").addEventListener("change", (e) => {
    const file = e.target.files[0];
    e.target.value = ""; // so choosing the same file again (after an error, or a restarted server) uploads it again
    if (file) upload(file);
  });
  $("block").addEventListener("change", (e) => { real.block = parseInt(e.target.value, 10); real.query = null; refreshReal(); });
  for (const b of $("mode").children) b.addEventListener("click", () => setMode(b.dataset.mode));
  let timer = null;
  window.addEventListener("resize", () => {
    clearTimeout(timer);
    timer = setTimeout(() => {
      if (toyData) renderToy();
      if (real.data) renderReal();
    }, 80);
  });
  renderControls();
  refreshToy();
  loadModelInfo();
}

document.addEventListener("DOMContentLoaded", init);
