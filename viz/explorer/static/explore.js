// The explorer's page. It only draws: every number on it comes from the server (deriv explore, which runs the
// folder's own model, tokenizer, logits processors and cache). Nothing here computes a probability or a weight.
"use strict";

const $ = (id) => document.getElementById(id);

const state = {
  info: null,
  ids: null, // the ids shown, once greedy/sample appended to them (null: the prompt's text is the input)
  targetIds: null, // the same for a translation folder's target
  analysis: null,
  map: null, // the attention map drawn: {kind, layer, head, queries, keys, weights: a Float32Array, row-major}
  overview: null, // kind -> every head's pooled map, a Uint8Array [layer][head][q][k] (for the thumbnails only)
  query: null, // the attention row that is outlined and listed
  typedAt: null, // performance.now() of the last keystroke or control move not yet drawn
};

// --- requests ----------------------------------------------------------------------------------------------

const timers = {};
let inflight = 0;
// How many of each request were sent, and how often the text changed: a reply made stale by a later one is dropped.
const latest = {analyze: 0, next: 0, merges: 0, inputs: 0};
let latestMap = 0; // the map of an analyze or attention reply older than the latest map asked for is dropped

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

// A request whose reply is drawn (or failure shown) only if `current()` still holds when it arrives, that is if
// no later request made it stale.
async function drawn(path, body, current, draw) {
  try {
    const data = await request(path, body);
    if (!current()) return;
    clearError();
    draw(data);
    keystrokeDrawn();
  } catch (error) {
    if (current()) showError(error);
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
    top_k: wholeOrAsTyped($("top-k").value),
    top_p: Number($("top-p").value),
    presence_penalty: Number($("presence-penalty").value),
    frequency_penalty: Number($("frequency-penalty").value),
  };
}

// A whole number as a number; anything else as typed, for the server to refuse in one message (never a silent
// default in place of what the box shows).
function wholeOrAsTyped(value) {
  return /^\s*\d+\s*$/.test(value) ? Number(value) : value;
}

// The map chosen in the selects ({} before the first analysis: the server's default, the first kind's 0, 0).
function selection() {
  if (!kindSelect().value) return {};
  return {kind: kindSelect().value, layer: Number($("layer").value), head: Number($("head").value)};
}

// Everything for the text: stale once a later analyze is sent; its distribution is left out if a control asked
// for a newer one meanwhile (that reply draws it).
function analyze() {
  if (!state.ids && !$("prompt").value) return;
  const mine = ++latest.analyze, map = ++latestMap, nextSent = latest.next;
  const body = {...inputs(), settings: settings(), view: selection()};
  drawn("/api/analyze", body, () => mine === latest.analyze, (data) => {
    state.analysis = data;
    state.overview = Object.fromEntries(Object.entries(data.attention).map(([k, m]) => [k, decoded(m.overview)]));
    if (map === latestMap) state.map = mapOf(data.view);
    drawTokens();
    drawEmbeddings();
    drawAttentionControls();
    drawAttention();
    if (latest.next === nextSent) drawNext(data.next);
  });
}

// One map of the same inputs (a switch of kind, layer or head): the server looks it up among its last forwards.
async function showMap() {
  if (!state.analysis) return;
  const mine = ++latestMap;
  drawOverviewSelection();
  try {
    const data = await request("/api/attention", {...inputs(), ...selection()});
    if (mine !== latestMap) return;
    clearError();
    state.map = mapOf(data);
    drawAttention();
    keystrokeDrawn();
  } catch (error) {
    if (mine === latestMap) showError(error);
  }
}

// The distribution alone (a control moved): stale once a later one, or an analyze of a changed text, is sent.
function next() {
  if (!state.analysis) return;
  const mine = ++latest.next, analyzeSent = latest.analyze;
  const current = () => mine === latest.next && analyzeSent === latest.analyze;
  drawn("/api/next", {...inputs(), settings: settings()}, current, drawNext);
}

// Greedy or sampled steps appended to the ids; dropped if the text was edited while they were computed. The
// buttons wait for the reply, so two clicks cannot both extend the same ids.
async function generate(mode) {
  const body = {
    ...inputs(), settings: settings(), mode,
    steps: parseInt($("steps").value, 10), seed: parseInt($("seed").value, 10),
  };
  const version = latest.inputs;
  $("greedy").disabled = $("sample").disabled = true;
  try {
    const result = await request("/api/generate", body);
    if (version !== latest.inputs) return;
    clearError();
    drawGeneration(result);
    if (seq2seq()) state.targetIds = result.ids;
    else state.ids = result.ids;
    $("ids-note").hidden = false;
    $("ids-note").textContent = `Showing ${result.ids.length} ids, generated ones included; ` +
      `edit the ${seq2seq() ? "target" : "text"} to start over.`;
    analyze();
  } catch (error) {
    if (version === latest.inputs) showError(error);
  } finally {
    $("greedy").disabled = $("sample").disabled = false;
  }
}

// --- the server's arrays ----------------------------------------------------------------------------------

// {shape, dtype, data: base64 of little-endian bytes} as a typed array: the float32 values the model computed,
// exactly. subtle: typed arrays use the machine's byte order, little-endian on every machine a browser runs on.
function decoded(array) {
  const text = atob(array.data);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  return array.dtype === "float32" ? new Float32Array(bytes.buffer) : bytes;
}

// A [rows][columns] array as its rows (views, not copies).
function rowsOf(array) {
  const values = decoded(array);
  const [rows, columns] = array.shape;
  return Array.from({length: rows}, (_, r) => values.subarray(r * columns, (r + 1) * columns));
}

function mapOf(reply) {
  const [queries, keys] = reply.weights.shape;
  return {kind: reply.kind, layer: reply.layer, head: reply.head, queries, keys, weights: decoded(reply.weights)};
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

// White to a deep blue for weights in [0, 1], as [r, g, b].
function weightRGB(w) {
  const t = Math.pow(Math.min(Math.max(w, 0), 1), 0.6);
  const mix = (a, b) => Math.round(a + (b - a) * t);
  return [mix(250, 24), mix(250, 58), mix(252, 120)];
}

// Blue for negative, white for zero, red for positive, scaled by `limit`, as [r, g, b].
function signedRGB(v, limit) {
  const t = Math.min(Math.abs(v) / (limit || 1), 1);
  const mix = (a, b) => Math.round(a + (b - a) * t);
  return v < 0 ? [mix(250, 40), mix(250, 90), mix(250, 170)] : [mix(250, 180), mix(250, 40), mix(250, 40)];
}

// A grid of `rows` x `columns` cells of cellWidth x cellHeight pixels, cell (r, c) in colour(r, c) ([r, g, b]):
// one pixel a cell in an image, scaled up without smoothing. subtle: a fillRect a cell, with its colour as a
// string, took a third of a second at a full context (every map, strip and thumbnail: some 130,000 cells).
function paintCells(context, rows, columns, cellWidth, cellHeight, colour) {
  const image = new ImageData(columns, rows);
  for (let r = 0; r < rows; r++) {
    for (let c = 0; c < columns; c++) {
      const [red, green, blue] = colour(r, c);
      const i = 4 * (r * columns + c);
      image.data[i] = red;
      image.data[i + 1] = green;
      image.data[i + 2] = blue;
      image.data[i + 3] = 255;
    }
  }
  const tile = document.createElement("canvas");
  tile.width = columns;
  tile.height = rows;
  tile.getContext("2d").putImageData(image, 0, 0);
  context.imageSmoothingEnabled = false;
  context.drawImage(tile, 0, 0, columns * cellWidth, rows * cellHeight);
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
    `context ${info.context}`,
    info.position_type === "rotary" ? `rotary positions (θ ${info.rope_theta})` : `${info.position_type} positions`,
    (info.pre_norm ? "pre-norm" : "post-norm") + (info.norm_type === "rms_norm" ? " (RMSNorm)" : " (LayerNorm)"),
    info.gated_mlp ? (info.activation === "silu" ? "SwiGLU" : `gated ${info.activation}`) : info.activation,
    ...(info.bias === false ? ["no biases"] : []),
    info.dtype + (info.quantized ? " (quantized)" : ""), `${info.tokenizer} tokenizer`,
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
  $("embedding-equation").textContent = info.position_type === "rotary"
    ? `x = ${scale} (rotary: positions rotate q and k in each head)` : `x = ${scale} + ${position}`;
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
  const mine = ++latest.merges;
  try {
    const m = await request("/api/merges", {id});
    if (mine !== latest.merges) return;
    clearError();
    const title = el("p", {}, `«${readable(m)}» (id ${m.id}): `, m.kind === "merged"
      ? "built by these merges (a lower rank was learned earlier)" : m.message || `a ${m.kind} token`);
    const tree = m.tree && m.kind === "merged" ? mergeNode(m.tree) : "";
    $("merge-tree").replaceChildren(title, tree);
    $("merge-tree").dataset.tokenId = id;
  } catch (error) {
    if (mine === latest.merges) showError(error);
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
  const e = {...state.analysis.embeddings};
  // rotary positions add no vector to the input (they turn q and k in each head): no position strip
  const kinds = e.position ? ["token", "position", "sum"] : ["token", "sum"];
  for (const kind of kinds) e[kind] = rowsOf(e[kind]);
  const tokens = state.analysis.tokens;
  let limit = 0;
  for (const kind of kinds) {
    for (const row of e[kind]) for (const v of row) limit = Math.max(limit, Math.abs(v));
  }
  const shown = e.dims < e.hidden_size ? `the first ${e.dims} of ${e.hidden_size} dimensions` : `all ${e.dims} dimensions`;
  $("embedding-note").textContent = `Rows: tokens; columns: ${shown}; one colour scale for the ${kinds.length} ` +
    `(blue negative, red positive, ±${limit.toFixed(2)}); ‖·‖: the norm of the whole vector. ` +
    `Scale √d = ${e.embed_scale.toFixed(3)}.` + (e.position_note ? ` No position vector is added (${e.position_note}).` : "");
  const titles = {
    token: e.embed_scale !== 1 ? "√d·E[t]: the token's embedding, scaled" : "E[t]: the token's embedding",
    position: e.position_type === "learned" ? "P[pos]: the learned position vector" : "PE(pos): sinusoidal",
    sum: e.position ? "x = their sum: what the first layer reads" : "x = the token's embedding: what the first layer reads",
  };
  $("strips").replaceChildren(...kinds.map((kind) => strip(kind, titles[kind], e, tokens, limit)));
}

function strip(kind, title, e, tokens, limit) {
  const rows = e[kind];
  const cellWidth = Math.max(4, Math.floor(512 / e.dims));
  const cellHeight = 18;
  const canvas = el("canvas", {class: "strip", "data-kind": kind});
  const context = sizeCanvas(canvas, cellWidth * e.dims, cellHeight * rows.length);
  paintCells(context, rows.length, e.dims, cellWidth, cellHeight, (r, c) => signedRGB(rows[r][c], limit));
  const labels = el("div", {class: "strip-labels"}, ...tokens.map((t) => el("div", {}, readable(t))));
  const norms = el("div", {class: "strip-norms"}, ...e.norms[kind].map((n) =>
    el("div", {"data-norm": n}, `‖·‖ ${n.toFixed(3)}`)));
  return el("figure", {class: "strip-figure", "data-kind": kind},
    el("figcaption", {}, title), el("div", {class: "strip-row"}, labels, canvas, norms));
}

// --- 3. attention ------------------------------------------------------------------------------------------

const kindSelect = () => $("attention-kind");

// The facts of the selected kind's maps (layers, heads, sides, causal) and of the drawn map's kind.
function currentMaps() {
  const attention = state.analysis.attention;
  return attention[kindSelect().value] || Object.values(attention)[0];
}

function drawnMaps() {
  return state.analysis.attention[state.map.kind];
}

function fillSelect(select, values, label) {
  const keep = select.value;
  select.replaceChildren(...values.map((v) => el("option", {value: v}, label(v))));
  if (values.map(String).includes(keep)) select.value = keep;
}

function fillLayersAndHeads() {
  const maps = currentMaps();
  fillSelect($("layer"), [...Array(maps.layers).keys()], String);
  fillSelect($("head"), [...Array(maps.heads).keys()], String);
}

function drawAttentionControls() {
  const kinds = Object.keys(state.analysis.attention);
  fillSelect(kindSelect(), kinds, (k) => ({
    encoder: "encoder self-attention", decoder: seq2seq() ? "decoder self-attention" : "self-attention",
    cross: "cross-attention (target → source)",
  })[k] || k);
  if (state.map && !kindSelect().value) kindSelect().value = state.map.kind;
  $("kind-label").hidden = kinds.length < 2;
  fillLayersAndHeads();
  drawOverview();
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

// Row q of the drawn map: the server's float32 weights.
function weightsRow(q) {
  return state.map.weights.subarray(q * state.map.keys, (q + 1) * state.map.keys);
}

// The drawn map (the server's reply for a kind, layer and head): its labels, then its cells and the hovered row.
function drawAttention() {
  const map = state.map;
  const maps = drawnMaps();
  cell = Math.max(12, Math.min(36, Math.floor(560 / Math.max(map.queries, map.keys))));
  Object.assign($("attention-map").dataset, {
    kind: map.kind, layer: map.layer, head: map.head,
    queries: map.queries, keys: map.keys, querySide: maps.query_side, keySide: maps.key_side, causal: maps.causal,
  });
  const rows = sideLabels(maps.query_side, map.queries).labels;
  const columns = sideLabels(maps.key_side, map.keys).labels;
  $("row-labels").replaceChildren(...rows.map((t, q) => {
    const label = el("div", {class: "row-label", "data-query-index": q, style: {height: `${cell}px`}}, readable(t));
    label.addEventListener("mouseenter", () => showRow(q));
    return label;
  }));
  $("column-labels").replaceChildren(...columns.map((t, k) =>
    el("div", {class: "col-label", "data-key-index": k, style: {width: `${cell}px`}}, readable(t))));
  $("masked-legend").hidden = !maps.causal;
  if (state.query !== null && state.query >= map.queries) state.query = null;
  drawCells();
  listRow();
}

function drawCells() {
  const map = state.map;
  const causal = drawnMaps().causal;
  const context = sizeCanvas($("attention-map"), cell * map.keys, cell * map.queries);
  const weights = map.weights;
  paintCells(context, map.queries, map.keys, cell, cell, (q, k) => weightRGB(weights[q * map.keys + k]));
  if (causal) {
    // the masked cells (a key after the query), hatched over: one path of a run of cells a row
    context.beginPath();
    for (let q = 0; q + 1 < map.keys && q < map.queries; q++) {
      context.rect((q + 1) * cell, q * cell, (map.keys - q - 1) * cell, cell);
    }
    context.fillStyle = hatchPattern(context);
    context.fill();
  }
  if (state.query === null) return;
  context.strokeStyle = "#e07b00";
  context.lineWidth = 2;
  context.strokeRect(1, state.query * cell + 1, map.keys * cell - 2, cell - 2);
}

// Every layer and head of the selected kind at once: small multiples of the pooled maps (rows layers, columns
// heads), the selected one outlined; a click selects one. Display only: 0..255 steps of the pooled weights.
function drawOverview() {
  const maps = currentMaps();
  const kind = kindSelect().value || Object.keys(state.analysis.attention)[0];
  const cells = state.overview[kind];
  const [layers, heads, rows, columns] = maps.overview.shape;
  const size = Math.max(2, Math.floor(72 / Math.max(rows, columns)));
  const grid = $("overview");
  grid.style.gridTemplateColumns = `auto repeat(${heads}, auto)`;
  const children = [el("div", {class: "overview-corner"}, "layer ↓ head →")];
  for (let h = 0; h < heads; h++) children.push(el("div", {class: "overview-head"}, h));
  for (let l = 0; l < layers; l++) {
    children.push(el("div", {class: "overview-layer"}, l));
    for (let h = 0; h < heads; h++) {
      const thumb = el("canvas", {class: "thumb", "data-layer": l, "data-head": h, title: `layer ${l}, head ${h}`});
      const context = sizeCanvas(thumb, size * columns, size * rows);
      const offset = (l * heads + h) * rows * columns;
      const scale = maps.overview.scale;
      paintCells(context, rows, columns, size, size, (q, k) => weightRGB(cells[offset + q * columns + k] / scale));
      thumb.addEventListener("click", () => {
        $("layer").value = String(l);
        $("head").value = String(h);
        showMap();
      });
      children.push(thumb);
    }
  }
  grid.replaceChildren(...children);
  grid.dataset.kind = kind;
  drawOverviewSelection();
}

function drawOverviewSelection() {
  const layer = $("layer").value, head = $("head").value;
  for (const thumb of document.querySelectorAll("#overview .thumb")) {
    thumb.classList.toggle("selected", thumb.dataset.layer === layer && thumb.dataset.head === head);
  }
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
  if (!state.map) return;
  const maps = drawnMaps();
  if (maps.query_side !== side) return;
  showRow(index + sideLabels(side, state.map.queries).offset);
}

function showRow(q) {
  if (q === state.query) return;
  state.query = q;
  drawCells();
  listRow();
}

// Where the hovered row attends: its largest weights, and the whole row (the server's float32 values) for the tests.
function listRow() {
  const attends = $("attends");
  document.querySelectorAll(".row-label.active").forEach((n) => n.classList.remove("active"));
  if (state.query === null) {
    delete attends.dataset.query;
    delete attends.dataset.row;
    attends.replaceChildren(el("p", {class: "hint"}, "Hover a token or a row to see where it attends."));
    return;
  }
  const maps = drawnMaps();
  const q = state.query;
  const row = Array.from(weightsRow(q));
  const rows = sideLabels(maps.query_side, state.map.queries).labels;
  const keys = sideLabels(maps.key_side, state.map.keys).labels;
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
  for (const id of ["prompt", "target"]) $(id).addEventListener("input", () => latest.inputs++);
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
    fillLayersAndHeads();
    state.query = null;
    drawOverview();
    showMap();
  });
  for (const id of ["attention-kind", "layer", "head"]) $(id).addEventListener("change", typed);
  $("layer").addEventListener("change", showMap);
  $("head").addEventListener("change", showMap);
  $("attention-map").addEventListener("mousemove", (event) => {
    const q = Math.floor(event.offsetY / cell);
    if (state.map && q !== state.query && q >= 0 && q < state.map.queries) showRow(q);
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
