"use strict";
// attnzoo playground: every served model with an input widget and the picture of its attention,
// drawn from the server's own Open Inference Protocol (KServe v2) answers. Plain script, no build
// step, nothing from elsewhere: the page must work offline (the server's Content-Security-Policy
// allows this origin only). It calls the endpoints any client calls: GET /v2, POST
// /v2/repository/index, GET /v2/models/<name>, POST /v2/models/<name>[/versions/<v>]/infer.

// ---- DOM, colours, numbers -------------------------------------------------------------------------
const SVG_NS = "http://www.w3.org/2000/svg";

function make(ns, tag, attrs, children) {
  const node = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value); // never "style": the CSP refuses inline styles
  }
  for (const child of children.flat(2)) if (child !== null && child !== undefined && child !== false) node.append(child);
  return node;
}
const el = (tag, attrs, ...children) => make(null, tag, attrs, children);
const svg = (tag, attrs, ...children) => make(SVG_NS, tag, attrs, children);
const $ = (selector) => document.querySelector(selector);

const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
function color(v) {
  const x = Math.min(Math.max(v, 0), 1) * (VIRIDIS.length - 1);
  const i = Math.min(Math.floor(x), VIRIDIS.length - 2), f = x - i;
  return `rgb(${VIRIDIS[i].map((a, k) => Math.round(a + (VIRIDIS[i + 1][k] - a) * f))})`;
}
const fmt = (v, digits = 3) => (typeof v === "number" ? v.toFixed(digits) : String(v));
const size = (shape) => shape.reduce((a, b) => a * b, 1);
const sigmoid = (x) => 1 / (1 + Math.exp(-x));

// The sub-tensor of an answer's output at leading indices: {shape, data} (row-major).
function sub(t, ...index) {
  let offset = 0;
  index.forEach((i, k) => { offset += i * size(t.shape.slice(k + 1)); });
  const shape = t.shape.slice(index.length);
  return {shape, data: t.data.slice(offset, offset + size(shape))};
}
// A 2-D tensor as an array of rows.
const rows = (t) => Array.from({length: t.shape[0]}, (_, r) => t.data.slice(r * t.shape[1], (r + 1) * t.shape[1]));

// A seeded standard normal sample (mulberry32 + Box-Muller): the same seed draws the same noise.
function gaussian(seed, n) {
  let state = seed >>> 0;
  const uniform = () => {
    state = (state + 0x6d2b79f5) >>> 0;
    let t = Math.imul(state ^ (state >>> 15), 1 | state);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return (((t ^ (t >>> 14)) >>> 0) + 0.5) / 4294967296;
  };
  const out = new Float32Array(n);
  for (let i = 0; i < n; i++) out[i] = Math.sqrt(-2 * Math.log(uniform())) * Math.cos(2 * Math.PI * uniform());
  return out;
}

// ---- the protocol -----------------------------------------------------------------------------------
// One request; an error answer becomes an Error carrying the server's one sentence.
async function call(method, path, body, headers = {}) {
  let response;
  try {
    response = await fetch(path, {method, body, headers});
  } catch (err) {
    throw new Error(`the server could not be reached (${err.message})`);
  }
  const text = await response.text();
  let data = null;
  try { data = JSON.parse(text); } catch { /* not JSON: the status says enough */ }
  if (!response.ok) throw new Error((data && data.error) || `HTTP ${response.status} ${response.statusText}`);
  return data;
}
const getJSON = (path) => call("GET", path);
const postJSON = (path, body) => call("POST", path, JSON.stringify(body), {"Content-Type": "application/json"});
const modelPath = (name, version) =>
  `v2/models/${encodeURIComponent(name)}${version ? `/versions/${encodeURIComponent(version)}` : ""}`;

// An inference request ({inputs, parameters}); an input whose data is a Float32Array goes as binary
// tensor data (the protocol's extension: the JSON, then the raw little-endian bytes), which keeps an
// image or a clip small on the wire. Returns {output name: {shape, datatype, data}, model_version}.
async function infer(name, version, body) {
  const blobs = [];
  const inputs = Array.isArray(body.inputs) ? body.inputs.map((x) => {
    if (!(x.data instanceof Float32Array)) return x;
    blobs.push(x.data);
    return {name: x.name, datatype: x.datatype, shape: x.shape, parameters: {binary_data_size: x.data.byteLength}};
  }) : body.inputs;
  const path = `${modelPath(name, version)}/infer`;
  let answer;
  if (blobs.length) {
    const json = new TextEncoder().encode(JSON.stringify({...body, inputs}));
    answer = await call("POST", path, new Blob([json, ...blobs]), {
      "Content-Type": "application/octet-stream", "Inference-Header-Content-Length": String(json.length)});
  } else {
    answer = await postJSON(path, body);
  }
  const outputs = Object.fromEntries(answer.outputs.map((o) => [o.name, o]));
  return {...outputs, model_version: answer.model_version};
}

// ---- pictures ---------------------------------------------------------------------------------------
// A figure whose readout shows what the pointer is over (any element with data-label).
function figure(caption, ...content) {
  const readout = el("span", {class: "readout"});
  const node = el("figure", {class: "plot"}, ...content, el("figcaption", {}, caption, " ", readout));
  node.addEventListener("mouseover", (e) => {
    const target = e.target.closest && e.target.closest("[data-label]");
    if (target) readout.textContent = target.dataset.label;
  });
  return node;
}

// rows × cols weights as SVG cells coloured by weight / the largest; hovering a cell shows its weight.
// band: a signal drawn over the columns (speech: the waveform); onrow(r): a row is hovered.
function heatmap(matrix, rowLabels, colLabels, {name = "attention", band = null, onrow = null} = {}) {
  const nr = matrix.length, nc = nr ? matrix[0].length : 0;
  // cells as wide as 640 px allow; a few rows beside many columns get taller cells, to stay readable
  const cw = Math.max(3, Math.min(22, Math.floor(640 / Math.max(nc, 1)))), ch = nr <= 40 ? Math.max(cw, 14) : cw;
  const clip = (s) => (String(s).length > 10 ? `${String(s).slice(0, 9)}…` : String(s));
  const left = ch >= 10 ? 10 + 7 * Math.max(1, ...rowLabels.map((l) => clip(l).length)) : 4;
  const bandHeight = band ? 44 : 0;
  const top = bandHeight + (cw >= 10 ? 10 + 5 * Math.max(1, ...colLabels.map((l) => clip(l).length)) : 4);
  const max = Math.max(1e-9, ...matrix.flat());
  const root = svg("svg", {class: "heatmap", "data-name": name, "data-rows": nr, "data-cols": nc,
    width: left + nc * cw + 4, height: top + nr * ch + 4, role: "img", "aria-label": `${name}: ${nr} × ${nc}`});
  matrix.forEach((row, r) => row.forEach((v, c) => {
    const label = `${rowLabels[r]} → ${colLabels[c]}: ${fmt(v)}`;
    root.append(svg("rect", {class: "cell", x: left + c * cw, y: top + r * ch, width: cw, height: ch,
      fill: color(v / max), "data-r": r, "data-c": c, "data-label": label}, svg("title", {text: label})));
  }));
  if (ch >= 10) rowLabels.forEach((l, r) => root.append(svg("text", {class: "tick", x: left - 4, y: top + r * ch + ch * 0.72,
    "text-anchor": "end", text: clip(l)})));
  if (cw >= 10) colLabels.forEach((l, c) => {
    const x = left + c * cw + cw * 0.65, y = top - 4;
    root.append(svg("text", {class: "tick", x, y, transform: `rotate(-60 ${x} ${y})`, text: clip(l)}));
  });
  if (band) root.append(wave(band, left, nc * cw, bandHeight / 2));
  if (onrow) root.addEventListener("mouseover", (e) => { if (e.target.dataset.r) onrow(Number(e.target.dataset.r)); });
  return root;
}

// A signal's peak envelope, one vertical line per pixel column, centred on y = middle.
function wave(samples, left, width, middle) {
  const parts = [];
  for (let i = 0; i < width; i++) {
    let peak = 0;
    const end = Math.floor(((i + 1) * samples.length) / width);
    for (let j = Math.floor((i * samples.length) / width); j < end; j++) peak = Math.max(peak, Math.abs(samples[j]));
    const h = Math.max(0.5, peak * (middle - 2));
    parts.push(`M${left + i + 0.5} ${middle - h}V${middle + h}`);
  }
  return svg("path", {class: "wave", d: parts.join("")});
}

// Values in [0, 1] as bars; highlight(i) false draws bar i greyed.
function bars(values, labels, {name, highlight = () => true} = {}) {
  const w = 34, h = 110;
  const root = svg("svg", {class: "bars", "data-name": name, width: values.length * w + 10, height: h + 40});
  values.forEach((v, i) => {
    const bh = Math.max(1, Math.min(1, v) * h), label = `${labels[i]}: ${fmt(v)}`;
    root.append(svg("rect", {class: highlight(i) ? "bar" : "bar off", x: 9 + i * w, y: 10 + h - bh, width: w - 8,
      height: bh, "data-label": label}, svg("title", {text: label})));
    root.append(svg("text", {class: "tick", x: 5 + i * w + w / 2, y: h + 28, "text-anchor": "middle", text: labels[i]}));
  });
  return root;
}

// A copy of a canvas (the picture a request was made from, while the user draws on).
function snapshot(canvas) {
  const copy = el("canvas", {width: canvas.width, height: canvas.height});
  copy.getContext("2d").drawImage(canvas, 0, 0);
  return copy;
}

// The image with one attention map over it: grid [h][w] stretched over cells of cellW × cellH
// pixels, bright where the weight is high (relative to the map's largest).
function overlay(image, grid, scale, cellW, cellH) {
  const h = grid.length, w = grid[0].length;
  const canvas = el("canvas", {class: "overlay", width: Math.round(image.width * scale),
    height: Math.round(image.height * scale), "data-grid": `${h}x${w}`});
  const g = canvas.getContext("2d");
  g.imageSmoothingEnabled = false;
  g.drawImage(image, 0, 0, canvas.width, canvas.height);
  g.fillStyle = "rgba(0, 0, 0, 0.5)"; // dimmed, so that the attention stands out
  g.fillRect(0, 0, canvas.width, canvas.height);
  const heat = el("canvas", {width: w, height: h}), pixels = heat.getContext("2d").createImageData(w, h);
  const max = Math.max(1e-9, ...grid.flat());
  grid.flat().forEach((v, i) => pixels.data.set([255, 200, 40, Math.round((200 * v) / max)], 4 * i));
  heat.getContext("2d").putImageData(pixels, 0, 0);
  g.imageSmoothingEnabled = true;
  g.drawImage(heat, 0, 0, w * cellW * scale, h * cellH * scale);
  return canvas;
}

// ---- inputs -----------------------------------------------------------------------------------------
const field = (label, input) => el("label", {class: "field"}, el("span", {text: label}), input);
const button = (text, onclick, attrs = {}) => el("button", {type: "button", onclick, ...attrs}, text);
const submit = (text = "Run") => el("button", {type: "submit", class: "primary", name: "run"}, text);
const inputShape = (ctx, name) => ctx.meta.inputs.find((i) => i.name === name).shape;

// decode / beam (/ nbest) parameters of the models that search; an empty beam is the model's own.
function decodeFields(ctx, {mode = "beam", nbest = false} = {}) {
  const limit = ((ctx.meta.parameters || {}).limits || {}).beam;
  const decode = el("select", {name: "decode"}, ["beam", "greedy"].map((m) => el("option", {value: m, selected: m === mode}, m)));
  const beam = el("input", {type: "number", name: "beam", min: 1, max: limit, placeholder: "model's"});
  const best = el("input", {type: "number", name: "nbest", min: 1, value: 1});
  const node = el("div", {class: "row"}, field("decode", decode), field("beam", beam), nbest && field("n-best", best));
  const value = () => {
    const params = {decode: decode.value};
    if (decode.value === "beam" && beam.value) params.beam = Number(beam.value);
    if (nbest && Number(best.value) > 1) params.nbest = Number(best.value);
    return params;
  };
  return {node, value};
}

// An image input scaled to height × width pixels (width 0: free, the image's own aspect): upload a
// file; drawable (MNIST models): draw white on black with the mouse. pixels() -> grey values in [0, 1].
function imageInput(ctx, height, width, drawable) {
  const canvas = el("canvas", {class: "input-image", width: width || 4 * height, height, "data-name": "input"});
  const g = canvas.getContext("2d", {willReadFrequently: true});
  const clear = () => { g.fillStyle = drawable ? "#000" : "#fff"; g.fillRect(0, 0, canvas.width, canvas.height); };
  clear();
  const file = el("input", {type: "file", accept: "image/*", name: "image"});
  file.addEventListener("change", async () => {
    if (!file.files.length) return;
    try {
      const bitmap = await createImageBitmap(file.files[0]);
      canvas.width = width || Math.max(1, Math.round((bitmap.width * height) / bitmap.height));
      g.drawImage(bitmap, 0, 0, canvas.width, height);
      ctx.note(`${file.files[0].name}: ${bitmap.width}×${bitmap.height} px, sent as ${canvas.width}×${height}`);
    } catch {
      ctx.fail(`${file.files[0].name} is not an image this browser can read`);
    }
  });
  if (drawable) paintable(canvas, g, width);
  const pixels = () => {
    const rgba = g.getImageData(0, 0, canvas.width, canvas.height).data, grey = new Float32Array(canvas.width * height);
    for (let i = 0; i < grey.length; i++) grey[i] = (rgba[4 * i] + rgba[4 * i + 1] + rgba[4 * i + 2]) / 765;
    return {data: grey, width: canvas.width, image: snapshot(canvas)};
  };
  const node = el("div", {class: "row"}, canvas, el("div", {class: "stack"}, field("image file", file),
    drawable && el("span", {class: "muted", text: "or draw on the canvas with the mouse"}), drawable && button("Clear", clear)));
  return {node, pixels};
}

// Mouse (or pen) strokes on a canvas, about as thick as an MNIST digit's.
function paintable(canvas, g, width) {
  let last = null;
  const at = (e) => {
    const box = canvas.getBoundingClientRect();
    return [((e.clientX - box.left) * canvas.width) / box.width, ((e.clientY - box.top) * canvas.height) / box.height];
  };
  canvas.addEventListener("pointerdown", (e) => { last = at(e); canvas.setPointerCapture(e.pointerId); });
  canvas.addEventListener("pointermove", (e) => {
    if (!last) return;
    const next = at(e);
    Object.assign(g, {strokeStyle: "#fff", lineWidth: Math.max(2, width / 24), lineCap: "round", lineJoin: "round"});
    g.beginPath(); g.moveTo(...last); g.lineTo(...next); g.stroke();
    last = next;
  });
  for (const end of ["pointerup", "pointercancel"]) canvas.addEventListener(end, () => { last = null; });
}

// A WAV file -> mono samples in [-1, 1] at its own rate (16-bit PCM or 32-bit float).
function parseWav(buffer) {
  const view = new DataView(buffer), tag = (o) => String.fromCharCode(...new Uint8Array(buffer, o, 4));
  if (buffer.byteLength < 12 || tag(0) !== "RIFF" || tag(8) !== "WAVE") throw new Error("this is not a WAV file");
  let fmtChunk = null, data = null;
  for (let o = 12; o + 8 <= buffer.byteLength; o += 8 + view.getUint32(o + 4, true) + (view.getUint32(o + 4, true) & 1)) {
    const length = view.getUint32(o + 4, true);
    if (tag(o) === "fmt ") fmtChunk = {channels: view.getUint16(o + 10, true), rate: view.getUint32(o + 12, true),
      bits: view.getUint16(o + 22, true), float: view.getUint16(o + 8, true) === 3};
    if (tag(o) === "data") data = {offset: o + 8, length: Math.min(length, buffer.byteLength - o - 8)};
  }
  if (!fmtChunk || !data) throw new Error("the WAV file has no fmt or data chunk");
  const {channels, bits, float} = fmtChunk;
  if (!(bits === 16 && !float) && !(bits === 32 && float)) throw new Error("the WAV must be 16-bit PCM or 32-bit float");
  const frame = (channels * bits) / 8, n = Math.floor(data.length / frame), mono = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    let sum = 0;
    for (let c = 0; c < channels; c++) {
      const o = data.offset + i * frame + (c * bits) / 8;
      sum += float ? view.getFloat32(o, true) : view.getInt16(o, true) / 32768;
    }
    mono[i] = sum / channels;
  }
  return {samples: mono, rate: fmtChunk.rate};
}

// Linear interpolation to another sample rate.
function resample(samples, from, to) {
  if (from === to) return samples;
  const out = new Float32Array(Math.max(1, Math.round((samples.length * to) / from)));
  for (let i = 0; i < out.length; i++) {
    const x = (i * from) / to, j = Math.min(Math.floor(x), samples.length - 1), f = x - j;
    out[i] = samples[j] * (1 - f) + samples[Math.min(j + 1, samples.length - 1)] * f;
  }
  return out;
}

// Numbers typed as lines of values, apart by whitespace or commas (bits: "0110" is four values too):
// [lines][values]. Anything not a number goes to the server as it is, which names what is wrong.
function parseLines(text, bits = false) {
  return text.trim().split(/\n+/).map((line) => {
    const words = bits && !/[\s,]/.test(line.trim()) ? [...line.trim()] : line.trim().split(/[\s,]+/);
    return words.map((w) => (w !== "" && Number.isFinite(Number(w)) ? Number(w) : w));
  });
}

// ---- one widget per kind: build(ctx) adds its inputs to ctx.form and sets ctx.submit ------------------
const result = (name, text) => el("p", {class: "result", "data-result": name}, text === "" ? "(empty)" : text);

const translation = {
  title: "translation",
  help: "German text in; the translation, the n-best list when asked for, and the alignment: each target piece's attention over the source pieces.",
  build(ctx) {
    const text = el("textarea", {name: "text", rows: 2, required: true}, "Wo ist der Bahnhof?");
    const params = decodeFields(ctx, {nbest: true});
    ctx.form.append(field("text", text), params.node, submit("Translate"));
    ctx.submit = () => ctx.run({inputs: [{name: "text", datatype: "BYTES", shape: [1], data: [text.value]}],
      parameters: params.value()}, (o, out) => {
      out.append(result("translation", o.translation.data[0]));
      const nbest = o.nbest.data.filter((h, k) => k === 0 || h);
      if (nbest.length > 1) out.append(el("ol", {class: "nbest"}, nbest.map((h, k) => el("li", {}, h,
        el("span", {class: "muted", text: `  score ${fmt(o.nbest_scores.data[k])}`})))));
      const source = o.source_pieces.data.filter(Boolean), target = o.target_pieces.data.filter(Boolean);
      const weights = rows(sub(o.attention, 0)).slice(0, target.length).map((r) => r.slice(0, source.length));
      out.append(figure(`alignment: ${target.length} target pieces (rows) × ${source.length} source pieces (columns)`,
        heatmap(weights, target, source, {name: "alignment"})));
    });
  },
};

// Captioning, RAM and OCR share the image input; each draws its own attention.
const caption = {
  title: "image captioning",
  help: "An image in (upload one, or draw digits with the mouse); the caption and each word's attention over the image.",
  build(ctx) {
    const [, height, width] = inputShape(ctx, "image");
    const image = imageInput(ctx, height, width, true), params = decodeFields(ctx);
    ctx.form.append(image.node, params.node, submit("Caption"));
    ctx.submit = () => {
      const px = image.pixels();
      ctx.run({inputs: [{name: "image", datatype: "FP32", shape: [1, height, width], data: px.data}],
        parameters: params.value()}, (o, out) => {
        out.append(result("caption", o.caption.data[0]));
        const words = o.words.data.filter(Boolean), [h, w] = o.attention.shape.slice(2);
        const maps = words.map((word, t) => el("figure", {class: "attn"},
          overlay(px.image, rows(sub(o.attention, 0, t)), 3, width / w, height / h), el("figcaption", {text: word})));
        out.append(figure(`each word's attention over the ${h}×${w} feature grid`, el("div", {class: "strip"}, maps)));
      });
    };
  },
};

const glimpse = {
  title: "recurrent attention (RAM)",
  help: "An image in (upload one, or draw a digit with the mouse); the class and the path of glimpses the model took.",
  build(ctx) {
    const [, height, width] = inputShape(ctx, "image");
    const image = imageInput(ctx, height, width, true);
    ctx.form.append(image.node, submit("Classify"));
    ctx.submit = () => {
      const px = image.pixels();
      ctx.run({inputs: [{name: "image", datatype: "FP32", shape: [1, height, width], data: px.data}]}, (o, out) => {
        const logits = o.logits.data, top = Math.max(...logits);
        const exp = logits.map((v) => Math.exp(v - top)), total = exp.reduce((a, b) => a + b, 0);
        out.append(result("class", `class ${o.pred.data[0]}`));
        const scale = Math.max(2, Math.round(240 / width));
        out.append(el("div", {class: "row"},
          figure("glimpse centres in order", glimpsePath(px.image, rows(sub(o.locations, 0)), scale)),
          figure("class probabilities", bars(exp.map((v) => v / total), exp.map((_, k) => String(k)),
            {name: "probabilities", highlight: (k) => k === o.pred.data[0]}))));
      });
    };
  },
};

function glimpsePath(image, locations, scale) {
  const w = image.width * scale, h = image.height * scale;
  const root = svg("svg", {class: "glimpses", width: w, height: h, "data-glimpses": locations.length},
    svg("image", {class: "pixelated", href: image.toDataURL(), x: 0, y: 0, width: w, height: h}));
  const points = locations.map(([x, y]) => [((x + 1) / 2) * w, ((y + 1) / 2) * h]); // (x, y) in -1..1
  root.append(svg("polyline", {class: "glimpse-path", points: points.map((p) => p.join(",")).join(" ")}));
  points.forEach(([x, y], g) => {
    const label = `glimpse ${g + 1}: x ${fmt(locations[g][0], 2)}, y ${fmt(locations[g][1], 2)}`;
    root.append(svg("circle", {class: "glimpse", cx: x, cy: y, r: 8, "data-label": label}, svg("title", {text: label})),
      svg("text", {class: "glimpse-n", x, y: y + 4, "text-anchor": "middle", text: g + 1}));
  });
  return root;
}

const ocr = {
  title: "text recognition (OCR)",
  help: "A text-line image in (upload one, or render a word here); the text and each letter's attention over the image.",
  build(ctx) {
    const height = inputShape(ctx, "image")[1];
    const image = imageInput(ctx, height, 0, false), word = el("input", {type: "text", name: "word", value: "attention"});
    const canvas = image.node.querySelector("canvas");
    const render = () => { // black on white in this browser's sans-serif, at the model's height
      const g = canvas.getContext("2d");
      g.font = `${Math.round(height * 0.7)}px sans-serif`;
      canvas.width = Math.ceil(g.measureText(word.value).width + height / 2);
      Object.assign(g, {fillStyle: "#fff", font: `${Math.round(height * 0.7)}px sans-serif`, textBaseline: "middle"});
      g.fillRect(0, 0, canvas.width, height);
      g.fillStyle = "#000";
      g.fillText(word.value, height / 4, height / 2);
    };
    render();
    const params = decodeFields(ctx);
    ctx.form.append(image.node, el("div", {class: "row"}, field("word", word), button("Render", render)), params.node,
      submit("Read"));
    ctx.submit = () => {
      const px = image.pixels();
      ctx.run({inputs: [{name: "image", datatype: "FP32", shape: [1, height, px.width], data: px.data}],
        parameters: params.value()}, (o, out) => {
        out.append(result("text", o.text.data[0]));
        const letters = o.letters.data.filter(Boolean), [h, w] = o.attention.shape.slice(2);
        const maps = letters.map((letter, t) => el("figure", {class: "attn"},
          overlay(px.image, rows(sub(o.attention, 0, t)), 2, px.width / w, height / h), el("figcaption", {text: letter})));
        out.append(figure(`each letter's attention over ${h}×${w} cells of the image`, el("div", {class: "strip"}, maps)));
      });
    };
  },
};

const RATE = 16000; // the speech models' input rate (docs/serving.md): a WAV at another rate is resampled here
const speech = {
  title: "speech recognition",
  help: "A WAV file in (16 kHz mono is sent as it is); the digits and each character's alignment over time (encoder steps of 30 ms).",
  build(ctx) {
    const file = el("input", {type: "file", accept: ".wav,audio/wav,audio/x-wav", name: "audio"});
    const params = decodeFields(ctx);
    let clip = null;
    file.addEventListener("change", async () => {
      clip = null;
      if (!file.files.length) return;
      try {
        const wav = parseWav(await file.files[0].arrayBuffer());
        clip = resample(wav.samples, wav.rate, RATE);
        ctx.note(`${file.files[0].name}: ${(clip.length / RATE).toFixed(2)} s${wav.rate === RATE ? "" : `, resampled from ${wav.rate} Hz`}`);
      } catch (err) {
        ctx.fail(`${file.files[0].name}: ${err.message}`);
      }
    });
    ctx.form.append(field("WAV file", file), params.node, submit("Transcribe"));
    ctx.submit = () => {
      if (!clip) return ctx.fail("choose a WAV file first");
      const samples = clip;
      return ctx.run({inputs: [{name: "audio", datatype: "FP32", shape: [1, samples.length], data: samples}],
        parameters: params.value()}, (o, out) => {
        const text = o.text.data[0], [steps, frames] = o.alignment.shape.slice(1);
        out.append(result("text", text));
        const labels = [...text, "</s>"].slice(0, steps).concat(Array(Math.max(0, steps - text.length - 1)).fill(""));
        const times = Array.from({length: frames}, (_, f) => `${(f * 0.03).toFixed(2)} s`);
        out.append(figure(`alignment: ${steps} characters (rows) × ${frames} encoder steps of 30 ms (columns), under the waveform`,
          heatmap(rows(sub(o.alignment, 0)), labels, times, {name: "alignment", band: samples})));
      });
    };
  },
};

const ntm = {
  title: "Neural Turing Machine",
  help: "Bit vectors in, one time step per line (the copy task: the vectors, a delimiter step, blanks); the output bits and the heads' weightings over memory.",
  build(ctx) {
    const width = inputShape(ctx, "x")[2];
    const length = el("input", {type: "number", name: "length", min: 1, max: 64, value: 6});
    const bits = el("textarea", {name: "x", rows: 10, class: "mono"});
    const generate = () => { // the copy task's layout: the delimiter is the last channel
      const n = Number(length.value) || 1, rand = () => (Math.random() < 0.5 ? "0" : "1");
      const seq = Array.from({length: n}, () => Array.from({length: width - 1}, rand).join("") + "0");
      bits.value = [...seq, "0".repeat(width - 1) + "1", ...Array(n).fill("0".repeat(width))].join("\n");
    };
    generate();
    ctx.form.append(el("div", {class: "row"}, field("vectors", length), button("Generate a copy task", generate)),
      field(`x: ${width} bits per time step`, bits), submit());
    ctx.submit = () => {
      const x = parseLines(bits.value, true);
      ctx.run({inputs: [{name: "x", datatype: "FP32", shape: [1, x.length, width], data: x.flat()}]}, (o, out) => {
        const steps = o.logits.shape[1], stepLabels = Array.from({length: steps}, (_, t) => `t ${t}`);
        const shown = o.bits || {...o.logits, data: o.logits.data.map(sigmoid)};
        out.append(el("div", {class: "row"},
          figure("input x (steps × bits)", heatmap(x, stepLabels, x[0].map((_, i) => `${i}`), {name: "input"})),
          figure(o.bits ? "output bits" : "output σ(logits)", heatmap(rows(sub(shown, 0)), stepLabels,
            Array.from({length: shown.shape[2]}, (_, i) => `${i}`), {name: "output"}))));
        for (const out4 of Object.values(o).filter((t) => t.shape && t.shape.length === 4)) { // [1, T, heads, slots]
          const [, , heads, slots] = out4.shape, slotLabels = Array.from({length: slots}, (_, m) => `slot ${m}`);
          for (let k = 0; k < heads; k++) {
            const grid = Array.from({length: steps}, (_, t) => sub(out4, 0, t, k).data);
            out.append(figure(`${out4.name}, head ${k}: ${steps} steps (rows) × ${slots} memory slots (columns)`,
              heatmap(grid, stepLabels, slotLabels, {name: `${out4.name}-${k}`})));
          }
        }
      });
    };
  },
};

const draw = {
  title: "DRAW",
  help: "Prior noise z_t ~ N(0, I) in, drawn here from a seed, as many steps as asked; the canvas after each step, with its write window.",
  build(ctx) {
    const latent = inputShape(ctx, "x")[2];
    const steps = el("input", {type: "number", name: "steps", min: 1, max: 64, value: 16});
    const seed = el("input", {type: "number", name: "seed", value: 1});
    ctx.form.append(el("div", {class: "row"}, field("steps", steps), field("seed", seed)), submit("Draw"));
    ctx.submit = () => {
      const t = Math.max(1, Number(steps.value) || 1);
      ctx.run({inputs: [{name: "x", datatype: "FP32", shape: [1, t, latent], data: gaussian(Number(seed.value), t * latent)}]},
        (o, out) => {
          const windows = o.write_window ? rows(sub(o.write_window, 0)) : [];
          const canvases = rows(sub(o.logits, 0)).map((logits, k) => el("figure", {class: "attn"},
            drawCanvas(logits, windows[k], 5), el("figcaption", {text: `step ${k + 1}`})));
          out.append(figure("the canvas σ(logits) after each step; the write window in red (centre gX, gY; width N·δ)",
            el("div", {class: "strip"}, canvases)));
        });
    };
  },
};

function drawCanvas(logits, window, scale) {
  const side = Math.round(Math.sqrt(logits.length));
  const canvas = el("canvas", {class: "overlay", width: side * scale, height: side * scale, "data-side": side});
  const small = el("canvas", {width: side, height: side}), pixels = small.getContext("2d").createImageData(side, side);
  logits.forEach((v, i) => { const p = Math.round(255 * sigmoid(v)); pixels.data.set([p, p, p, 255], 4 * i); });
  small.getContext("2d").putImageData(pixels, 0, 0);
  const g = canvas.getContext("2d");
  g.imageSmoothingEnabled = false;
  g.drawImage(small, 0, 0, canvas.width, canvas.height);
  if (window) { // gX, gY count pixels from 1 (the paper's grid); N·δ is the window's width
    const [gx, gy, extent] = window;
    Object.assign(g, {strokeStyle: "#e33", lineWidth: 2});
    g.strokeRect((gx - 0.5 - extent / 2) * scale, (gy - 0.5 - extent / 2) * scale, extent * scale, extent * scale);
  }
  return canvas;
}

const pointers = {
  title: "pointer network",
  help: "Click points on the plane (a 1-D model takes the x of each click); the order the model points in, and each step's pointer attention over END and the points.",
  build(ctx) {
    const dims = inputShape(ctx, "points")[2], side = 320;
    const coords = el("textarea", {name: "points", rows: 6, class: "mono"});
    const plane = svg("svg", {class: "plane", width: side, height: side, "data-name": "plane"});
    const parse = () => parseLines(coords.value).filter((p) => p.length && p[0] !== "");
    const redraw = () => plot(plane, parse(), dims, side);
    const add = (x, y) => { coords.value += `${coords.value.trim() ? "\n" : ""}${[x, y].slice(0, dims).join(" ")}`; redraw(); };
    plane.addEventListener("click", (e) => { // to 3 decimals: what is sent is what the box shows
      const box = plane.getBoundingClientRect(), r = (v) => Math.round(v * 1000) / 1000;
      add(r((e.clientX - box.left) / box.width), r(1 - (e.clientY - box.top) / box.height));
    });
    coords.addEventListener("input", redraw);
    const random = () => { coords.value = ""; for (let i = 0; i < 8; i++) add(Math.random().toFixed(3), Math.random().toFixed(3)); };
    const params = decodeFields(ctx, {mode: "greedy"});
    ctx.form.append(el("div", {class: "row"}, plane, el("div", {class: "stack"},
      field(`points: ${dims} coordinate${dims > 1 ? "s" : ""} per line`, coords),
      el("div", {class: "row"}, button("Random", random), button("Clear", () => { coords.value = ""; redraw(); })))),
    params.node, submit("Point"));
    redraw();
    ctx.submit = () => {
      const points = parse();
      ctx.run({inputs: [{name: "points", datatype: "FP32", shape: [1, points.length, dims], data: points.flat()}],
        parameters: params.value()}, (o, out) => {
        const k = o.lengths.data[0], order = o.pointers.data.slice(0, k);
        const weights = rows(sub(o.attention, 0)).slice(0, k + 1);
        const rings = (r) => plot(plane, points, dims, side, order, weights[r]);
        rings(0);
        out.append(result("order", `order: ${order.join(" → ")}`));
        out.append(figure(`pointer attention: ${k + 1} output steps (rows) × END and ${points.length} points (columns); hover a row to see it on the plane`,
          heatmap(weights, [...order.map((p, s) => `${s + 1}: p${p}`), "END"], ["END", ...points.map((_, i) => `p${i}`)],
            {name: "pointers", onrow: rings})));
      });
    };
  },
};

// The points on the plane; with an answer, the path in the model's order and one step's attention
// as rings (radius grows with the weight).
function plot(plane, points, dims, side, order = [], weights = null) {
  const xy = (p) => [p[0] * side, dims > 1 ? (1 - p[1]) * side : side / 2];
  plane.replaceChildren(svg("rect", {class: "plane-bg", width: side, height: side}));
  if (dims === 1) plane.append(svg("line", {class: "axis", x1: 0, x2: side, y1: side / 2, y2: side / 2}));
  const valid = order.filter((i) => i >= 0 && i < points.length);
  if (valid.length) plane.append(svg("polyline", {class: "path", points: valid.map((i) => xy(points[i]).join(",")).join(" ")}));
  points.forEach((p, i) => {
    if (p.some((v) => typeof v !== "number")) return;
    const [x, y] = xy(p), w = weights ? weights[i + 1] : 0, label = `p${i}: ${p.join(", ")}${weights ? `, attention ${fmt(w)}` : ""}`;
    if (weights) plane.append(svg("circle", {class: "ring", cx: x, cy: y, r: 4 + 22 * Math.sqrt(w)}));
    plane.append(svg("circle", {class: "point", cx: x, cy: y, r: 4, "data-label": label}, svg("title", {text: label})),
      svg("text", {class: "tick", x: x + 6, y: y - 6, text: valid.includes(i) ? `p${i} (${valid.indexOf(i) + 1})` : `p${i}`}));
  });
}

const act = {
  title: "Adaptive Computation Time",
  help: "A vector of -1, 0 and 1 in; its parity, how long the model pondered, and each ponder step's halting probability.",
  build(ctx) {
    const n = inputShape(ctx, "x")[1];
    const x = el("input", {type: "text", name: "x", class: "mono wide"});
    const random = () => { x.value = Array.from({length: n}, () => [-1, 0, 1][Math.floor(Math.random() * 3)]).join(" "); };
    random();
    ctx.form.append(el("div", {class: "row"}, field(`x: ${n} values of -1, 0 or 1`, x), button("Random", random)), submit());
    ctx.submit = () => {
      const values = parseLines(x.value).flat();
      ctx.run({inputs: [{name: "x", datatype: "FP32", shape: [1, values.length], data: values}]}, (o, out) => {
        const steps = o.steps.data[0], halting = o.halting.data;
        out.append(result("parity", `parity ${o.bits.data[0]} · ${fmt(steps, 0)} ponder steps · ponder cost ${fmt(o.ponder.data[0])}`));
        out.append(figure(`halting probability of each of the ${halting.length} possible ponder steps (the steps taken in colour)`,
          bars(halting, halting.map((_, i) => `${i + 1}`), {name: "halting", highlight: (i) => i < steps})));
      });
    };
  },
};

const table = {
  title: "Neural Programmer",
  help: "A question and a small table (first line: the column names); the answer and the operation and column each program step chose.",
  build(ctx) {
    const question = el("input", {type: "text", name: "question", class: "wide", value: "first height"});
    const grid = el("textarea", {name: "table", rows: 8, class: "mono"},
      "height age year\n26 98 54\n73 7 72\n48 35 83\n82 53 81\n82 29 93\n52 63 1");
    ctx.form.append(field("question", question), field("table", grid), submit("Answer"));
    ctx.submit = () => {
      const [header, ...lines] = grid.value.trim().split(/\n+/);
      const columns = header.trim().split(/[\s,]+/), cells = parseLines(lines.join("\n"));
      ctx.run({inputs: [{name: "question", datatype: "BYTES", shape: [1], data: [question.value]},
        {name: "columns", datatype: "BYTES", shape: [1, columns.length], data: columns},
        {name: "table", datatype: "FP32", shape: [1, cells.length, columns.length], data: cells.flat()}]}, (o, out) => {
        const picked = o.cells.data, lookup = o.is_lookup.data[0];
        out.append(result("answer", lookup ? "answer: the highlighted cells" : `answer: ${fmt(o.answer.data[0], 2)}`));
        out.append(el("table", {class: "np"}, el("tr", {}, columns.map((c) => el("th", {text: c}))),
          cells.map((row, r) => el("tr", {}, row.map((v, c) => el("td", {class: picked[r * columns.length + c] ? "picked" : null, text: v}))))));
        const ops = rows(sub(o.op_weights, 0)), cols = rows(sub(o.col_weights, 0));
        const argmax = (a) => a.indexOf(Math.max(...a)), stepLabels = ops.map((_, t) => `step ${t + 1}`);
        // the operations' names, as the model's metadata lists them (ServedModel.labels)
        const names = ((ctx.meta.parameters || {}).labels || {}).op_weights || ops[0].map((_, k) => `operation ${k}`);
        out.append(el("ol", {class: "program"}, ops.map((w, t) => el("li", {"data-step": t},
          `${names[argmax(w)]} (${fmt(w[argmax(w)], 2)}) on column ${columns[argmax(cols[t])]} (${fmt(cols[t][argmax(cols[t])], 2)})`))));
        out.append(el("div", {class: "row"},
          figure("operation choice per step", heatmap(ops, stepLabels, names, {name: "operations"})),
          figure("column choice per step", heatmap(cols, stepLabels, columns, {name: "columns"}))));
      });
    };
  },
};

const generic = {
  title: "ONNX graph",
  help: "The graph's own inputs as a JSON inference request (zeros to start with); the answer's tensors.",
  build(ctx) {
    const inputs = ctx.meta.inputs.filter((i) => !i.optional).map((i) => {
      const shape = i.shape.map((d) => (d < 0 ? 1 : d));
      return {name: i.name, datatype: i.datatype, shape, data: Array(size(shape)).fill(i.datatype === "BYTES" ? "" : 0)};
    });
    const body = el("textarea", {name: "request", rows: 10, class: "mono"}, JSON.stringify({inputs}, null, 1));
    ctx.form.append(field("request", body), submit());
    ctx.submit = () => {
      let request;
      try { request = JSON.parse(body.value); } catch (err) { return ctx.fail(`the request is not JSON: ${err.message}`); }
      return ctx.run(request, (o, out) => out.append(el("pre", {class: "mono"}, Object.values(o).filter((t) => t.shape)
        .map((t) => `${t.name} ${t.datatype} [${t.shape}]: ${JSON.stringify(t.data).slice(0, 300)}\n`))));
    };
  },
};

const WIDGETS = {translation, image_caption: caption, glimpse, text_image: ocr, audio: speech, points: pointers,
  table_question: table};

// The widget of a model's kind; the kinds served as plain graphs or recurrent loops are told apart by outputs.
function widgetFor(meta) {
  const kind = (meta.parameters || {}).kind, outputs = meta.outputs.map((o) => o.name);
  if (kind === "recurrent") return outputs.includes("write_window") ? ["draw", draw] : ["ntm", ntm];
  if (kind === "graph" && outputs.includes("halting")) return ["act", act];
  return WIDGETS[kind] ? [kind, WIDGETS[kind]] : ["graph", generic];
}

// ---- the page -----------------------------------------------------------------------------------------
// The model's panel: header, version choice, the widget's inputs, a status line and the answer.
function panelFor(meta) {
  const [id, widget] = widgetFor(meta), params = meta.parameters || {}, panel = $("#panel");
  const form = el("form", {class: "inputs"}), status = el("p", {class: "status", role: "status"}), out = el("div", {class: "answer"});
  const ctx = {meta, form, version: null, submit: null};
  const versions = meta.versions.length > 1 && el("select", {name: "version", onchange: (e) => { ctx.version = e.target.value; }},
    el("option", {value: "", text: `default (${params.default_version ?? "none"})`}),
    meta.versions.map((v) => el("option", {value: v, text: `version ${v}`})));
  const show = (text, state, cls = "status") => { status.textContent = text; status.className = cls; panel.dataset.state = state; };
  ctx.note = (text) => show(text, "ready");
  ctx.fail = (text) => show(text, "error", "status error");
  ctx.run = async (body, draw) => { // one request; its answer drawn, or the server's sentence shown
    show("asking the server…", "busy");
    const started = performance.now();
    try {
      const answer = await infer(meta.name, ctx.version, body);
      out.replaceChildren();
      draw(answer, out);
      show(`answered by version ${answer.model_version} in ${Math.round(performance.now() - started)} ms`, "done");
    } catch (err) {
      ctx.fail(err.message);
    }
  };
  form.addEventListener("submit", (e) => { e.preventDefault(); if (ctx.submit) ctx.submit(); });
  panel.replaceChildren(el("h2", {}, meta.name, " ", el("span", {class: "kind", text: widget.title})),
    el("p", {class: "muted", text: widget.help}), versions ? field("version", versions) : "", form, status, out);
  Object.assign(panel.dataset, {kind: id, model: meta.name, state: "ready"});
  widget.build(ctx);
}

async function openModel(name) {
  if (!name) return;
  document.querySelectorAll("#models a").forEach((a) => a.classList.toggle("active", a.dataset.model === name));
  const panel = $("#panel");
  panel.dataset.state = "loading";
  try {
    panelFor(await getJSON(modelPath(name)));
  } catch (err) {
    panel.replaceChildren(el("p", {class: "status error", text: err.message}));
    panel.dataset.state = "error";
  }
}

let served = new Map(); // name -> versions, from the repository index
function listModels() {
  const graphs = $("#show-graphs").checked;
  $("#models").replaceChildren(...[...served].filter(([name]) => graphs || !name.includes(".")).map(([name, versions]) =>
    el("li", {}, el("a", {href: `#${encodeURIComponent(name)}`, "data-model": name, text: name}),
      el("span", {class: "muted", text: ` v${versions.join(", ")}`}))));
}

async function start() {
  try {
    const [server, index] = await Promise.all([getJSON("v2"), postJSON("v2/repository/index", {ready: true})]);
    $("#server").textContent = `${server.name} ${server.version} · ${index.length} model versions`;
    served = new Map();
    for (const m of index) served.set(m.name, [...(served.get(m.name) || []), m.version]);
    listModels();
  } catch (err) {
    $("#server").textContent = err.message;
    $("#server").className = "error";
    return;
  }
  $("#show-graphs").addEventListener("change", listModels);
  window.addEventListener("hashchange", () => openModel(decodeURIComponent(location.hash.slice(1))));
  openModel(decodeURIComponent(location.hash.slice(1)));
}

start();
