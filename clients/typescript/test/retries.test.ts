/** The retry rules, checked from what arrives at a scripted API: keys, counts and arrival times. */

import assert from "node:assert/strict";
import { test } from "node:test";

import {
  Client,
  GaveUp,
  KeyExpired,
  KeyReused,
  OperationReused,
  Refused,
  ServerError,
  Unauthorized,
  problemName,
  type ClientOptions,
  type RequestOptions,
} from "../src/index.js";
import { created, DROP, problem, scripted, type Arrival, type Reply } from "./scripted.js";
import { failure, journalIn } from "./support.js";

const OK = created({ id: "thing-1" }, { Location: "/v1/things/thing-1" });
const POST: RequestOptions = { method: "POST", path: "/v1/things", body: { n: 1 } };

function call(url: string, request: RequestOptions = POST, options: Partial<ClientOptions> = {}): Promise<Response> {
  return new Client({ baseUrl: url, maxElapsedMs: 60_000, ...options }).request(request);
}

function httpDate(ms: number): string {
  return new Date(ms).toUTCString();
}

test("Retry-After as seconds and as an HTTP-date is waited out", async () => {
  let target = 0;
  const tooMany = (arrival: Arrival): Reply => {
    // An HTTP-date two to three seconds ahead (the format has whole seconds).
    target = (Math.floor(arrival.wall / 1000) + 3) * 1000;
    return problem(429, "too-many-requests", { "Retry-After": httpDate(target) });
  };
  await scripted([problem(503, "store-unavailable", { "Retry-After": "1" }), tooMany, OK], async (api) => {
    assert.equal((await call(api.url)).status, 201);
    const [first, second, third] = api.arrivals;
    assert.ok(first && second && third, "three attempts");
    assert.ok(second.at - first.at >= 1000, "Retry-After: 1 was not waited out");
    assert.ok(third.wall >= target - 10, "Retry-After as an HTTP-date was not waited out");
    assert.ok(first.key !== undefined);
    assert.deepEqual(api.keys, [first.key, first.key, first.key], "every attempt of one operation carries its one key");
  });
});

test("409 request-in-progress is retried after its Retry-After", async () => {
  await scripted([problem(409, "request-in-progress", { "Retry-After": "1" }), OK], async (api) => {
    assert.equal((await call(api.url)).status, 201);
    const [first, second] = api.arrivals;
    assert.ok(first && second && api.arrivals.length === 2);
    assert.ok(second.at - first.at >= 1000);
    assert.equal(first.key, second.key);
  });
});

test("lost answers and 5xx are retried with the same key", async () => {
  await scripted([DROP, problem(502, "upstream-unavailable"), { status: 500 }, OK], async (api) => {
    const response = await call(api.url);
    assert.equal(response.status, 201);
    assert.deepEqual(await response.json(), { id: "thing-1" });
    assert.equal(api.arrivals.length, 4);
    assert.equal(new Set(api.keys).size, 1);
  });
});

for (const status of [409, 422, 400]) {
  test(`idempotency-key-reused (${String(status)}) is never retried`, async () => {
    await scripted([problem(status, "idempotency-key-reused"), OK], async (api) => {
      const error = await failure(call(api.url), KeyReused);
      assert.equal(api.arrivals.length, 1);
      assert.equal(error.status, status);
      assert.ok(error.problem !== undefined);
      assert.equal(problemName(error.problem), "idempotency-key-reused");
    });
  });
}

const refusals: [string, Reply][] = [
  ["400", { status: 400 }],
  ["404", { status: 404 }],
  ["409 conflict", problem(409, "node-in-use")],
  ["422", problem(422, "invalid-request")],
  ["413", { status: 413 }],
];
for (const [name, reply] of refusals) {
  test(`another 4xx (${name}) is refused without a retry`, async () => {
    await scripted([reply, OK], async (api) => {
      const error = await failure(call(api.url), Refused);
      assert.equal(api.arrivals.length, 1);
      assert.equal(error.status, reply.status);
    });
  });
}

for (const status of [401, 403]) {
  test(`${String(status)} is Unauthorized, not retried`, async () => {
    await scripted([problem(status, "unauthorized"), OK], async (api) => {
      const error = await failure(call(api.url), Unauthorized);
      assert.equal(api.arrivals.length, 1);
      assert.equal(error.status, status);
    });
  });
}

test("gives up within the budget", async () => {
  await scripted([problem(503, "store-unavailable", { "Retry-After": "0" })], async (api) => {
    const error = await failure(call(api.url, POST, { maxElapsedMs: 2000 }), GaveUp);
    assert.ok(error.last instanceof ServerError);
    assert.equal(error.last.status, 503);
    assert.ok(api.arrivals.length >= 2);
    assert.equal(error.attempts, api.arrivals.length);
    const first = api.arrivals[0];
    const last = api.arrivals.at(-1);
    assert.ok(first && last && last.at - first.at < 2000, "an attempt went out after the budget");
    assert.equal(new Set(api.keys).size, 1);
  });
});

test("a Retry-After beyond the budget gives up at once", async () => {
  await scripted([problem(503, "store-unavailable", { "Retry-After": "30" })], async (api) => {
    const started = performance.now();
    await failure(call(api.url, POST, { maxElapsedMs: 5000 }), GaveUp);
    assert.equal(api.arrivals.length, 1);
    assert.ok(performance.now() - started < 5000, "waited although no attempt fits in the budget");
  });
});

test("a transport error is the last error of a give-up", async () => {
  await scripted([DROP], async (api) => {
    const error = await failure(call(api.url, POST, { maxElapsedMs: 1000 }), GaveUp);
    // The last attempt's timeout is what is left of the budget, a few milliseconds at times: on a
    // busy machine that timeout fires before the dropped connection is seen. Both are what `fetch`
    // threw, never an answer.
    const networkFailure = error.last instanceof TypeError;
    const attemptTimeout = error.last instanceof DOMException && error.last.name === "TimeoutError";
    assert.ok(networkFailure || attemptTimeout, String(error.last));
    assert.ok(api.arrivals.length >= 1);
  });
});

test("Prefer: wait is sent when asked", async () => {
  await scripted([OK], async (api) => {
    await call(api.url, { ...POST, wait: 5 });
    await call(api.url);
    assert.equal(api.arrivals[0]?.headers["prefer"], "wait=5");
    assert.equal(api.arrivals[1]?.headers["prefer"], undefined);
  });
});

test("the body is JSON with sorted keys", async () => {
  await scripted([OK], async (api) => {
    await call(api.url, { ...POST, body: { b: 1, a: [1, "é"] } });
    const [arrival] = api.arrivals;
    assert.ok(arrival);
    assert.equal(arrival.body, '{"a":[1,"é"],"b":1}');
    assert.equal(arrival.headers["content-type"], "application/json");
  });
});

test("without an operation each call is a new key", async () => {
  await scripted([OK], async (api) => {
    await call(api.url);
    await call(api.url);
    const [first, second] = api.keys;
    assert.ok(first !== undefined && second !== undefined);
    assert.notEqual(first, second);
  });
});

test("reads carry no key and are retried", async () => {
  await scripted([{ status: 503 }, { status: 200, headers: { "Content-Type": "application/json" }, body: "{}" }], async (api) => {
    assert.equal((await call(api.url, { method: "GET", path: "/v1/things/thing-1" })).status, 200);
    assert.deepEqual(api.keys, [undefined, undefined]);
  });
});

test("an expired key is never sent again, in this run or a rerun", async () => {
  const journal = await journalIn();
  const expired = problem(503, "store-unavailable", { "Retry-After": "0", "Idempotency-Key-Expires": httpDate(Date.now() - 5000) });
  await scripted([expired, OK], async (api) => {
    const op = { ...POST, operation: "op-1" };
    await failure(call(api.url, op, { journal }), KeyExpired);
    assert.equal(api.arrivals.length, 1);
    // The rerun learns the expiry from the journal: nothing is sent.
    await failure(call(api.url, op, { journal }), KeyExpired);
    assert.equal(api.arrivals.length, 1);
  });
});

test("a key that expires before the next attempt is not sent", async () => {
  const soon = problem(503, "store-unavailable", { "Retry-After": "10", "Idempotency-Key-Expires": httpDate(Date.now() + 3000) });
  await scripted([soon, OK], async (api) => {
    await failure(call(api.url), KeyExpired);
    assert.equal(api.arrivals.length, 1);
  });
});

test("a journaled outcome is answered without sending", async () => {
  const journal = await journalIn();
  await scripted([OK], async (api) => {
    const op = { ...POST, operation: "op-1" };
    const first = await call(api.url, op, { journal });
    const again = await call(api.url, op, { journal });
    assert.equal(api.arrivals.length, 1);
    assert.equal(first.headers.get("idempotency-client-journal"), null);
    assert.ok(again.headers.get("idempotency-client-journal"));
    assert.equal(again.headers.get("idempotent-replayed"), "true");
    assert.equal(again.status, 201);
    assert.equal(await again.text(), await first.text());
    assert.equal(again.headers.get("location"), "/v1/things/thing-1");
    assert.equal(again.headers.get("content-type"), "application/json");
  });
});

test("another request under a journaled operation is refused locally", async () => {
  const journal = await journalIn();
  await scripted([OK], async (api) => {
    await call(api.url, { ...POST, operation: "op-1" }, { journal });
    await failure(call(api.url, { ...POST, body: { n: 2 }, operation: "op-1" }, { journal }), OperationReused);
    await failure(call(api.url, { ...POST, method: "PUT", operation: "op-1" }, { journal }), OperationReused);
    assert.equal(api.arrivals.length, 1);
  });
});

test("a journaled refusal is thrown again without sending", async () => {
  const journal = await journalIn();
  await scripted([problem(404, "not-found"), OK], async (api) => {
    for (let i = 0; i < 2; i++) {
      const error = await failure(call(api.url, { method: "DELETE", path: "/v1/things/x", operation: "op-1" }, { journal }), Refused);
      assert.equal(error.status, 404);
    }
    assert.equal(api.arrivals.length, 1);
  });
});

test("Unauthorized is not journaled", async () => {
  const journal = await journalIn();
  await scripted([problem(401, "unauthorized"), OK], async (api) => {
    const op = { ...POST, operation: "op-1" };
    await failure(call(api.url, op, { journal }), Unauthorized);
    assert.equal((await call(api.url, op, { journal })).status, 201);
    assert.equal(api.arrivals.length, 2);
    assert.equal(api.keys[0], api.keys[1], "the rerun keeps the operation's key");
  });
});

test("without a journal, an operation holds for the client's life (memory)", async () => {
  await scripted([OK], async (api) => {
    const client = new Client({ baseUrl: api.url });
    const op = { ...POST, operation: "op-1" };
    await client.request(op);
    assert.ok((await client.request(op)).headers.get("idempotency-client-journal"));
    await failure(client.request({ ...op, body: { n: 2 } }), OperationReused);
    assert.equal(api.arrivals.length, 1);
  });
});

test("a TLS failure is not retried", async () => {
  await scripted([OK], async (api) => {
    const error = await failure(call(api.url.replace("http://", "https://"), POST, { maxElapsedMs: 30_000 }), TypeError);
    assert.ok(!(error instanceof GaveUp));
    assert.equal(api.connections, 1);
  });
});

test("the injected fetch is the one used", async () => {
  const seen: string[] = [];
  const fake: typeof fetch = (input) => {
    seen.push(input instanceof Request ? input.url : String(input));
    return Promise.resolve(new Response("{}", { status: 201, headers: { "Content-Type": "application/json" } }));
  };
  const response = await new Client({ baseUrl: "http://api.invalid/base/", fetch: fake }).request(POST);
  assert.equal(response.status, 201);
  assert.deepEqual(seen, ["http://api.invalid/base/v1/things"]);
});
