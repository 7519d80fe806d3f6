"""The review queue and its page: ``GET /review`` and ``GET /v1/actmap/review/queue``.

Which answers enter the queue is decided as they are written to the audit store
(`actmap.serve.audit.AuditTrail.review_queue`): every answer decided ``review``, plus a
uniform random sample of every decision band (``serve --review-sample RATE``), each with
its reason, its probability of being queued and whether it is in the random sample (so
calibration can be checked without the review band's bias, `actmap.store.served`).

``GET /v1/actmap/review/queue?limit=N`` lists queued answers that have no label yet,
oldest first: question and answer (when the server keeps text, ``--audit-text``),
p(correct), decision, reason. ``GET /review`` is a plain HTML page (no build step, no
data in it: it is served without the key) whose script asks for the API key once, keeps
it in the page's memory only, and sends each verdict (correct / incorrect, with the right
answer when given) through ``POST /v1/actmap/feedback`` with source "review". Keys:
c = correct, i = incorrect, s = skip (the answer stays queued for later).
"""

from __future__ import annotations

import asyncio

import pandas as pd
from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse

from actmap.serve.audit import AUDIT_TABLE
from actmap.serve.feedback import audit_trail
from actmap.serve.protocol import OpenAIBaseModel
from actmap.store.served import latest_labels, review_rows

REVIEW_PAGE = "/review"
MAX_QUEUE_ITEMS = 100


class QueueItem(OpenAIBaseModel):
    map_id: str
    question: str  # "" when the server keeps no text (serve without --audit-text)
    answer: str
    p_correct: float
    decision: str
    reason: str  # "review" (decided review) | "sample" (the uniform random sample)
    rate: float  # the probability the answer had of entering the queue
    in_sample: bool
    served_at: str


class QueueResponse(OpenAIBaseModel):
    object: str = "actmap.review_queue"
    pending: int  # queued answers without a label
    text_kept: bool  # whether the audit store keeps question and answer text
    items: list[QueueItem]


def pending_items(trail, limit: int) -> QueueResponse:
    """The oldest ``limit`` queued answers without a label (committed rows only)."""
    store = trail.store
    queue = review_rows(store)
    queue = queue[~queue.index.isin(latest_labels(store).index)].sort_values(
        "queued_at", kind="stable"
    )
    wanted = list(queue.index[:limit])
    items = []
    if wanted:
        maps = store.read_latest("maps", ["prompt", "answer"], ids=wanted).to_pandas()
        maps = maps.set_index("id")
        side = store.read_latest(AUDIT_TABLE, ["served_at"], ids=wanted).to_pandas()
        served = side.set_index("id")["served_at"]
        for key in wanted:
            if key not in maps.index:  # dropped by retention
                continue
            row = queue.loc[key]
            when = served.get(key, row["queued_at"])
            items.append(
                QueueItem(
                    map_id=key, question=maps.at[key, "prompt"] or "",
                    answer=maps.at[key, "answer"] or "", p_correct=float(row["p_correct"]),
                    decision=row["decision"], reason=row["reason"], rate=float(row["rate"]),
                    in_sample=bool(row["in_sample"]), served_at=pd.Timestamp(when).isoformat(),
                )
            )  # fmt: skip
    return QueueResponse(pending=len(queue), text_kept=trail.keep_text, items=items)


def install_review_routes(app: FastAPI) -> None:
    @app.get("/v1/actmap/review/queue")
    async def review_queue(
        request: Request, limit: int = Query(20, ge=1, le=MAX_QUEUE_ITEMS)
    ) -> QueueResponse:
        trail = audit_trail(request.app.state.actmap)
        return await asyncio.to_thread(pending_items, trail, limit)

    @app.get(REVIEW_PAGE, response_class=HTMLResponse)
    async def review_page() -> HTMLResponse:
        return HTMLResponse(PAGE, headers={"Cache-Control": "no-store"})


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>actmap review</title>
<style>
  body { font: 16px/1.45 system-ui, sans-serif; margin: 0; background: #f4f5f7; color: #1c1e21; }
  header { background: #1f2937; color: #fff; padding: 10px 24px; display: flex; gap: 16px;
           align-items: center; }
  header h1 { font-size: 18px; margin: 0; flex: 1; }
  main { max-width: 860px; margin: 24px auto; padding: 0 16px; }
  .card { background: #fff; border-radius: 8px; padding: 20px 24px; margin-bottom: 16px;
          box-shadow: 0 1px 3px rgba(0,0,0,.12); }
  .label { font-size: 12px; text-transform: uppercase; color: #6b7280; letter-spacing: .04em; }
  .text { white-space: pre-wrap; margin: 4px 0 16px; }
  .meta { display: flex; gap: 24px; margin-bottom: 8px; }
  .meta b { font-size: 22px; }
  .review { color: #b45309; } .accept { color: #047857; } .route, .abstain { color: #b91c1c; }
  button { font-size: 16px; padding: 10px 18px; margin-right: 8px; border-radius: 6px;
           border: 1px solid #9ca3af; background: #fff; cursor: pointer; }
  button.ok { border-color: #047857; color: #047857; }
  button.bad { border-color: #b91c1c; color: #b91c1c; }
  kbd { border: 1px solid #9ca3af; border-radius: 3px; padding: 0 4px; font-size: 13px; }
  input[type=text], input[type=password], textarea { font: inherit; padding: 6px 8px;
           border: 1px solid #9ca3af; border-radius: 4px; }
  textarea { width: 100%; box-sizing: border-box; height: 3.2em; }
  #status { color: #e5e7eb; }
  .hidden { display: none; }
</style>
</head>
<body>
<header><h1>actmap review</h1><span id="status">not connected</span></header>
<main>
  <div class="card" id="login">
    <div class="label">API key (kept in this page's memory only; empty if the server has none)</div>
    <p><input type="password" id="key" size="40" autocomplete="off">
    <button id="connect">Connect</button></p>
  </div>
  <div class="card hidden" id="item">
    <div class="meta">
      <div><div class="label">p(correct)</div><b id="p"></b></div>
      <div><div class="label">decision</div><b id="decision"></b></div>
      <div><div class="label">queued because</div><b id="reason"></b></div>
      <div><div class="label">pending</div><b id="pending"></b></div>
    </div>
    <div class="label">question</div><div class="text" id="question"></div>
    <div class="label">answer</div><div class="text" id="answer"></div>
    <div class="label">the right answer (optional)</div>
    <textarea id="correct_answer"></textarea>
    <p>
      <button class="ok" id="mark-correct">Correct <kbd>c</kbd></button>
      <button class="bad" id="mark-incorrect">Incorrect <kbd>i</kbd></button>
      <button id="skip">Skip <kbd>s</kbd></button>
      <span class="label">map</span> <code id="map_id"></code>
    </p>
  </div>
  <div class="card hidden" id="empty">Nothing left to review.</div>
</main>
<script>
"use strict";
let key = "";          // the API key: this page's memory only, never stored
let items = [];        // fetched queue items not yet shown
let skipped = new Set();
let current = null;
let busy = false;
const $ = (id) => document.getElementById(id);

function headers() {
  const h = {"Content-Type": "application/json"};
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function call(path, options) {
  const response = await fetch(path, Object.assign({headers: headers()}, options || {}));
  const body = await response.json();
  if (!response.ok) throw new Error((body.error && body.error.message) || response.statusText);
  return body;
}

async function load() {
  const body = await call("/v1/actmap/review/queue?limit=100");
  items = body.items.filter((x) => !skipped.has(x.map_id));
  $("pending").textContent = body.pending;
  if (!body.text_kept) $("status").textContent = "text not kept (serve with --audit-text)";
  show();
}

function show() {
  current = items.shift() || null;
  $("item").classList.toggle("hidden", !current);
  $("empty").classList.toggle("hidden", !!current);
  if (!current) return;
  $("p").textContent = current.p_correct.toFixed(3);
  $("decision").textContent = current.decision;
  $("decision").className = current.decision;
  $("reason").textContent = current.reason + (current.in_sample ? " (random sample)" : "");
  $("question").textContent = current.question || "(not kept)";
  $("answer").textContent = current.answer || "(not kept)";
  $("map_id").textContent = current.map_id;
  $("correct_answer").value = "";
}

async function verdict(label) {
  if (!current || busy) return;
  busy = true;
  const item = current;
  const body = {map_id: item.map_id, label: label, source: "review"};
  const given = $("correct_answer").value.trim();
  if (given) body.correct_answer = given;
  try {
    await call("/v1/actmap/feedback", {method: "POST", body: JSON.stringify(body)});
    $("status").textContent = "saved " + (label ? "correct" : "incorrect") + ": " + item.map_id;
    $("pending").textContent = Math.max(0, Number($("pending").textContent) - 1);
    if (items.length) show(); else await load();
  } catch (error) {
    $("status").textContent = "not saved: " + error.message;
  } finally {
    busy = false;
  }
}

function skip() {
  if (!current) return;
  skipped.add(current.map_id);
  $("status").textContent = "skipped " + current.map_id;
  if (items.length) show(); else load();
}

$("connect").onclick = async () => {
  key = $("key").value;
  $("key").value = "";
  try {
    await load();
    $("login").classList.add("hidden");
    $("status").textContent = "connected";
  } catch (error) {
    $("status").textContent = "cannot read the queue: " + error.message;
  }
};
$("key").addEventListener("keydown", (e) => { if (e.key === "Enter") $("connect").click(); });
$("mark-correct").onclick = () => verdict(1);
$("mark-incorrect").onclick = () => verdict(0);
$("skip").onclick = skip;
document.addEventListener("keydown", (e) => {
  if (e.target.tagName === "TEXTAREA" || e.target.tagName === "INPUT") return;
  if (e.key === "c") verdict(1);
  else if (e.key === "i") verdict(0);
  else if (e.key === "s") skip();
});
</script>
</body>
</html>
"""
