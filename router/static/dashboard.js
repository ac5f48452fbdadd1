// chunkserve dashboard: polls /dashboard/api/state and draws it with plain SVG (no libraries, works offline).
"use strict";
(function () {
  const NS = "http://www.w3.org/2000/svg";
  const KEY = "chunkserve.dashboard.key";
  const $ = (id) => document.getElementById(id);
  let timer = null;
  const history = new Map(); // t -> point, merged over the ingress replicas answering

  function el(tag, attrs, text) {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function h(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function color(scope) {
    let x = 0;
    for (const c of scope) x = (x * 31 + c.charCodeAt(0)) >>> 0;
    const hue = x % 360;
    return scope.startsWith("shared:") ? `hsl(${hue},65%,62%)` : `hsl(${hue},45%,78%)`;
  }
  const fmt = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString());
  const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");

  // ---- forest (icicle): one band per scope, runs nested by depth, width ∝ subtree tokens ----
  function drawForest(worker) {
    const box = h("div", { class: "worker", "data-worker": worker.worker_id });
    const f = worker.forest;
    box.appendChild(h("h3", {}, `${worker.worker_id} — ${f ? fmt(f.num_nodes) + " chunks cached" : "no summary yet"}`));
    if (!f || !f.scopes.length) return box;
    const W = 1000, RH = 22;
    const rows = [];
    let maxDepth = 0;
    function place(run, x, w, level, scope) {
      rows.push({ run, x, w, level, scope });
      maxDepth = Math.max(maxDepth, level);
      let cx = x;
      const total = Math.max(1, run.subtree_tokens - run.tokens);
      for (const ch of run.children) {
        const cw = (w * ch.subtree_tokens) / Math.max(total, 1);
        place(ch, cx, cw, level + 1, scope);
        cx += cw;
      }
    }
    const total = f.scopes.reduce((a, s) => a + s.tokens, 0) || 1;
    let x = 0;
    const heads = [];
    for (const s of f.scopes) {
      const w = (W * s.tokens) / total;
      heads.push({ s, x, w });
      let cx = x;
      const shown = s.runs.reduce((a, r) => a + r.subtree_tokens, 0) + (s.more ? s.more.tokens : 0) || 1;
      for (const r of s.runs) {
        const rw = (w * r.subtree_tokens) / shown;
        place(r, cx, rw, 1, s.scope);
        cx += rw;
      }
      x += w;
    }
    const svg = el("svg", { class: "icicle", viewBox: `0 0 ${W} ${(maxDepth + 1) * RH}`, preserveAspectRatio: "none" });
    svg.style.height = `${(maxDepth + 1) * RH}px`;
    for (const { s, x: hx, w } of heads) {
      const g = el("g", { class: "scope", "data-scope": s.scope, "data-tokens": s.tokens });
      g.appendChild(el("rect", { x: hx, y: 0, width: Math.max(w, 1), height: RH - 2, fill: color(s.scope) }));
      g.appendChild(el("title", {}, `${s.scope}: ${fmt(s.tokens)} tokens` + (s.more ? `, ${s.more.subtrees} smaller subtrees not shown` : "")));
      if (w > 60) g.appendChild(el("text", { x: hx + 4, y: RH - 8 }, `${s.scope} · ${fmt(s.tokens)} tok`));
      svg.appendChild(g);
    }
    for (const { run, x: rx, w, level, scope } of rows) {
      const tenants = run.tenants.join(",");
      const g = el("g", { class: "run", "data-scope": scope, "data-tenants": tenants, "data-tokens": run.tokens,
                          "data-ref": run.ref, "data-hits": run.hits, "data-pinned": run.pinned });
      g.appendChild(el("rect", { x: rx, y: level * RH, width: Math.max(w, 1), height: RH - 2,
                                 fill: color(scope), class: run.pinned ? "pinned" : "", opacity: run.ref > 0 ? 1 : 0.6 }));
      const last = run.last_use ? new Date(run.last_use * 1000).toLocaleTimeString() : "–";
      g.appendChild(el("title", {}, `${scope}\n${fmt(run.tokens)} tokens in ${run.chunks} chunks (depth ${run.depth})\n` +
        `refs ${run.ref} · hits ${run.hits} · pinned ${run.pinned}\ntenants: ${tenants || "–"}\nlast use ${last}`));
      if (w > 80) g.appendChild(el("text", { x: rx + 4, y: level * RH + RH - 8 },
        `${fmt(run.tokens)} tok · ${run.ref} refs · ${run.hits} hits · ${tenants}`));
      svg.appendChild(g);
    }
    box.appendChild(svg);
    return box;
  }

  // ---- hit rate over time ----
  function drawHitRate(hr) {
    const svg = $("hitrate");
    svg.replaceChildren();
    const W = 600, H = 200, P = 24;
    for (const y of [0, 0.5, 1]) {
      const yy = H - P - y * (H - 2 * P);
      svg.appendChild(el("line", { x1: P, x2: W - 4, y1: yy, y2: yy, class: "grid" }));
      svg.appendChild(el("text", { x: 2, y: yy + 3, class: "axis" }, (y * 100).toFixed(0) + "%"));
    }
    for (const p of hr.points) if (p.cumulative !== null) history.set(p.t, p);
    const pts = [...history.values()].sort((a, b) => a.t - b.t).slice(-600);
    if (!pts.length) { $("hitrate-note").textContent = "no traffic yet"; return; }
    const t0 = pts[0].t, t1 = Math.max(pts[pts.length - 1].t, t0 + 1);
    const X = (t) => P + ((t - t0) / (t1 - t0)) * (W - P - 8);
    const Y = (v) => H - P - v * (H - 2 * P);
    svg.appendChild(el("polyline", { class: "cum", points: pts.map((p) => `${X(p.t)},${Y(p.cumulative)}`).join(" ") }));
    for (const p of pts) {
      const c = el("circle", { class: "pt", cx: X(p.t), cy: Y(p.cumulative), r: 3 });
      c.appendChild(el("title", {}, `${new Date(p.t * 1000).toLocaleTimeString()}: ${pct(p.cumulative)}`));
      svg.appendChild(c);
      if (p.interval !== null) svg.appendChild(el("circle", { class: "ipt", cx: X(p.t), cy: Y(p.interval), r: 2 }));
    }
    $("hitrate-note").textContent = `cached / prompt tokens, cumulative (blue) and per interval (orange); now ${pct(hr.cumulative)} over ${pts.length} samples`;
  }

  function drawKV(workers) {
    const box = $("kv");
    box.replaceChildren();
    for (const w of workers) {
      const tot = w.kv_chunks_total || 1;
      box.appendChild(h("div", { class: "muted" }, `${w.worker_id}: ${fmt(w.kv_chunks_used)} used + ${fmt(w.kv_chunks_cached)} cached of ${fmt(w.kv_chunks_total)} chunks (${pct(w.kv_cache_usage_perc)} in use), ${fmt(w.num_requests_running)} running, ${fmt(w.num_requests_waiting)} waiting`));
      const bar = h("div", { class: "bar", "data-worker": w.worker_id });
      const used = h("div", { class: "used" }); used.style.width = `${(100 * (w.kv_chunks_used || 0)) / tot}%`;
      const cached = h("div", { class: "cached" });
      cached.style.left = used.style.width; cached.style.width = `${(100 * (w.kv_chunks_cached || 0)) / tot}%`;
      bar.append(used, cached);
      box.appendChild(bar);
    }
  }

  function fillTable(id, rows) {
    const body = $(id).querySelector("tbody");
    body.replaceChildren();
    for (const r of rows) {
      const tr = h("tr");
      r.forEach((v) => tr.appendChild(h("td", {}, String(v))));
      body.appendChild(tr);
    }
  }

  function render(s) {
    $("model").textContent = s.model;
    const forests = $("forests");
    forests.replaceChildren(...s.workers.map(drawForest));
    drawHitRate(s.hit_rate);
    drawKV(s.workers);
    fillTable("tenants", s.tenants.map((t) => [t.tenant, fmt(t.requests), fmt(t.cached), fmt(t.prefilled), fmt(t.decoded)]));
    fillTable("routing", Object.entries(s.routing).map(([r, a]) => [r, fmt(a.requests), pct(a.accuracy), `${fmt(a.predicted_sum)} / ${fmt(a.reused_sum)}`]));
    const st = $("status");
    st.className = s.cluster_stats_up ? "muted" : "error";
    st.textContent = (s.cluster_stats_up ? "updated " : "workers' stats unavailable, ") + new Date(s.ts * 1000).toLocaleTimeString();
  }

  let seq = 0; // answers to a superseded refresh (e.g. the keyless one before a key was entered) are dropped

  async function refresh() {
    const my = ++seq;
    const key = sessionStorage.getItem(KEY);
    const headers = key ? { Authorization: "Bearer " + key } : {};
    let delay = 3000;
    try {
      const r = await fetch("/dashboard/api/state", { headers, cache: "no-store" });
      const body = await r.json();
      if (my !== seq) return;
      if (!r.ok) {
        const st = $("status");
        st.className = "error";
        st.textContent = `refused (${r.status}): ${body.error ? body.error.message : r.statusText}`;
        document.body.dataset.state = "refused";
      } else {
        render(body);
        document.body.dataset.state = "ok";
        delay = 1000 * (body.refresh_s || 3);
      }
    } catch (e) {
      if (my !== seq) return;
      $("status").className = "error";
      $("status").textContent = "unreachable: " + e;
    }
    timer = setTimeout(refresh, delay);
  }

  $("auth").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, $("key").value);
    document.body.dataset.state = "pending";
    if (timer) clearTimeout(timer);
    refresh();
  });
  refresh();
})();
