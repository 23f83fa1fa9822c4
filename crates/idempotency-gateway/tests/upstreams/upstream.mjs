// A small upstream service for the gateway's tests (Node, node:http only): the same routes
// and knobs as upstream.py, which documents them.
//
//   node upstream.mjs [--listen 127.0.0.1:0] [--dedupe]
import http from "node:http";

const args = process.argv.slice(2);
const listen = args.includes("--listen") ? args[args.indexOf("--listen") + 1] : "127.0.0.1:0";
const dedupe = args.includes("--dedupe");
const state = { executions: 0, by_key: {}, answers: new Map(), last: {} };

function sendJson(res, status, value, extra = {}) {
  const body = Buffer.from(JSON.stringify(value));
  res.writeHead(status, { "content-type": "application/json", "content-length": body.length, ...extra });
  res.end(body);
}

function execute(req, res, body) {
  const key = (req.headers["idempotency-key"] || "").replace(/^"|"$/g, "");
  state.last = { ...req.headers };
  if (req.headers["x-upstream-skip"] === "1") {
    return sendJson(res, Number(req.headers["x-upstream-status"] || 500), { error: "not done" });
  }
  let answer;
  let counted = false;
  if (dedupe && key && state.answers.has(key)) {
    answer = state.answers.get(key);
  } else {
    state.executions += 1;
    if (key) state.by_key[key] = (state.by_key[key] || 0) + 1;
    answer = { order: state.executions, path: req.url, method: req.method, body };
    if (key) state.answers.set(key, answer);
    counted = true;
  }
  const delay = Number(req.headers["x-upstream-delay-ms"] || 0);
  setTimeout(() => {
    if (counted && req.headers["x-upstream-reset"] === "1") {
      req.socket.resetAndDestroy();
      return;
    }
    const location = { location: `/orders/${answer.order}` };
    if (req.headers["x-upstream-size"] !== undefined) {
      const data = Buffer.alloc(Number(req.headers["x-upstream-size"]), "x");
      res.writeHead(201, { "content-type": "application/octet-stream", "content-length": data.length, ...location });
      res.end(data);
      return;
    }
    sendJson(res, Number(req.headers["x-upstream-status"] || 201), answer, location);
  }, delay);
}

const server = http.createServer((req, res) => {
  if (req.method === "GET" || req.method === "HEAD") {
    if (req.url === "/__count") {
      return sendJson(res, 200, { executions: state.executions, by_key: state.by_key, last: state.last });
    }
    const prefix = "/orders/by-key/";
    if (req.url.startsWith(prefix)) {
      const answer = state.answers.get(req.url.slice(prefix.length));
      return answer ? sendJson(res, 200, answer) : sendJson(res, 404, { error: "no such order" });
    }
    return sendJson(res, 200, { path: req.url, method: req.method });
  }
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", () => execute(req, res, Buffer.concat(chunks).toString("utf8")));
});
server.keepAliveTimeout = 60_000;
const [host, port] = [listen.slice(0, listen.lastIndexOf(":")), Number(listen.slice(listen.lastIndexOf(":") + 1))];
server.listen(port, host, () => {
  const a = server.address();
  console.log(`listening on http://${a.address}:${a.port}`);
});
