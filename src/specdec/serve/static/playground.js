// specdec playground: a client of this server's OpenAI-compatible API, nothing more.
// It streams with stream_options.include_speculation, so every chunk carries its round:
// {round, k, source, accepted, tokens: [{id, text, origin}]}, origin being accepted (a draft
// kept; `source` says whose), corrected (the target's token at the first rejected draft),
// bonus (the target's extra token after a fully accepted round) or target (a round that drafted
// nothing). docs/api-extensions.md defines them; serve/origins.py computes them.
"use strict";

const KEY_STORE = "specdec-api-key";
const BAR_PX_PER_TOKEN = 4; // round strip: height per drafted token
const BAR_MAX_PX = 64;
const POSITION_PX = 56; // acceptance by position: the height of a rate of 1
const state = { model: null, card: null, history: [], last: null, controller: null };

const $ = (id) => document.getElementById(id);

function setStatus(text, error = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", error);
}

function setPhase(phase) {
  // what the page is doing, for people (buttons) and for tests (data-state on <body>)
  document.body.dataset.state = phase;
  const busy = phase === "streaming" || phase === "comparing";
  $("send").disabled = busy || !state.model;
  $("stop").disabled = !busy;
  $("compare").disabled = busy || !state.last || !state.last.run.done;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// ------------------------------------------------------------------ the model and its drafters
async function loadModel() {
  let r;
  try {
    r = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    setStatus("cannot reach the server: " + e.message, true);
    return;
  }
  if (r.status === 401) {
    $("key-row").hidden = false;
    $("model").textContent = "";
    setStatus("this server needs its API key", true);
    setPhase("locked");
    return;
  }
  if (!r.ok) {
    setStatus("GET /v1/models: HTTP " + r.status, true);
    return;
  }
  $("key-row").hidden = true;
  const card = (await r.json()).data[0];
  state.model = card.id;
  state.card = card.speculation || null;
  $("model").textContent = card.id + (card.draft ? " · draft " + card.draft : "");
  fillControls();
  setStatus("ready");
  setPhase("ready");
}

function fillControls() {
  const drafter = $("drafter");
  while (drafter.options.length > 1) drafter.remove(1);
  const def = state.card ? state.card.default : null;
  const defDrafter = def ? def.drafter || "the prediction if given, else none" : "?";
  drafter.options[0].textContent = "server default (" + defDrafter + ")";
  for (const d of state.card ? state.card.drafters : []) drafter.add(new Option(d, d));
  const k = def && def.k !== null ? String(def.k) : "?";
  $("k-mode").options[0].textContent = "server default (" + k + ")";
  if (state.card) {
    $("k-value").max = state.card.max_k;
    $("k-max").max = state.card.max_k;
  }
}

function showKInputs() {
  $("k-value").hidden = $("k-mode").value !== "fixed";
  $("k-max").hidden = $("k-mode").value !== "auto";
}

// ------------------------------------------------------------------ requests
function speculationFromControls() {
  const spec = {};
  const drafter = $("drafter").value;
  if (drafter) spec.drafter = drafter;
  const mode = $("k-mode").value;
  if (drafter !== "none" && mode === "auto") {
    spec.k = "auto";
    if ($("k-max").value) spec.k_max = Number($("k-max").value);
  } else if (drafter !== "none" && mode === "fixed") {
    spec.k = Number($("k-value").value);
  }
  return Object.keys(spec).length ? spec : null;
}

function buildRequest(message) {
  const body = {
    model: state.model,
    stream: true,
    stream_options: { include_usage: true, include_speculation: true },
    max_tokens: Number($("max-tokens").value) || 256,
    temperature: Number($("temperature").value) || 0,
    seed: Math.floor(Math.random() * 2 ** 31),
  };
  const prediction = $("prediction").value;
  if (prediction) body.prediction = { type: "content", content: prediction };
  const schema = $("schema").value.trim();
  if (schema) {
    // the server names what is wrong with a schema that is not JSON or not a schema
    let parsed = schema;
    try { parsed = JSON.parse(schema); } catch (e) { /* sent as text: the 400 says why */ }
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: parsed } };
  }
  const spec = speculationFromControls();
  if (spec) body.speculation = spec;
  if ($("api").value === "chat") {
    body.messages = [...state.history, { role: "user", content: message }];
    return { path: "/v1/chat/completions", body };
  }
  body.prompt = message; // completions: the raw text, no conversation
  return { path: "/v1/completions", body };
}

async function* serverEvents(response) {
  // the SSE body as its `data:` payloads (JSON text, or "[DONE]")
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

class ApiFailure extends Error {
  constructor(status, error) {
    super(error && error.message ? error.message : "HTTP " + status);
    this.status = status;
    this.code = error ? error.code : null;
  }
}

// One streamed request: its timings and counts, and (when shown) its tokens in the page.
class Run {
  constructor(answerEl) {
    this.answerEl = answerEl;
    this.t0 = performance.now();
    this.tFirst = null;
    this.tLast = null;
    this.tokens = 0;
    this.rounds = 0;
    this.drafted = 0;
    this.accepted = 0;
    this.draftingRounds = 0;
    this.draftedAt = []; // draft position i: rounds that drafted it
    this.acceptedAt = []; // ... and whose draft there was accepted
    this.content = ""; // the streamed text, as any client would assemble it
    this.sawOrigins = false;
    this.usage = null;
    this.done = false;
  }

  chunk(obj) {
    if (obj.error) throw new ApiFailure(500, obj.error);
    if (obj.usage) this.usage = obj.usage;
    const choice = obj.choices && obj.choices[0];
    if (!choice) return;
    const text = choice.delta ? choice.delta.content : choice.text;
    if (text) this.content += text;
    if (choice.speculation) {
      this.round(choice.speculation);
    } else if (text && !this.sawOrigins && this.answerEl) {
      this.answerEl.append(text); // a server without the extension: plain text
    }
  }

  round(r) {
    const now = performance.now();
    if (this.tFirst === null) this.tFirst = now;
    this.tLast = now;
    this.sawOrigins = true;
    this.rounds += 1;
    this.tokens += r.tokens.length;
    if (r.k > 0) {
      this.drafted += r.k;
      this.accepted += r.accepted;
      this.draftingRounds += 1;
      for (let i = 0; i < r.k; i++) {
        this.draftedAt[i] = (this.draftedAt[i] || 0) + 1;
        this.acceptedAt[i] = (this.acceptedAt[i] || 0) + (i < r.accepted ? 1 : 0);
      }
    }
    if (!this.answerEl) return;
    for (const t of r.tokens) this.answerEl.append(tokenSpan(t, r));
    const box = $("conversation");
    box.scrollTop = box.scrollHeight; // follow the answer as it streams
    $("rounds").append(roundBar(r));
    drawPositions(this.draftedAt, this.acceptedAt);
    showStats(this);
  }

  seconds() {
    const end = this.tLast === null ? performance.now() : this.tLast;
    return (end - this.t0) / 1000;
  }

  tokensPerSecond() {
    // end to end, as a user waits for it: from sending the request to the latest token
    const s = this.seconds();
    return s > 0 ? this.tokens / s : 0;
  }
}

function sourceClass(source) {
  if (source === "model") return "model";
  if (source && source.startsWith("lookup")) return "lookup";
  if (source && source.startsWith("prediction")) return "prediction";
  if (source === "grammar") return "grammar";
  return "other";
}

function tokenSpan(t, r) {
  const span = document.createElement("span");
  span.className = "tok " + t.origin;
  const source = t.source || r.source; // a grammar's forced tokens lead their round
  if (t.origin === "accepted") span.classList.add("src-" + sourceClass(source));
  span.textContent = t.text;
  const what = t.origin === "accepted" ? "accepted draft from " + source : t.origin;
  span.title = "round " + r.round + ", K = " + r.k + ", " + r.accepted + " accepted: " + what;
  return span;
}

function roundBar(r) {
  const bar = document.createElement("div");
  bar.className = "bar" + (r.k === 0 ? " plain" : "");
  bar.style.height = Math.min(BAR_MAX_PX, BAR_PX_PER_TOKEN * (r.k + 1)) + "px";
  if (r.k > 0) {
    const fill = document.createElement("div");
    fill.className = "fill";
    fill.style.height = (100 * r.accepted) / r.k + "%";
    bar.append(fill);
  }
  bar.title =
    "round " + r.round + ": " + (r.k ? r.accepted + " of " + r.k + " drafts accepted" : "no draft") +
    (r.source ? " (" + r.source + ")" : "");
  return bar;
}

function drawPositions(drafted, accepted) {
  const box = $("positions");
  box.replaceChildren();
  drafted.forEach((d, i) => {
    const rate = d ? accepted[i] / d : 0;
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.style.height = POSITION_PX + "px";
    const fill = document.createElement("div");
    fill.className = "fill";
    fill.style.height = 100 * rate + "%";
    const n = document.createElement("span");
    n.className = "n";
    n.textContent = String(i + 1);
    bar.append(fill, n);
    bar.title = "position " + (i + 1) + ": " + accepted[i] + " / " + d + " (" + (100 * rate).toFixed(0) + "%)";
    box.append(bar);
  });
}

function showStats(run) {
  $("stat-tps").textContent = run.tokensPerSecond().toFixed(1);
  $("stat-tokens").textContent = String(run.tokens);
  $("stat-rounds").textContent = String(run.rounds);
  $("stat-accept").textContent = run.drafted
    ? run.accepted + " / " + run.drafted + " (" + ((100 * run.accepted) / run.drafted).toFixed(0) + "%)"
    : "no drafts";
  // 1 + accepted / drafting rounds: the bonus or corrected token included (core.metrics)
  $("stat-mal").textContent = run.draftingRounds ? (1 + run.accepted / run.draftingRounds).toFixed(2) : "–";
  $("stat-ttft").textContent = run.tFirst === null ? "–" : ((run.tFirst - run.t0) / 1000).toFixed(2) + " s";
}

async function stream(path, body, run) {
  state.controller = new AbortController();
  const response = await fetch(path, {
    method: "POST",
    headers: headers(),
    body: JSON.stringify(body),
    signal: state.controller.signal,
  });
  if (!response.ok) {
    let error = null;
    try {
      error = (await response.json()).error;
    } catch (e) {
      error = null;
    }
    throw new ApiFailure(response.status, error);
  }
  const ticker = setInterval(() => run.answerEl && showStats(run), 250);
  try {
    for await (const data of serverEvents(response)) {
      if (data === "[DONE]") {
        run.done = true;
        break;
      }
      run.chunk(JSON.parse(data));
    }
  } finally {
    clearInterval(ticker);
  }
  if (!run.done) throw new Error("the stream ended before [DONE]");
}

function addTurn(kind, text) {
  const div = document.createElement("div");
  div.className = "turn " + kind;
  if (text) div.textContent = text;
  $("conversation").append(div);
  return div;
}

function resetViews() {
  $("rounds").replaceChildren();
  $("positions").replaceChildren();
  $("compare-box").hidden = true;
  for (const id of ["stat-tps", "stat-tokens", "stat-accept", "stat-mal", "stat-rounds", "stat-ttft"]) {
    $(id).textContent = "–";
  }
}

async function send() {
  const message = $("message").value;
  if (!message.trim()) {
    setStatus("type a message first", true);
    return;
  }
  resetViews();
  const req = buildRequest(message);
  addTurn("user", message);
  const answer = addTurn("assistant answer", "");
  const run = new Run(answer);
  state.last = { ...req, run };
  setPhase("streaming");
  setStatus("streaming…");
  try {
    await stream(req.path, req.body, run);
  } catch (e) {
    return failed(e, answer);
  }
  if (req.body.messages) state.history.push(req.body.messages.at(-1), { role: "assistant", content: run.content });
  showStats(run);
  const spec = run.usage && run.usage.speculation;
  if (spec) $("stat-mal").textContent = spec.drafting_rounds ? spec.mean_acceptance_length.toFixed(2) : "–";
  $("usage").textContent = JSON.stringify(run.usage, null, 2);
  setStatus("done: " + run.tokens + " tokens in " + run.seconds().toFixed(2) + " s");
  setPhase("done");
}

function failed(e, answerEl) {
  if (answerEl) answerEl.remove();
  if (e.name === "AbortError") {
    setStatus("stopped");
  } else if (e.status === 401) {
    $("key-row").hidden = false;
    setStatus("this server needs its API key", true);
  } else if (e.code === "no_chat_template" && $("api").value === "chat") {
    $("api").value = "completions";
    setStatus("this model has no chat template: switched to completions, send again", true);
  } else {
    setStatus(e.message, true);
  }
  setPhase("error");
}

async function compare() {
  // The last request again, with speculation off: same prompt, settings and seed.
  const last = state.last;
  const body = { ...last.body, speculation: { drafter: "none" } };
  const base = new Run(null);
  setPhase("comparing");
  setStatus("the same request without speculation…");
  try {
    await stream(last.path, body, base);
  } catch (e) {
    return failed(e, null);
  }
  const spec = last.run;
  $("cmp-spec-tps").textContent = spec.tokensPerSecond().toFixed(1);
  $("cmp-base-tps").textContent = base.tokensPerSecond().toFixed(1);
  $("cmp-spec-tokens").textContent = String(spec.tokens);
  $("cmp-base-tokens").textContent = String(base.tokens);
  $("cmp-spec-s").textContent = spec.seconds().toFixed(2);
  $("cmp-base-s").textContent = base.seconds().toFixed(2);
  const ratio = base.tokensPerSecond() > 0 ? spec.tokensPerSecond() / base.tokensPerSecond() : 0;
  const same = spec.content === base.content ? "the same answer" : "a different answer (sampled, or a target whose batched passes differ)";
  $("cmp-verdict").textContent = "speculation ran at " + ratio.toFixed(2) + "× the speed, with " + same;
  $("compare-box").hidden = false;
  setStatus("compared");
  setPhase("compared");
}

function clearChat() {
  state.history = [];
  state.last = null;
  $("conversation").replaceChildren();
  $("usage").textContent = "";
  resetViews();
  setPhase(state.model ? "ready" : "locked");
}

document.addEventListener("DOMContentLoaded", () => {
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("compare").addEventListener("click", compare);
  $("clear").addEventListener("click", clearChat);
  $("k-mode").addEventListener("change", showKInputs);
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey) && !$("send").disabled) send();
  });
  $("key-save").addEventListener("click", () => {
    sessionStorage.setItem(KEY_STORE, $("api-key").value.trim());
    setPhase("loading");
    loadModel();
  });
  setPhase("loading");
  loadModel();
});
