/** Against the real leasebroker binary: one worker per operation, whatever happens to the client. */

import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { mkdtemp, readFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { Client, GaveUp, KeyReused, OperationReused, type ClientOptions, type Json, type RequestOptions } from "../src/index.js";
import { binary, Leasebroker, TOKEN } from "./leasebroker.js";
import { failure } from "./support.js";

const AUTH = { Authorization: `Bearer ${TOKEN}` };
const WORKER = { image: "worker-base:2025.11", cpu: 2, memory_gb: 4, labels: { team: "ci" } };
const CREATE: RequestOptions = { method: "POST", path: "/v1/workers", body: WORKER };
const OPERATION = join(dirname(fileURLToPath(import.meta.url)), "operation.js");
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

/** Waits for `check` to hold (polling a state, not sleeping a guess). */
async function until(what: string, check: () => Promise<boolean>, deadlineMs = 60_000): Promise<void> {
  const end = Date.now() + deadlineMs;
  while (!(await check())) {
    if (Date.now() > end) assert.fail(`${what}: not within ${String(deadlineMs / 1000)} s`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

/** The client as a process of its own, making one create under `op`. */
function operation(url: string, journal: string, op: string, body: Json = WORKER): ChildProcess {
  return spawn(process.execPath, [OPERATION, url, TOKEN, journal, op, JSON.stringify(body)], { stdio: ["ignore", "pipe", "inherit"] });
}

interface Outcome {
  status: number;
  body: { id: string };
  journal: boolean;
}

async function result(child: ChildProcess): Promise<Outcome> {
  let out = "";
  child.stdout?.on("data", (chunk: Buffer) => (out += chunk.toString()));
  const code = await new Promise((resolve) => child.once("exit", resolve));
  assert.equal(code, 0, `client exited ${String(code)}: ${out}`);
  return JSON.parse(out) as Outcome;
}

async function journaledKey(journal: string, op: string): Promise<string | undefined> {
  const file = JSON.parse(await readFile(journal, "utf8")) as { operations: Record<string, { idem_key: string }> };
  return file.operations[op]?.idem_key;
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
