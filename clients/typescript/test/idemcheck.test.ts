/**
 * `idemcheck client` (the workspace's client checker, docs/protocol.md#clients) against this client through
 * conformance/clients/typescript/adapter.mjs (which imports the build, dist/index.js): every
 * scenario passes. The binary is `$IDEMCHECK_BIN`, else the workspace's debug build; missing, the
 * test is skipped loudly, and fails under `CI=true`.
 */

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { join } from "node:path";
import { test } from "node:test";

import { binary, REPO } from "./leasebroker.js";

const ADAPTER = join(REPO, "conformance", "clients", "typescript", "adapter.mjs");
const bin = binary("idemcheck", "IDEMCHECK_BIN");

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
