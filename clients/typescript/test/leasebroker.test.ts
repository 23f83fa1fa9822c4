/** Against the real leasebroker binary: one worker per operation, whatever happens to the client. */

import assert from "node:assert/strict";
import { mkdtemp, readFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";

import { Client, GaveUp, KeyReused, OperationReused, type ClientOptions, type RequestOptions } from "../src/index.js";
import { binary, Leasebroker, TOKEN } from "./leasebroker.js";
import { journaledKey, operation, result, until, WORKER } from "./processes.js";
import { failure } from "./support.js";

const AUTH = { Authorization: `Bearer ${TOKEN}` };
const CREATE: RequestOptions = { method: "POST", path: "/v1/workers", body: WORKER };
const bin = binary();
const skip = "missing" in bin ? { skip: bin.missing } : {};

/** Runs `body` with a leasebroker of its own (started with `extra` flags) and a journal path. */
async function withBroker(extra: string[], body: (broker: Leasebroker, journal: string) => Promise<void>): Promise<void> {
  if (!("path" in bin)) return;
  const directory = await mkdtemp(join(tmpdir(), "idempotency-client-lb-"));
  const broker = await Leasebroker.start(bin.path, directory, ...extra);
  try {
    await body(broker, join(directory, "journal.json"));
  } finally {
    await broker.stop();
  }
}

function client(url: string, journal: string, options: Partial<ClientOptions> = {}): Client {
  return new Client({ baseUrl: url, headers: AUTH, journal, ...options });
}

test("a rerun after the final outcome answers from the journal", skip, async () => {
  await withBroker([], async (broker, journal) => {
    const op = { ...CREATE, operation: "ci-1" };
    const first = await client(broker.url, journal).request(op);
    assert.equal(first.status, 201);
    assert.equal((await broker.fleet())["workers_active"], 1);
    await broker.stop(); // anything sent now fails, and would end in GaveUp after maxElapsedMs
    const again = await client(broker.url, journal, { maxElapsedMs: 2000 }).request(op);
    assert.equal(again.status, 201);
    assert.deepEqual(await again.json(), await first.json());
    assert.equal(again.headers.get("location"), first.headers.get("location"));
    assert.ok(again.headers.get("idempotency-client-journal"));
  });
});

test("a client killed mid-operation and rerun makes one worker", skip, async () => {
  await withBroker(["--sim-latency-ms", "3000"], async (broker, journal) => {
    const child = operation(broker.url, journal, "ci-kill");
    const exited = new Promise((resolve) => child.once("exit", resolve));
    // The create is on the server, its VM boot held up by the simulated latency: kill the client now.
    await until("the create is in flight", async () => (await broker.inFlight()).length === 1);
    child.kill("SIGKILL");
    await exited;
    const [record] = await broker.inFlight();
    assert.equal(await journaledKey(journal, "ci-kill"), record?.key, "the key was journaled before it was sent");

    const rerun = await result(operation(broker.url, journal, "ci-kill"));
    assert.equal(rerun.status, 201);
    assert.match(rerun.body.id, /^wkr-/);
    const fleet = await broker.fleet();
    assert.equal(fleet["workers_active"], 1, JSON.stringify(fleet));
    assert.equal(fleet["vm_boots_total"], 1, JSON.stringify(fleet));
  });
});

test("several processes share one journal", skip, async () => {
  await withBroker(["--sim-latency-ms", "1000"], async (broker, journal) => {
    const same = [0, 1, 2, 3].map(() => result(operation(broker.url, journal, "ci-shared")));
    const own = [0, 1, 2, 3].map((i) => result(operation(broker.url, journal, `ci-own-${String(i)}`)));
    const sharedIds = new Set((await Promise.all(same)).map((r) => r.body.id));
    const ownIds = new Set((await Promise.all(own)).map((r) => r.body.id));
    assert.equal(sharedIds.size, 1, "four processes on one operation made more than one worker");
    assert.equal(ownIds.size, 4);
    const fleet = await broker.fleet();
    assert.equal(fleet["workers_active"], 5, JSON.stringify(fleet));
    assert.equal(fleet["vm_boots_total"], 5, JSON.stringify(fleet));
    const file = JSON.parse(await readFile(journal, "utf8")) as { operations: Record<string, { idem_key: string }> };
    const keys = Object.values(file.operations).map((row) => row.idem_key);
    assert.equal(keys.length, 5);
    assert.equal(new Set(keys).size, 5);
  });
});

test("another request under an operation is refused locally", skip, async () => {
  await withBroker([], async (broker, journal) => {
    await client(broker.url, journal).request({ ...CREATE, operation: "ci-1" });
    const executed = await broker.requests("executed");
    const bigger = { ...CREATE, body: { ...WORKER, cpu: 8 }, operation: "ci-1" };
    await failure(client(broker.url, journal).request(bigger), OperationReused);
    assert.equal(await broker.requests("executed"), executed);
    assert.equal(await broker.requests("mismatch"), 0);
    assert.equal((await broker.fleet())["workers_active"], 1);
  });
});

test("a mismatch from the server is never retried", skip, async () => {
  await withBroker(["--mismatch-status", "422"], async (broker, journal) => {
    const op = { ...CREATE, operation: "ci-1" };
    // The operation's key is journaled by a first run that reached no server...
    await failure(client("http://127.0.0.1:9", journal, { maxElapsedMs: 1000 }).request(op), GaveUp);
    const key = await journaledKey(journal, "ci-1");
    assert.ok(key !== undefined);
    // ...and someone else used that key for another request.
    const used = await fetch(`${broker.url}/v1/workers`, {
      method: "POST",
      headers: { ...AUTH, "Idempotency-Key": key, "Content-Type": "application/json" },
      body: JSON.stringify({ ...WORKER, cpu: 8 }),
    });
    assert.equal(used.status, 201);
    const error = await failure(client(broker.url, journal).request(op), KeyReused);
    assert.equal(error.status, 422);
    assert.equal(await broker.requests("mismatch"), 1, "the mismatch was sent more than once");
    assert.equal((await broker.fleet())["workers_active"], 1);
  });
});

test("each call without an operation is its own operation", skip, async () => {
  await withBroker([], async (broker) => {
    const plain = new Client({ baseUrl: broker.url, headers: AUTH });
    const first = (await (await plain.request(CREATE)).json()) as { id: string };
    const second = (await (await plain.request(CREATE)).json()) as { id: string };
    const listed = (await (await plain.request({ method: "GET", path: "/v1/workers" })).json()) as { workers: unknown[] };
    assert.notEqual(first.id, second.id);
    assert.equal(listed.workers.length, 2);
  });
});

test("a 429 is waited out for its Retry-After", skip, async () => {
  await withBroker(["--rate-limit", "1", "--rate-limit-burst", "1"], async (broker, journal) => {
    await client(broker.url, journal).request({ ...CREATE, operation: "ci-1" });
    // The principal's one request a second is spent right before the client's (a request without a
    // key: refused, nothing stored, but counted by the rate limit however long the create took),
    // so the client's first attempt is refused with Retry-After: 1.
    await fetch(`${broker.url}/v1/workers`, { method: "POST", headers: { ...AUTH, "Content-Type": "application/json" }, body: JSON.stringify(WORKER) });
    const refused = await broker.responses("429");
    const started = Date.now();
    const second = await client(broker.url, journal).request({ ...CREATE, operation: "ci-2" });
    const waited = Date.now() - started;
    assert.equal(second.status, 201);
    assert.equal(await broker.responses("429"), refused + 1, "the client came back before Retry-After");
    assert.ok(waited >= 1000, `answered after ${String(waited)} ms, sooner than Retry-After`);
    const fleet = await broker.fleet();
    assert.deepEqual([fleet["workers_active"], fleet["vm_boots_total"]], [2, 2], JSON.stringify(fleet));
  });
});

test("a 503 is waited out for its Retry-After", skip, async () => {
  await withBroker(["--pool-nodes", "1"], async (broker, journal) => {
    const first = (await (await client(broker.url, journal).request({ ...CREATE, operation: "ci-1" })).json()) as { id: string };
    // The pool's one node is taken: the next create answers 503 capacity-exhausted, Retry-After: 5.
    // Once it did, the first worker is deleted, so the retry the client makes after 5 s finds a node.
    const freeing = (async () => {
      await until("the create was refused with 503", async () => (await broker.responses("503")) === 1);
      const deleted = await fetch(`${broker.url}/v1/workers/${first.id}`, {
        method: "DELETE",
        headers: { ...AUTH, "Idempotency-Key": '"free-the-node"' },
      });
      assert.ok([200, 202, 204].includes(deleted.status), await deleted.text());
    })();
    const started = Date.now();
    const second = await client(broker.url, journal).request({ ...CREATE, operation: "ci-2" });
    const waited = Date.now() - started;
    await freeing;
    assert.equal(second.status, 201, await second.clone().text());
    assert.equal(await broker.responses("503"), 1, "the client came back before Retry-After");
    assert.ok(waited >= 5000, `answered after ${String(waited)} ms, sooner than Retry-After`);
    const fleet = await broker.fleet();
    assert.deepEqual([fleet["workers_active"], fleet["vm_boots_total"]], [1, 2], JSON.stringify(fleet));
  });
});
