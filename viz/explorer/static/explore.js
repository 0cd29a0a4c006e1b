// The explorer's page. It only draws: every number on it comes from the server (deriv explore, which runs the
// folder's own model, tokenizer, logits processors and cache). Nothing here computes a probability or a weight.
"use strict";

const $ = (id) => document.getElementById(id);

const state = {
  info: null,
  ids: null, // the ids shown, once greedy/sample appended to them (null: the prompt's text is the input)
  targetIds: null, // the same for a translation folder's target
  analysis: null,
  query: null, // the attention row that is outlined and listed
  typedAt: null, // performance.now() of the last keystroke or control move not yet drawn
};

// --- requests ----------------------------------------------------------------------------------------------

const timers = {};
let inflight = 0;
let latestView = 0; // analyze and next replies older than the latest request of either are dropped

function markBusy() {
  document.body.dataset.busy = inflight + Object.keys(timers).length > 0 ? "1" : "0";
}

function later(name, action, ms = 150) {
  clearTimeout(timers[name]);
  timers[name] = setTimeout(() => {
    delete timers[name];
    action();
    markBusy();
  }, ms);
  markBusy();
}

class RequestError extends Error {}

async function request(path, body) {
  inflight++;
  markBusy();
  const start = performance.now();
  try {
    const options = body === undefined ? {} : {
      method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body),
    };
    let reply;
    try {
      reply = await fetch(path, options);
    } catch (error) {
      throw new RequestError(`${path}: the server did not answer (${error.message}); is deriv explore running?`);
    }
    const data = await reply.json().catch(() => null);
    if (!reply.ok) {
      const message = data && data.error ? data.error.message : `${reply.status} ${reply.statusText}`;
      throw new RequestError(`${path}: ${message}`);
    }
    const ms = performance.now() - start;
    const server = typeof data.seconds === "number" ? `, the model ${(data.seconds * 1000).toFixed(0)} ms` : "";
    $("status").textContent = `${path}: ${ms.toFixed(0)} ms round trip${server}`;
    $("status").dataset.ms = ms.toFixed(1);
    $("status").dataset.serverMs = typeof data.seconds === "number" ? (data.seconds * 1000).toFixed(1) : "";
    return data;
  } finally {
    inflight--;
    markBusy();
  }
}

// The time from the last keystroke (or move of a control) to its reply drawn: the debounce, the round trip and
// the drawing, as a person waits for it (the measurement docs/results.md quotes).
function keystrokeDrawn() {
  if (state.typedAt === null) return;
  const ms = performance.now() - state.typedAt;
  state.typedAt = null;
  $("status").dataset.keystrokeMs = ms.toFixed(1);
  $("status").textContent += `; keystroke to page ${ms.toFixed(0)} ms`;
}

function typed() {
  state.typedAt = performance.now();
}

function showError(error) {
  if (!(error instanceof RequestError)) console.error(error);
  const message = document.createElement("p");
  message.textContent = error.message;
  $("error").replaceChildren(message);
}

function clearError() {
  $("error").replaceChildren();
}

// The current request of a view (analyze, next): its reply is drawn only if no newer one was sent meanwhile.
async function view(path, body, draw) {
  const mine = ++latestView;
  try {
    const data = await request(path, body);
    if (mine !== latestView) return;
    clearError();
    draw(data);
    keystrokeDrawn();
  } catch (error) {
    if (mine === latestView) showError(error);
  }
}

// --- what is sent ------------------------------------------------------------------------------------------

const seq2seq = () => state.info && state.info.kind === "seq2seq";

function inputs() {
  const body = state.ids ? {ids: state.ids} : {text: $("prompt").value};
  if (seq2seq()) {
    if (state.targetIds) body.target_ids = state.targetIds;
    else if ($("target").value) body.target = $("target").value;
  }
  return body;
}

function settings() {
  return {
    temperature: Number($("temperature").value),
    top_k: parseInt($("top-k").value, 10),
    top_p: Number($("top-p").value),
    presence_penalty: Number($("presence-penalty").value),
    frequency_penalty: Number($("frequency-penalty").value),
  };
}

function analyze() {
  if (!state.ids && !$("prompt").value) return;
  view("/api/analyze", {...inputs(), settings: settings()}, (data) => {
    state.analysis = data;
    drawTokens();
    drawEmbeddings();
    drawAttentionControls();
    drawAttention();
    drawNext(data.next);
  });
}

function next() {
  if (!state.analysis) return;
  view("/api/next", {...inputs(), settings: settings()}, drawNext);
}

async function generate(mode) {
  const body = {
    ...inputs(), settings: settings(), mode,
    steps: parseInt($("steps").value, 10), seed: parseInt($("seed").value, 10),
  };
  try {
    const result = await request("/api/generate", body);
    clearError();
    drawGeneration(result);
    if (seq2seq()) state.targetIds = result.ids;
    else state.ids = result.ids;
    $("ids-note").hidden = false;
    $("ids-note").textContent = `Showing ${result.ids.length} ids, generated ones included; ` +
      `edit the ${seq2seq() ? "target" : "text"} to start over.`;
    analyze();
  } catch (error) {
    showError(error);
  }
}

// --- small drawing helpers ---------------------------------------------------------------------------------

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name.startsWith("data-")) node.dataset[name.slice(5).replace(/-(.)/g, (_, c) => c.toUpperCase())] = value;
    else if (name === "class") node.className = value;
    else if (name === "style") Object.assign(node.style, value); // subtle: the CSP refuses style attributes
    else node.setAttribute(name, value);
  }
  node.append(...children.map((c) => (typeof c === "number" ? String(c) : c)));
  return node;
}

// A token's piece, readable: a space as ␣, a newline as ↵, a tab as →; a special token by its vocabulary name.
function readable(token) {
  if (token.special || !token.piece) return token.raw;
  return token.piece.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "→");
}

// White to a deep blue for weights in [0, 1].
function weightColour(w) {
  const t = Math.pow(Math.min(Math.max(w, 0), 1), 0.6);
  const mix = (a, b) => Math.round(a + (b - a) * t);
  return `rgb(${mix(250, 24)},${mix(250, 58)},${mix(252, 120)})`;
}

// Blue for negative, white for zero, red for positive, scaled by `limit`.
function signedColour(v, limit) {
  const t = Math.min(Math.abs(v) / (limit || 1), 1);
  const mix = (a, b) => Math.round(a + (b - a) * t);
  return v < 0 ? `rgb(${mix(250, 40)},${mix(250, 90)},${mix(250, 170)})`
    : `rgb(${mix(250, 180)},${mix(250, 40)},${mix(250, 40)})`;
}

function sizeCanvas(canvas, width, height) {
  const ratio = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const context = canvas.getContext("2d");
  context.setTransform(ratio, 0, 0, ratio, 0, 0);
  return context;
}

// --- the header --------------------------------------------------------------------------------------------

function drawInfo(info) {
  $("folder-name").textContent = info.name;
  document.title = `deriv explore ${info.name}`;
  const layers = info.kind === "seq2seq"
    ? `${info.encoder_layers} encoder + ${info.decoder_layers} decoder layers` : `${info.layers} layers`;
  const facts = [
    `${info.kind} (${info.model_type})`, layers, `${info.heads} heads (${info.kv_heads} key/value)`,
    `d = ${info.hidden_size}`, `d_k = ${info.head_dim}`, `vocabulary ${info.vocab_size}`,
    `context ${info.context}`, `${info.position_type} positions`, info.pre_norm ? "pre-norm" : "post-norm",
    info.activation, info.dtype + (info.quantized ? " (quantized)" : ""), `${info.tokenizer} tokenizer`,
  ];
  $("model-facts").textContent = facts.join(" · ");
  const defaults = info.defaults || {};
  if (defaults.temperature != null) $("temperature").value = defaults.temperature;
  $("temperature-value").textContent = $("temperature").value;
  if (defaults.top_k != null) $("top-k").value = defaults.top_k;
  if (defaults.top_p != null) $("top-p").value = defaults.top_p;
  $("target-box").hidden = info.kind !== "seq2seq";
  const scale = info.embed_scale !== 1 ? "√d·E[t]" : "E[t]";
  const position = info.position_type === "learned" ? "P[pos]" : "PE(pos)";
  $("embedding-equation").textContent = `x = ${scale} + ${position}`;
}

// --- 1. tokens ---------------------------------------------------------------------------------------------

function chip(token, index, side) {
  const node = el("button", {
    class: token.special ? "chip special" : "chip", type: "button", title: `${token.raw} (id ${token.id})`,
    "data-token-id": token.id, "data-index": index, "data-side": side, "data-piece": token.piece, "data-raw": token.raw,
  }, el("span", {class: "piece"}, readable(token)), el("span", {class: "id"}, token.id));
  node.addEventListener("click", () => showMerges(token.id));
  node.addEventListener("mouseenter", () => hover(side, index));
  return node;
}

function drawTokens() {
  const a = state.analysis;
  const side = seq2seq() ? "source" : "text";
  $("token-chips").replaceChildren(...a.tokens.map((t, i) => chip(t, i, side)));
  $("target-chips-box").hidden = !a.target_tokens;
  if (a.target_tokens) $("target-chips").replaceChildren(...a.target_tokens.map((t, i) => chip(t, i, "target")));
}

async function showMerges(id) {
  try {
    const m = await request("/api/merges", {id});
    clearError();
    const title = el("p", {}, `«${readable(m)}» (id ${m.id}): `, m.kind === "merged"
      ? "built by these merges (a lower rank was learned earlier)" : m.message || `a ${m.kind} token`);
    const tree = m.tree && m.kind === "merged" ? mergeNode(m.tree) : "";
    $("merge-tree").replaceChildren(title, tree);
    $("merge-tree").dataset.tokenId = id;
  } catch (error) {
    showError(error);
  }
}

function mergeNode(node) {
  const label = node.rank == null ? "byte" : `merge ${node.rank}`;
  const box = el("div", {class: "merge-node", "data-raw": node.raw, "data-rank": node.rank ?? ""},
    el("div", {class: "merge-label"}, el("code", {}, readable({piece: node.piece, raw: node.raw})),
      el("span", {class: "rank"}, label)));
  const parts = [node.left, node.right].filter(Boolean);
  if (parts.length) box.append(el("div", {class: "merge-children"}, ...parts.map(mergeNode)));
  return box;
}

// --- 2. embeddings -----------------------------------------------------------------------------------------

function drawEmbeddings() {
  const e = state.analysis.embeddings;
  const tokens = state.analysis.tokens;
  const limit = Math.max(...["token", "position", "sum"].flatMap((k) => e[k].flat().map(Math.abs)));
  const shown = e.dims < e.hidden_size ? `the first ${e.dims} of ${e.hidden_size} dimensions` : `all ${e.dims} dimensions`;
  $("embedding-note").textContent = `Rows: tokens; columns: ${shown}; one colour scale for the three ` +
    `(blue negative, red positive, ±${limit.toFixed(2)}); ‖·‖: the norm of the whole vector. ` +
    `Scale √d = ${e.embed_scale.toFixed(3)}.`;
  const titles = {
    token: e.embed_scale !== 1 ? "√d·E[t]: the token's embedding, scaled" : "E[t]: the token's embedding",
    position: e.position_type === "learned" ? "P[pos]: the learned position vector" : "PE(pos): sinusoidal",
    sum: "x = their sum: what the first layer reads",
  };
  $("strips").replaceChildren(...["token", "position", "sum"].map((kind) => strip(kind, titles[kind], e, tokens, limit)));
}

function strip(kind, title, e, tokens, limit) {
  const rows = e[kind];
  const cellWidth = Math.max(4, Math.floor(512 / e.dims));
  const cellHeight = 18;
  const canvas = el("canvas", {class: "strip", "data-kind": kind});
  const context = sizeCanvas(canvas, cellWidth * e.dims, cellHeight * rows.length);
  rows.forEach((row, r) => row.forEach((v, c) => {
    context.fillStyle = signedColour(v, limit);
    context.fillRect(c * cellWidth, r * cellHeight, cellWidth, cellHeight);
  }));
  const labels = el("div", {class: "strip-labels"}, ...tokens.map((t) => el("div", {}, readable(t))));
  const norms = el("div", {class: "strip-norms"}, ...e.norms[kind].map((n) =>
    el("div", {"data-norm": n}, `‖·‖ ${n.toFixed(3)}`)));
  return el("figure", {class: "strip-figure", "data-kind": kind},
    el("figcaption", {}, title), el("div", {class: "strip-row"}, labels, canvas, norms));
}

// --- 3. attention ------------------------------------------------------------------------------------------

const kindSelect = () => $("attention-kind");

function currentMaps() {
  const attention = state.analysis.attention;
  return attention[kindSelect().value] || attention.decoder;
}

function fillSelect(select, values, label) {
  const keep = select.value;
  select.replaceChildren(...values.map((v) => el("option", {value: v}, label(v))));
  if (values.map(String).includes(keep)) select.value = keep;
}

function drawAttentionControls() {
  const kinds = Object.keys(state.analysis.attention);
  fillSelect(kindSelect(), kinds, (k) => ({
    encoder: "encoder self-attention", decoder: seq2seq() ? "decoder self-attention" : "self-attention",
    cross: "cross-attention (target → source)",
  })[k] || k);
  $("kind-label").hidden = kinds.length < 2;
  const maps = currentMaps();
  fillSelect($("layer"), [...Array(maps.layers).keys()], String);
  fillSelect($("head"), [...Array(maps.heads).keys()], String);
}

// The tokens along one side of a map; a decoder's rows start with its start token, which no chip shows.
function sideLabels(side, count) {
  const a = state.analysis;
  const tokens = side === "target" ? a.target_tokens : a.tokens;
  const extra = count - tokens.length;
  const start = Array.from({length: Math.max(extra, 0)}, () => ({piece: "", raw: "<start>", special: true}));
  return {labels: [...start, ...tokens].slice(0, count), offset: extra};
}

let cell = 20;

function currentWeights() {
  return currentMaps().weights[Number($("layer").value)][Number($("head").value)];
}

// The map of the chosen stack, layer and head: its labels, then its cells and the hovered row.
function drawAttention() {
  const maps = currentMaps();
  cell = Math.max(12, Math.min(36, Math.floor(560 / Math.max(maps.queries, maps.keys))));
  Object.assign($("attention-map").dataset, {
    kind: kindSelect().value || "decoder", layer: $("layer").value, head: $("head").value,
    queries: maps.queries, keys: maps.keys, querySide: maps.query_side, keySide: maps.key_side, causal: maps.causal,
  });
  const rows = sideLabels(maps.query_side, maps.queries).labels;
  const columns = sideLabels(maps.key_side, maps.keys).labels;
  $("row-labels").replaceChildren(...rows.map((t, q) => {
    const label = el("div", {class: "row-label", "data-query-index": q, style: {height: `${cell}px`}}, readable(t));
    label.addEventListener("mouseenter", () => showRow(q));
    return label;
  }));
  $("column-labels").replaceChildren(...columns.map((t, k) =>
    el("div", {class: "col-label", "data-key-index": k, style: {width: `${cell}px`}}, readable(t))));
  $("masked-legend").hidden = !maps.causal;
  if (state.query !== null && state.query >= maps.queries) state.query = null;
  drawCells();
  listRow();
}

function drawCells() {
  const maps = currentMaps();
  const weights = currentWeights();
  const context = sizeCanvas($("attention-map"), cell * maps.keys, cell * maps.queries);
  const hatch = hatchPattern(context);
  for (let q = 0; q < maps.queries; q++) {
    for (let k = 0; k < maps.keys; k++) {
      context.fillStyle = maps.causal && k > q ? hatch : weightColour(weights[q][k]);
      context.fillRect(k * cell, q * cell, cell, cell);
    }
  }
  if (state.query === null) return;
  context.strokeStyle = "#e07b00";
  context.lineWidth = 2;
  context.strokeRect(1, state.query * cell + 1, maps.keys * cell - 2, cell - 2);
}

function hatchPattern(context) {
  const tile = document.createElement("canvas");
  tile.width = tile.height = 6;
  const t = tile.getContext("2d");
  t.fillStyle = "#e4e4e4";
  t.fillRect(0, 0, 6, 6);
  t.strokeStyle = "#a8a8a8";
  t.beginPath();
  t.moveTo(0, 6);
  t.lineTo(6, 0);
  t.stroke();
  return context.createPattern(tile, "repeat");
}

// A chip's token: its row, if the map's rows are that side's tokens.
function hover(side, index) {
  const maps = state.analysis && currentMaps();
  if (!maps || maps.query_side !== side) return;
  showRow(index + sideLabels(side, maps.queries).offset);
}

function showRow(q) {
  if (q === state.query) return;
  state.query = q;
  drawCells();
  listRow();
}

// Where the hovered row attends: its largest weights, and the whole row (the server's floats) for the tests.
function listRow() {
  const attends = $("attends");
  document.querySelectorAll(".row-label.active").forEach((n) => n.classList.remove("active"));
  if (state.query === null) {
    delete attends.dataset.query;
    delete attends.dataset.row;
    attends.replaceChildren(el("p", {class: "hint"}, "Hover a token or a row to see where it attends."));
    return;
  }
  const maps = currentMaps();
  const q = state.query;
  const row = currentWeights()[q];
  const rows = sideLabels(maps.query_side, maps.queries).labels;
  const keys = sideLabels(maps.key_side, maps.keys).labels;
  const top = row.map((w, k) => [w, k]).filter(([w]) => w > 0).sort((a, b) => b[0] - a[0] || a[1] - b[1]).slice(0, 8);
  const list = el("ol", {class: "attends-list"}, ...top.map(([w, k]) =>
    el("li", {"data-key-index": k, "data-weight": w}, el("code", {}, readable(keys[k])), ` ${w.toFixed(5)}`)));
  attends.dataset.query = q;
  attends.dataset.row = JSON.stringify(row);
  attends.replaceChildren(el("p", {}, `«${readable(rows[q])}» (row ${q}) attends most to:`), list);
  document.querySelector(`.row-label[data-query-index="${q}"]`).classList.add("active");
}

// --- 4. the next token -------------------------------------------------------------------------------------

function drawNext(n) {
  $("processors").textContent = `Processors, in generate()'s order: ${n.processors.join(" → ") || "none"}; ` +
    `${n.kept} of ${n.vocab_size} tokens keep a probability above 0; entropy ${n.entropy.toFixed(4)} nats.`;
  $("candidates").replaceChildren(...n.candidates.map((c) => {
    const percent = `${(c.probability * 100).toFixed(2)}%`;
    return el("li", {
      class: "candidate", "data-token-id": c.id, "data-probability": c.probability, "data-logit": c.logit,
      "data-score": c.score ?? "", "data-base-probability": c.base_probability,
    },
    el("code", {class: "piece"}, readable(c)),
    el("span", {class: "bar"}, el("span", {class: "fill", style: {width: `${(c.probability * 100).toFixed(2)}%`}})),
    el("span", {class: "numbers"}, el("b", {}, percent), ` p = ${c.probability.toPrecision(6)}`,
      ` · logit ${c.logit.toFixed(4)}`, ` · untouched p = ${c.base_probability.toFixed(4)}`));
  }));
}

// --- 5. generation -----------------------------------------------------------------------------------------

function drawGeneration(g) {
  $("generation-table").tBodies[0].replaceChildren(...g.steps.map((s, i) => el("tr", {
    "data-token-id": s.id, "data-probability": s.probability, "data-phase": s.phase,
  }, el("td", {}, i + 1), el("td", {}, el("code", {}, readable(s))), el("td", {}, s.probability.toFixed(4)),
  el("td", {}, s.phase), el("td", {}, (s.seconds * 1000).toFixed(2)), el("td", {}, s.cache_positions),
  el("td", {}, s.cache_bytes))));
  const last = g.steps[g.steps.length - 1];
  if (!last) return;
  const cross = g.cache.cross_bytes ? ` + ${g.cache.cross_bytes} for the cross-attention's keys and values` : "";
  const decode = g.decode_seconds_mean == null ? "" : `, decode ${(g.decode_seconds_mean * 1000).toFixed(2)} ms a step`;
  $("cache-formula").textContent = `${g.cache.formula}. After the last step: ${last.cache_positions} positions × ` +
    `${g.cache.per_token_bytes} bytes${cross} = ${last.cache_bytes} bytes; the returned cache's tensors hold ` +
    `${g.cache.final_bytes} bytes. Prefill ${(g.prefill_seconds * 1000).toFixed(2)} ms${decode}.` +
    (g.finished ? " It stopped at the end-of-sequence token." : "");
}

// --- wiring ------------------------------------------------------------------------------------------------

function start() {
  markBusy();
  for (const id of ["prompt", "target", "temperature", "top-k", "top-p", "presence-penalty", "frequency-penalty"]) {
    $(id).addEventListener("input", typed);
  }
  $("prompt").addEventListener("input", () => {
    state.ids = null;
    state.targetIds = null;
    $("ids-note").hidden = true;
    later("analyze", analyze);
  });
  $("target").addEventListener("input", () => {
    state.targetIds = null;
    $("ids-note").hidden = true;
    later("analyze", analyze);
  });
  $("temperature").addEventListener("input", () => {
    $("temperature-value").textContent = $("temperature").value;
    later("next", next);
  });
  for (const id of ["top-k", "top-p", "presence-penalty", "frequency-penalty"]) {
    $(id).addEventListener("input", () => later("next", next));
  }
  $("attention-kind").addEventListener("change", () => {
    const maps = currentMaps();
    fillSelect($("layer"), [...Array(maps.layers).keys()], String);
    fillSelect($("head"), [...Array(maps.heads).keys()], String);
    state.query = null;
    drawAttention();
  });
  $("layer").addEventListener("change", drawAttention);
  $("head").addEventListener("change", drawAttention);
  $("attention-map").addEventListener("mousemove", (event) => {
    const q = Math.floor(event.offsetY / cell);
    if (q !== state.query && q >= 0 && q < currentMaps().queries) showRow(q);
  });
  $("greedy").addEventListener("click", () => generate("greedy"));
  $("sample").addEventListener("click", () => generate("sample"));
  request("/api/info").then((info) => {
    state.info = info;
    drawInfo(info);
    analyze();
  }).catch(showError);
}

start();
