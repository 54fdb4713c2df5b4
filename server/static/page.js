// vengine's page: a playground streaming from the server's own OpenAI endpoints over SSE
// (fetch + ReadableStream) and a live panel polling /stats. Plain browser JavaScript, no
// build step, nothing loaded from outside. Every URL is relative to the page.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const POLL_MS = 1000;
  const RATE_WINDOW_S = 10;
  const KEY_STORAGE = "vengine.apiKey";

  // --- API key: kept for this tab only (sessionStorage), sent as a bearer header --------
  const keyInput = $("api-key");
  keyInput.value = sessionStorage.getItem(KEY_STORAGE) || "";
  keyInput.addEventListener("input", () => sessionStorage.setItem(KEY_STORAGE, keyInput.value.trim()));

  function requestHeaders() {
    const h = { "Content-Type": "application/json" };
    const key = keyInput.value.trim();
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function errorMessage(resp) {
    const text = await resp.text();
    try {
      const body = JSON.parse(text);
      if (body && body.error && body.error.message) return body.error.message;
    } catch (_) { /* not JSON: show the text */ }
    return text || resp.statusText;
  }

  // POST `body` to `path` and call onChunk(object) for each SSE `data:` event until
  // `[DONE]`. An error before the stream (non-2xx) or inside it ({"error": ...}) throws.
  async function streamSSE(path, body, signal, onChunk) {
    const resp = await fetch(path, {
      method: "POST", headers: requestHeaders(), body: JSON.stringify(body), signal,
    });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}: ${await errorMessage(resp)}`);
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) throw new Error("the stream ended without [DONE]");
      buf += value.replace(/\r\n/g, "\n");
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, end);
        buf = buf.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).trimStart()).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        const obj = JSON.parse(data);
        if (obj.error) throw new Error(obj.error.message || JSON.stringify(obj.error));
        onChunk(obj);
      }
    }
  }

  function samplingFields() {
    const body = {};
    const maxTokens = parseInt($("max-tokens").value, 10);
    const temperature = parseFloat($("temperature").value);
    if (Number.isFinite(maxTokens)) body.max_tokens = maxTokens;
    if (Number.isFinite(temperature)) body.temperature = temperature;
    return body;
  }

  // One box (completion or chat): one streaming request at a time, Stop aborts it, the
  // status line ends with the request's own figures (tokens, time to first token, tokens/s).
  function makeBox(go, stop, status) {
    const box = { go, stop, status, controller: null };
    stop.addEventListener("click", () => box.controller && box.controller.abort());
    box.run = async (path, body, onText) => {
      box.controller = new AbortController();
      go.disabled = true;
      stop.disabled = false;
      status.className = "status busy";
      status.textContent = "streaming…";
      const t0 = performance.now();
      let tFirst = null;
      let usage = null;
      let finish = null;
      let gotText = false;
      try {
        const req = Object.assign({}, body, samplingFields(), { stream: true, stream_options: { include_usage: true } });
        await streamSSE(path, req, box.controller.signal, (chunk) => {
          if (chunk.usage) usage = chunk.usage;
          for (const c of chunk.choices || []) {
            const text = c.text !== undefined ? c.text : (c.delta && c.delta.content) || "";
            if (text) {
              if (tFirst === null) tFirst = performance.now();
              gotText = true;
              onText(text);
            }
            if (c.finish_reason) finish = c.finish_reason;
          }
        });
        const secs = (performance.now() - t0) / 1000;
        const n = usage ? usage.completion_tokens : null;
        const parts = [];
        if (n !== null) parts.push(`${n} tokens in ${secs.toFixed(2)} s`);
        if (tFirst !== null) parts.push(`first token after ${Math.round(tFirst - t0)} ms`);
        if (n && tFirst !== null && secs > 0) parts.push(`${(n / secs).toFixed(1)} tokens/s`);
        if (finish) parts.push(`finish: ${finish}`);
        status.className = "status done";
        status.textContent = parts.join(" · ");
        return gotText;
      } catch (e) {
        const aborted = e.name === "AbortError";
        status.className = aborted ? "status" : "status error";
        status.textContent = aborted ? "stopped" : e.message;
        return gotText;
      } finally {
        box.controller = null;
        go.disabled = false;
        stop.disabled = true;
      }
    };
    return box;
  }

  // --- tabs ----------------------------------------------------------------------------
  const tabs = [["tab-completion", "completion-panel"], ["tab-chat", "chat-panel"]];
  for (const [tabId] of tabs) {
    $(tabId).addEventListener("click", () => {
      for (const [t, p] of tabs) {
        $(t).setAttribute("aria-selected", String(t === tabId));
        $(p).hidden = t !== tabId;
      }
    });
  }

  // --- completion ----------------------------------------------------------------------
  const completion = makeBox($("complete-btn"), $("complete-stop"), $("completion-status"));
  $("complete-btn").addEventListener("click", () => {
    const out = $("completion-output");
    const prompt = $("prompt").value;
    out.textContent = "";
    const echo = document.createElement("span");
    echo.className = "prompt-echo";
    echo.textContent = prompt;
    const gen = document.createElement("span");
    gen.id = "completion-generated";
    out.append(echo, gen);
    completion.run("v1/completions", { prompt }, (text) => { gen.textContent += text; });
  });

  // --- chat ----------------------------------------------------------------------------
  const chat = makeBox($("chat-send"), $("chat-stop"), $("chat-status"));
  const messages = [];

  function bubble(role, text) {
    const div = document.createElement("div");
    div.className = "msg " + role;
    div.textContent = text;
    $("chat-log").append(div);
    div.scrollIntoView({ block: "end" });
    return div;
  }

  async function sendChat() {
    const input = $("chat-input");
    const content = input.value.trim();
    if (!content || chat.controller) return;
    input.value = "";
    const userMsg = { role: "user", content };
    messages.push(userMsg);
    const userDiv = bubble("user", content);
    const reply = { role: "assistant", content: "" };
    const replyDiv = bubble("assistant", "");
    const gotText = await chat.run("v1/chat/completions", { messages: messages.slice() }, (text) => {
      reply.content += text;
      replyDiv.textContent = reply.content;
    });
    if (gotText) {
      messages.push(reply);
    } else {  // nothing came back (e.g. a wrong key): take the turn back so it can be resent
      messages.pop();
      userDiv.remove();
      replyDiv.remove();
      input.value = content;
    }
  }
  $("chat-send").addEventListener("click", sendChat);
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); sendChat(); }
  });
  $("chat-clear").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort();
    messages.length = 0;
    $("chat-log").textContent = "";
    $("chat-status").textContent = "";
  });

  // --- live panel ----------------------------------------------------------------------
  // /stats counters are cumulative; rates come from the snapshots of the last
  // RATE_WINDOW_S seconds (as Prometheus' rate()), on the server's own timestamps.
  const samples = [];

  function show(id, value, text) {
    const el = $(id);
    el.dataset.value = String(value);
    el.textContent = text === undefined ? String(value) : text;
  }

  function rate(key) {
    if (samples.length < 2) return 0;
    const a = samples[0];
    const b = samples[samples.length - 1];
    const dt = b.timestamp - a.timestamp;
    return dt > 0 ? Math.max(0, b[key] - a[key]) / dt : 0;
  }

  function render(s) {
    const last = samples[samples.length - 1];
    if (last && (s.generation_tokens < last.generation_tokens || s.prompt_tokens < last.prompt_tokens)) {
      samples.length = 0;  // counters went back: another server process answered
    }
    samples.push(s);
    while (samples.length > 2 && s.timestamp - samples[1].timestamp >= RATE_WINDOW_S) samples.shift();

    $("model-name").textContent = s.model_name || "";
    const state = $("stat-state");
    state.textContent = s.engine_alive ? "live" : "engine dead";
    state.className = "state " + (s.engine_alive ? "ok" : "bad");
    show("stat-running", s.num_requests_running);
    show("stat-waiting", s.num_requests_waiting);
    show("stat-kv", s.kv_cache_usage, (100 * s.kv_cache_usage).toFixed(1) + " %");
    $("stat-kv-meter").value = s.kv_cache_usage;
    show("stat-blocks", s.num_free_blocks, `${s.num_free_blocks} / ${s.num_gpu_blocks}`);
    const tps = rate("generation_tokens");
    show("stat-tps", tps, tps.toFixed(1));
    const ptps = rate("prompt_tokens");
    show("stat-prompt-tps", ptps, ptps.toFixed(1));
    const hit = s.prefix_cache_queries ? s.prefix_cache_hits / s.prefix_cache_queries : 0;
    show("stat-prefix", hit, s.prefix_cache_queries ? (100 * hit).toFixed(1) + " %" : "–");
    show("stat-finished", s.num_requests_finished);
    show("stat-preemptions", s.num_preemptions);
  }

  async function poll() {
    try {
      const resp = await fetch("stats", { cache: "no-store" });
      if (!resp.ok) throw new Error(`HTTP ${resp.status}: ${await errorMessage(resp)}`);
      render(await resp.json());
    } catch (e) {
      const state = $("stat-state");
      state.textContent = "unreachable: " + e.message;
      state.className = "state bad";
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }
  poll();
})();
