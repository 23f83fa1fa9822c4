/** Against the real `idempotency-gateway` in front of a service that counts what it ran: one execution per operation, whatever happens to the client. */

import assert from "node:assert/strict";
import { mkdtemp } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";

import { Client, GaveUp, KeyReused, OperationReused, type ClientOptions, type RequestOptions } from "../src/index.js";
import { Gateway } from "./gateway.js";
import { binary } from "./leasebroker.js";
import { journaledKey, operation, result, until } from "./processes.js";
import { failure } from "./support.js";

// The gateway's principal is the bearer credential (hashed): any token names a tenant.
const AUTH = { Authorization: "Bearer tok-gateway-tenant-1" };
const ORDER = { item: "rack-7", count: 2 };
const CREATE: RequestOptions = { method: "POST", path: "/orders", body: ORDER };
// The upstream holds its answer this long after it ran the request (a header outside the fingerprint).
const SLOW = { "X-Upstream-Delay-Ms": "3000" };
const bin = binary("idempotency-gateway", "GATEWAY_BIN");
const skip = "missing" in bin ? { skip: bin.missing } : {};

/** Runs `body` with a gateway of its own (started with `extra` flags) and a journal path. */
async function withGateway(extra: string[], body: (gateway: Gateway, journal: string) => Promise<void>): Promise<void> {
  if (!("path" in bin)) return;
  const directory = await mkdtemp(join(tmpdir(), "idempotency-client-gw-"));
  const gateway = await Gateway.start(bin.path, ...extra);
  try {
    await body(gateway, join(directory, "journal.json"));
  } finally {
    await gateway.stop();
  }
}

function client(url: string, journal: string, options: Partial<ClientOptions> = {}): Client {
  return new Client({ baseUrl: url, headers: AUTH, journal, ...options });
}

test("through the gateway: a rerun after the final outcome answers from the journal", skip, async () => {
  await withGateway([], async (gateway, journal) => {
    const op = { ...CREATE, operation: "gw-1" };
    const first = await client(gateway.url, journal).request(op);
    assert.equal(first.status, 201);
    assert.equal(await gateway.executions(), 1);
    await gateway.stopGateway(); // anything sent now fails, and would end in GaveUp after maxElapsedMs
    const again = await client(gateway.url, journal, { maxElapsedMs: 2000 }).request(op);
    assert.equal(again.status, 201);
    assert.deepEqual(await again.json(), await first.json());
    assert.equal(again.headers.get("location"), first.headers.get("location"));
    assert.ok(again.headers.get("idempotency-client-journal"));
    assert.equal(await gateway.executions(), 1);
  });
});

test("through the gateway: a client killed mid-operation and rerun makes one execution", skip, async () => {
  await withGateway([], async (gateway, journal) => {
    const child = operation(gateway.url, journal, "gw-kill", ORDER, "/orders", SLOW);
    const exited = new Promise((resolve) => child.once("exit", resolve));
    await until("the request reached the upstream", async () => (await gateway.executions()) === 1);
    assert.equal((await gateway.inFlight()).length, 1);
    child.kill("SIGKILL");
    await exited;
    const [record] = await gateway.inFlight();
    assert.equal(await journaledKey(journal, "gw-kill"), record?.key, "the key was journaled before it was sent");

    const rerun = await result(operation(gateway.url, journal, "gw-kill", ORDER, "/orders", SLOW));
    assert.equal(rerun.status, 201);
    assert.equal(rerun.body.order, 1, JSON.stringify(rerun));
    assert.equal(await gateway.executions(), 1, "the operation ran twice behind the gateway");
  });
});

test("through the gateway: another request under an operation is refused locally", skip, async () => {
  await withGateway([], async (gateway, journal) => {
    await client(gateway.url, journal).request({ ...CREATE, operation: "gw-1" });
    const bigger = { ...CREATE, body: { ...ORDER, count: 8 }, operation: "gw-1" };
    await failure(client(gateway.url, journal).request(bigger), OperationReused);
    assert.equal(await gateway.executions(), 1);
    assert.equal(await gateway.requests("mismatch"), 0);
  });
});

test("through the gateway: a mismatch is never retried", skip, async () => {
  await withGateway(["--mismatch-status", "422"], async (gateway, journal) => {
    const op = { ...CREATE, operation: "gw-1" };
    // The operation's key is journaled by a first run that reached no server...
    await failure(client("http://127.0.0.1:9", journal, { maxElapsedMs: 1000 }).request(op), GaveUp);
    const key = await journaledKey(journal, "gw-1");
    assert.ok(key !== undefined);
    // ...and someone else used that key for another request.
    const used = await fetch(`${gateway.url}/orders`, {
      method: "POST",
      headers: { ...AUTH, "Idempotency-Key": key, "Content-Type": "application/json" },
      body: JSON.stringify({ ...ORDER, count: 8 }),
    });
    assert.equal(used.status, 201);
    const error = await failure(client(gateway.url, journal).request(op), KeyReused);
    assert.equal(error.status, 422);
    assert.equal(await gateway.requests("mismatch"), 1, "the mismatch was sent more than once");
    assert.equal(await gateway.executions(), 1);
  });
});
