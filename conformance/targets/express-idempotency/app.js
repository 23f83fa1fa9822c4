// An Express 4 app behind express-idempotency 1.0.6, wired as its README shows:
// `app.post('*', idempotency())` with the default in-memory data adapter, response validator
// (2xx stored) and intent validator (url, method, query and body must match), and a route
// handler that returns early when `getSharedIdempotencyService().isHit(req)`.
//
// express-idempotency keys its records by the key alone: it has no notion of a principal, so
// the two bearer tokens are authenticated here but cannot scope the records.
//
// Routes: POST /v1/widgets and POST /v1/gadgets create (201, Location, JSON with an id) after
// `delay_ms` of the body (default 300); {"fail": "server"} answers 500 and {"invalid": true}
// 422. GET /counter answers {"executions": N}, the creates run so far. FIXTURE_TOKENS=tok=name,...
// PORT (default 0: any free port); the first line printed is `listening on http://...`.
'use strict';

const express = require('express');
const { idempotency, getSharedIdempotencyService } = require('express-idempotency');

const tokens = new Map(
  (process.env.FIXTURE_TOKENS || '')
    .split(',')
    .map((pair) => pair.split('='))
    .filter((pair) => pair.length === 2),
);
if (tokens.size === 0) {
  console.error('express-idempotency fixture: set FIXTURE_TOKENS=token=principal,...');
  process.exit(2);
}

let executions = 0;
const app = express();
app.use(express.json());
app.use((req, res, next) => {
  const auth = req.get('authorization') || '';
  const who = auth.startsWith('Bearer ') ? tokens.get(auth.slice(7)) : undefined;
  if (!who) {
    res.status(401).json({ error: 'unauthorized' });
    return;
  }
  req.principal = who;
  next();
});
app.post('*', idempotency());

function create(kind) {
  return (req, res, next) => {
    if (getSharedIdempotencyService().isHit(req)) {
      return;
    }
    const body = req.body || {};
    if (body.fail === 'server') {
      // The README's way to say the request failed: nothing is kept for the key.
      getSharedIdempotencyService().reportError(req);
      res.status(500).json({ error: 'the backend failed' });
      return;
    }
    if (body.invalid === true) {
      res.status(422).json({ error: 'invalid fields' });
      return;
    }
    const delay = Math.min(Number.isInteger(body.delay_ms) ? body.delay_ms : 300, 10000);
    setTimeout(() => {
      executions += 1;
      const id = `${kind}-${executions}`;
      res
        .status(201)
        .location(`/v1/${kind}s/${id}`)
        .json({ id, kind, owner: req.principal, name: body.name ?? null });
    }, delay);
  };
}

app.post('/v1/widgets', create('widget'));
app.post('/v1/gadgets', create('gadget'));
app.get('/counter', (req, res) => res.json({ executions }));

// The middleware reports an in-flight key (409) and a misused key (417) with next(error),
// having set the status: answer those as JSON.
app.use((err, req, res, next) => {
  const status = err.status || (res.statusCode >= 400 ? res.statusCode : 500);
  res.status(status).json({ error: err.message });
});

const server = app.listen(Number(process.env.PORT || 0), '127.0.0.1', () => {
  console.log(`listening on http://127.0.0.1:${server.address().port}`);
});
