/**
 * `idemcheck client` (the workspace's client checker, SPEC 9) against this client through
 * conformance/clients/typescript/adapter.mjs (which imports the build, dist/index.js): every
 * scenario passes. The binary is `$IDEMCHECK_BIN`, else the workspace's debug build; missing, the
 * test is skipped loudly, and fails under `CI=true`.
 */

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

// build/test/idemcheck.test.js -> the workspace root
const REPO = resolve(dirname(fileURLToPath(import.meta.url)), "../../../..");
const ADAPTER = join(REPO, "conformance", "clients", "typescript", "adapter.mjs");

function idemcheck(): { path: string } | { missing: string } {
  const target = process.env["CARGO_TARGET_DIR"] ?? join(REPO, "target");
  const path = process.env["IDEMCHECK_BIN"] ?? join(target, "debug", "idemcheck");
  if (existsSync(path)) return { path };
  const missing = `idemcheck binary not found at ${path} (build it: cargo build -p idemcheck)`;
  if (process.env["CI"] === "true") throw new Error(missing);
  console.error(`SKIPPED: ${missing}`);
  return { missing };
}

const bin = idemcheck();

test("idemcheck client passes every scenario", "missing" in bin ? { skip: bin.missing } : {}, () => {
  if (!("path" in bin)) return;
  const run = spawnSync(bin.path, ["client", "--budget", "3", "--", process.execPath, ADAPTER], {
    cwd: REPO,
    encoding: "utf8",
    timeout: 600_000,
  });
  const output = `${run.stdout}${run.stderr}`;
  assert.equal(run.status, 0, output);
  assert.equal(run.stdout.trimEnd().split("\n").at(-1), "11 passed, 0 failed", output);
});
