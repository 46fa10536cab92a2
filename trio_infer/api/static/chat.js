// The chat page of trio-infer: plain JavaScript, no build step, nothing fetched from elsewhere.
//
// It is a client of the server's own API, like any other: GET /v1/models for the model id,
// POST /v1/chat/completions with stream: true (server-sent events read from fetch's body),
// GET /v1/status once a second for the status strip. With an API key configured on the server the
// page asks for it and sends it as "Authorization: Bearer <key>" (kept in sessionStorage).
//
// Everything the server or the model says is shown as text (textContent / text nodes), never
// parsed as HTML.
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORAGE = 'trio-infer-api-key';
  const POLL_MS = 1000;
  const SPARK_POINTS = 40; // seconds of tokens per second in the sparkline

  const state = {
    model: null,
    key: sessionStorage.getItem(KEY_STORAGE) || '',
    history: [], // {role, content, excluded}: what the next request sends
    conversation: 0, // bumped by "New conversation": a reply still ending then is dropped
    controller: null, // AbortController of the running generation
    modelLoaded: null, // resolves once the model id is known
    lastStatus: null,
    rates: [],
  };

  class ServerError extends Error {
    constructor(message, status, code) {
      super(message);
      this.name = 'ServerError';
      this.status = status;
      this.code = code;
    }
  }

  function headers(json) {
    const h = {};
    if (json) h['Content-Type'] = 'application/json';
    if (state.key) h.Authorization = 'Bearer ' + state.key;
    return h;
  }

  // An error answer -> ServerError carrying the OpenAI envelope's error.message.
  async function errorFrom(res) {
    let message = `The server answered ${res.status} ${res.statusText}`.trim();
    let code = null;
    try {
      const body = await res.json();
      if (body && body.error && typeof body.error.message === 'string') {
        message = body.error.message;
        code = body.error.code || null;
      }
    } catch (_) { /* not JSON: keep the status line */ }
    return new ServerError(message, res.status, code);
  }

  async function api(path, init = {}) {
    const res = await fetch(path, { ...init, headers: headers(init.body !== undefined), cache: 'no-store' });
    if (!res.ok) {
      const err = await errorFrom(res);
      if (res.status === 401) askForKey(err.message);
      throw err;
    }
    return res;
  }

  // -- API key ------------------------------------------------------------------------------------

  let keyWaiters = [];

  function askForKey(reason) {
    const dialog = $('key-dialog');
    $('key-reason').textContent = reason;
    if (!dialog.open) {
      $('key').value = '';
      dialog.showModal();
    }
  }

  function keyGiven() {
    return new Promise((resolve) => keyWaiters.push(resolve));
  }

  // Nothing works without the key: Escape does not dismiss the dialog.
  $('key-dialog').addEventListener('cancel', (event) => event.preventDefault());

  $('key-form').addEventListener('submit', (event) => {
    event.preventDefault();
    state.key = $('key').value.trim();
    sessionStorage.setItem(KEY_STORAGE, state.key);
    $('key-dialog').close();
    const waiters = keyWaiters;
    keyWaiters = [];
    waiters.forEach((resolve) => resolve());
  });

  // -- the model ----------------------------------------------------------------------------------

  async function loadModel() {
    for (;;) {
      try {
        const res = await api('/v1/models');
        const body = await res.json();
        state.model = body.data[0].id;
        $('model').textContent = state.model;
        $('model').title = `served model (context ${body.data[0].max_model_len} tokens)`;
        $('empty').textContent = `Send a message to ${state.model}.`;
        return;
      } catch (err) {
        $('model').textContent = err.message;
        if (err.status === 401) await keyGiven();
        else await sleep(1000);
      }
    }
  }

  // -- the conversation ---------------------------------------------------------------------------

  const messages = $('messages');

  function nearBottom() {
    return messages.scrollHeight - messages.scrollTop - messages.clientHeight < 80;
  }

  function scrollDown(wasNearBottom) {
    if (wasNearBottom) messages.scrollTop = messages.scrollHeight;
  }

  // A message bubble; returns its parts. Text goes in as a text node only.
  function addMessage(kind, text) {
    const stick = nearBottom();
    $('empty').hidden = true;
    const li = document.createElement('li');
    li.className = `msg ${kind}`;
    const role = document.createElement('div');
    role.className = 'role';
    role.textContent = { user: 'You', assistant: state.model || 'assistant', error: 'Error', notice: 'Note' }[kind];
    const body = document.createElement('div');
    body.className = 'text';
    const node = document.createTextNode(text);
    body.appendChild(node);
    const meta = document.createElement('div');
    meta.className = 'meta';
    li.append(role, body, meta);
    messages.appendChild(li);
    scrollDown(stick);
    return { li, node, meta };
  }

  function showError(message) {
    addMessage('error', message);
  }

  // The text of each server-sent event's data field(s), as the body arrives.
  async function* sseData(res) {
    const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '';
    let data = [];
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let nl;
        while ((nl = buffer.indexOf('\n')) >= 0) {
          let line = buffer.slice(0, nl);
          buffer = buffer.slice(nl + 1);
          if (line.endsWith('\r')) line = line.slice(0, -1);
          if (line === '') {
            if (data.length) yield data.join('\n');
            data = [];
          } else if (line.startsWith('data:')) {
            data.push(line.slice(line.startsWith('data: ') ? 6 : 5));
          } // comments and other fields: ignored
        }
      }
      if (data.length) yield data.join('\n');
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  function numberField(id, parse) {
    const raw = $(id).value.trim();
    if (raw === '') return undefined;
    const value = parse(raw);
    return Number.isFinite(value) ? value : raw; // the server says what is wrong with it
  }

  function extraFields() {
    const raw = $('extra').value.trim();
    if (!raw) return {};
    let value;
    try {
      value = JSON.parse(raw);
    } catch (err) {
      throw new Error(`Extra request fields are not valid JSON: ${err.message}`);
    }
    if (value === null || typeof value !== 'object' || Array.isArray(value)) {
      throw new Error('Extra request fields must be a JSON object, e.g. {"top_p": 0.9}.');
    }
    return value;
  }

  function requestBody() {
    const messagesSent = [];
    const system = $('system').value;
    if (system.trim()) messagesSent.push({ role: 'system', content: system });
    for (const turn of state.history) {
      if (!turn.excluded) messagesSent.push({ role: turn.role, content: turn.content });
    }
    const body = { model: state.model };
    const temperature = numberField('temperature', parseFloat);
    const maxTokens = numberField('max-tokens', Number);
    if (temperature !== undefined) body.temperature = temperature;
    if (maxTokens !== undefined) body.max_tokens = maxTokens;
    return {
      ...body,
      ...extraFields(),
      messages: messagesSent,
      stream: true,
      stream_options: { include_usage: true },
    };
  }

  function setBusy(busy) {
    $('send').hidden = busy;
    $('stop').hidden = !busy;
    document.body.classList.toggle('busy', busy);
  }

  async function send(text) {
    if (state.controller) return;
    const controller = (state.controller = new AbortController()); // one request at a time
    setBusy(true);
    const conversation = state.conversation;
    const userTurn = { role: 'user', content: text, excluded: false };
    state.history.push(userTurn);
    const user = addMessage('user', text);
    let body;
    try {
      await state.modelLoaded;
      body = requestBody();
    } catch (err) {
      state.controller = null;
      setBusy(false);
      userTurn.excluded = true;
      user.li.classList.add('excluded');
      showError(err.message);
      return;
    }

    const reply = addMessage('assistant', '');
    reply.li.classList.add('streaming');
    const started = performance.now();
    let content = '';
    let finish = null;
    let usage = null;
    let failure = null;
    let stopped = false;
    try {
      const res = await api('/v1/chat/completions', {
        method: 'POST',
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      for await (const data of sseData(res)) {
        if (data === '[DONE]') break;
        const event = JSON.parse(data);
        if (event.error) {
          failure = new ServerError(event.error.message || 'The stream ended with an error.', 200, event.error.code);
          break;
        }
        if (event.usage) usage = event.usage;
        const choice = event.choices && event.choices[0];
        if (!choice) continue;
        const delta = choice.delta && choice.delta.content;
        if (delta) {
          const stick = nearBottom();
          content += delta;
          reply.node.appendData(delta);
          scrollDown(stick);
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    } catch (err) {
      if (err.name === 'AbortError') stopped = true;
      else failure = err;
    } finally {
      state.controller = null;
      setBusy(false);
      reply.li.classList.remove('streaming');
    }
    if (conversation !== state.conversation) return; // cleared meanwhile

    const seconds = ((performance.now() - started) / 1000).toFixed(1);
    const parts = [];
    if (usage) {
      reply.li.dataset.promptTokens = usage.prompt_tokens;
      reply.li.dataset.completionTokens = usage.completion_tokens;
      parts.push(`${usage.completion_tokens} tokens`);
    }
    parts.push(`${seconds} s`);
    if (finish) reply.li.dataset.finish = finish;
    if (finish === 'length') parts.push('cut at max tokens');
    if (stopped) parts.push('stopped');

    if (failure) {
      // The turn failed: it is not sent again; whatever partial text came stays visible.
      userTurn.excluded = true;
      user.li.classList.add('excluded');
      if (content) {
        reply.li.classList.add('excluded');
        reply.meta.textContent = parts.join(' · ');
      } else {
        reply.li.remove();
      }
      showError(failure.message);
    } else if (stopped && !content) {
      userTurn.excluded = true;
      user.li.classList.add('excluded');
      reply.li.remove();
      addMessage('notice', 'Stopped before the first token.');
    } else {
      state.history.push({ role: 'assistant', content, excluded: false });
      reply.meta.textContent = parts.join(' · ');
    }
    if (stopped) reply.li.dataset.finish = 'stopped';
    reply.li.classList.add('done');
  }

  $('composer').addEventListener('submit', (event) => {
    event.preventDefault();
    const text = $('input').value;
    if (!text.trim() || state.controller) return;
    $('input').value = '';
    send(text);
  });

  $('input').addEventListener('keydown', (event) => {
    if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $('composer').requestSubmit();
    }
  });

  $('stop').addEventListener('click', () => {
    if (state.controller) state.controller.abort();
  });

  $('new-chat').addEventListener('click', () => {
    if (state.controller) state.controller.abort();
    state.conversation += 1;
    state.history = [];
    messages.replaceChildren();
    $('empty').hidden = false;
    $('input').focus();
  });

  // -- the status strip ---------------------------------------------------------------------------

  function setText(id, value) {
    $(id).textContent = String(value);
  }

  function formatRate(rate) {
    return rate < 10 ? rate.toFixed(1) : String(Math.round(rate));
  }

  // The last SPARK_POINTS rates, drawn from the left edge (the line grows, then scrolls).
  function drawSpark() {
    const values = state.rates;
    const max = Math.max(1, ...values);
    const step = 120 / (SPARK_POINTS - 1);
    const points = values.map((v, i) => `${(i * step).toFixed(1)},${(23 - (v / max) * 21).toFixed(1)}`);
    $('spark-line').setAttribute('points', points.join(' '));
    const right = ((values.length - 1) * step).toFixed(1);
    $('spark-area').setAttribute('points', points.length > 1 ? `0,24 ${points.join(' ')} ${right},24` : '');
  }

  function showHealth(kind, text) {
    $('st-health').dataset.state = kind;
    setText('st-health-text', text);
  }

  function healthText(s) {
    if (s.healthy) return 'healthy';
    const l = s.loading;  // while the model loads: its phase, and tensors read of total
    const progress = l ? ` (${l.phase}${l.total ? ` ${l.done}/${l.total}` : ''})` : '';
    return `unhealthy: ${s.problem}${progress}`;
  }

  function showStatus(s) {
    showHealth(s.healthy ? 'ok' : 'down', healthText(s));
    setText('st-running', s.requests.running);
    setText('st-waiting', s.requests.waiting);
    setText('st-kv-used', s.kv_pages.used);
    setText('st-kv-cached', s.kv_pages.cached);
    setText('st-kv-total', s.kv_pages.total);
    const last = state.lastStatus;
    if (last && s.time > last.time) {
      const rate = Math.max(0, (s.tokens.generated - last.tokens.generated) / (s.time - last.time));
      state.rates.push(rate);
      if (state.rates.length > SPARK_POINTS) state.rates.shift();
      setText('st-tps', formatRate(rate));
      drawSpark();
    }
    state.lastStatus = s;
  }

  async function pollStatus() {
    try {
      const res = await fetch('/v1/status', { headers: headers(false), cache: 'no-store' });
      if (res.status === 401) {
        showHealth('unknown', 'API key needed');
      } else if (!res.ok) {
        showHealth('down', (await errorFrom(res)).message);
      } else {
        showStatus(await res.json());
      }
    } catch (_) {
      showHealth('down', 'server unreachable');
      state.lastStatus = null;
    }
    setTimeout(pollStatus, POLL_MS);
  }

  function sleep(ms) {
    return new Promise((resolve) => setTimeout(resolve, ms));
  }

  // -- start --------------------------------------------------------------------------------------

  if (window.matchMedia('(min-width: 900px)').matches) $('settings').open = true;
  state.modelLoaded = loadModel();
  pollStatus();
  $('input').focus();
})();
