/** The journal file: private, refused when exposed, safe for several processes, its lock recovered. */

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { chmod, mkdtemp, readFile, stat, writeFile } from "node:fs/promises";
import { hostname, tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

import { JournalError } from "../src/errors.js";
import { FileJournal, STALE_MS, stale } from "../src/file-journal.js";
import { Client } from "../src/index.js";
import { created, scripted } from "./scripted.js";
import { failure } from "./support.js";

const run = promisify(execFile);
const WRITER = join(dirname(fileURLToPath(import.meta.url)), "journal-writer.js");

async function temporary(): Promise<string> {
  return mkdtemp(join(tmpdir(), "idempotency-client-"));
}

function mode(info: { mode: number }): number {
  return info.mode & 0o777;
}

test("the file is 0600 in new directories 0700, and the lock is gone after a write", async () => {
  const path = join(await temporary(), "state", "ci", "journal.json");
  await scripted([created({})], async (api) => {
    await new Client({ baseUrl: api.url, journal: path }).request({ method: "POST", path: "/v1/things", body: {}, operation: "op-1" });
  });
  assert.equal(mode(await stat(path)), 0o600);
  assert.equal(mode(await stat(dirname(path))), 0o700);
  assert.equal(mode(await stat(dirname(dirname(path)))), 0o700);
  await assert.rejects(stat(`${path}.lock`), { code: "ENOENT" });
  const file = JSON.parse(await readFile(path, "utf8")) as { format: string; operations: Record<string, { idem_key: string }> };
  assert.equal(file.format, "idempotency-client-journal");
  assert.ok(file.operations["op-1"]?.idem_key);
});

for (const exposed of [0o644, 0o660, 0o604]) {
  test(`a journal others can read or write (${exposed.toString(8)}) is refused`, async () => {
    const path = join(await temporary(), "journal.json");
    await (await FileJournal.open(path)).begin("op-1", "sha256:x");
    await chmod(path, exposed);
    const client = new Client({ baseUrl: "http://127.0.0.1:9", journal: path });
    const error = await failure(client.request({ method: "POST", path: "/v1/things", operation: "op-1" }), JournalError);
    assert.ok(error.message.includes(path));
    assert.ok(error.message.includes(`chmod 600 ${path}`));
    assert.ok(!error.message.includes("\n"));
  });
}

test("a file that is not a journal is an error, not an empty journal", async () => {
  const path = join(await temporary(), "journal.json");
  await writeFile(path, "{ not json", { mode: 0o600 });
  await failure(FileJournal.open(path), JournalError);
  await writeFile(path, '{"operations": {}}', { mode: 0o600 });
  await failure(FileJournal.open(path), JournalError);
});

test("several processes write one journal at once and lose nothing", async () => {
  const path = join(await temporary(), "journal.json");
  const writers = ["a", "b", "c", "d"].map((prefix) => run(process.execPath, [WRITER, path, prefix, "15"]));
  const keys = (await Promise.all(writers)).map((done) => done.stdout.trim());
  assert.equal(new Set(keys).size, 1, "the shared operation got more than one key");
  const journal = await FileJournal.open(path);
  for (const prefix of ["a", "b", "c", "d"]) {
    for (let i = 0; i < 15; i++) {
      const operation = `${prefix}-${String(i)}`;
      const entry = await journal.begin(operation, `sha256:${operation}`);
      assert.equal(entry.outcome?.status, 201, `${operation} lost its outcome`);
      assert.equal(new TextDecoder().decode(entry.outcome.body), operation);
    }
  }
  assert.equal(mode(await stat(path)), 0o600);
});

test("a lock is stale when its process is gone or it is too old, not while its owner runs", async () => {
  const gone = await run(process.execPath, ["-e", "console.log(process.pid)"]);
  const deadPid = gone.stdout.trim();
  assert.equal(stale(`${deadPid} ${hostname()} x`, 0), true);
  assert.equal(stale(`${String(process.pid)} ${hostname()} x`, 0), false);
  assert.equal(stale(`${deadPid} another-host x`, 0), false, "a pid of another machine says nothing here");
  assert.equal(stale(`${String(process.pid)} ${hostname()} x`, STALE_MS + 1), true);
  assert.equal(stale("", 0), false);
});

test("a lock left by a dead process does not block the journal", async () => {
  const path = join(await temporary(), "journal.json");
  const gone = await run(process.execPath, ["-e", "console.log(process.pid)"]);
  await writeFile(`${path}.lock`, `${gone.stdout.trim()} ${hostname()} left-behind`, { mode: 0o600 });
  const journal = await FileJournal.open(path);
  const entry = await journal.begin("op-1", "sha256:x");
  assert.equal((await journal.begin("op-1", "sha256:x")).key, entry.key);
  await assert.rejects(stat(`${path}.lock`), { code: "ENOENT" });
});

// The fingerprint of the quick start's request (both READMEs): the Python suite checks the same
// value, so the two clients fingerprint one request alike.
const QUICK_START_FINGERPRINT = "sha256:1c18cda41ba53ada6b1e907130c7025b461a19f9d944ba3f33a374d396cd76d4";

test("the fingerprint is the documented one", async () => {
  const path = join(await temporary(), "journal.json");
  const body = { image: "worker-base:2025.11", cpu: 16, memory_gb: 64 };
  await scripted([created({})], async (api) => {
    await new Client({ baseUrl: api.url, journal: path }).request({ method: "POST", path: "/v1/workers", body, operation: "nightly-ci-4711" });
    assert.equal(api.arrivals[0]?.body, '{"cpu":16,"image":"worker-base:2025.11","memory_gb":64}');
  });
  const file = JSON.parse(await readFile(path, "utf8")) as { operations: Record<string, { fingerprint: string }> };
  assert.equal(file.operations["nightly-ci-4711"]?.fingerprint, QUICK_START_FINGERPRINT);
});
