/** What the tests against real servers share: the client as a process of its own, and waiting for a state. */

import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { readFile } from "node:fs/promises";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import type { Json } from "../src/index.js";
import { TOKEN } from "./leasebroker.js";

const OPERATION = join(dirname(fileURLToPath(import.meta.url)), "operation.js");
export const WORKER = { image: "worker-base:2025.11", cpu: 2, memory_gb: 4, labels: { team: "ci" } };

/** Waits for `check` to hold (polling a state, not sleeping a guess). */
export async function until(what: string, check: () => Promise<boolean>, deadlineMs = 60_000): Promise<void> {
  const end = Date.now() + deadlineMs;
  while (!(await check())) {
    if (Date.now() > end) assert.fail(`${what}: not within ${String(deadlineMs / 1000)} s`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

/**
 * The client as a process of its own, making one create (`POST path`, leasebroker's `/v1/workers`
 * unless given) under `op`, with `headers` besides the bearer token.
 */
export function operation(url: string, journal: string, op: string, body: Json = WORKER, path = "/v1/workers", headers: Record<string, string> = {}): ChildProcess {
  const args = [OPERATION, url, TOKEN, journal, op, JSON.stringify(body), path, JSON.stringify(headers)];
  return spawn(process.execPath, args, { stdio: ["ignore", "pipe", "inherit"] });
}

export interface Outcome {
  status: number;
  /** leasebroker's worker (`id`), or the gateway's test upstream's answer (`order`, its count). */
  body: { id: string; order: number };
  journal: boolean;
}

export async function result(child: ChildProcess): Promise<Outcome> {
  let out = "";
  child.stdout?.on("data", (chunk: Buffer) => (out += chunk.toString()));
  const code = await new Promise((resolve) => child.once("exit", resolve));
  assert.equal(code, 0, `client exited ${String(code)}: ${out}`);
  return JSON.parse(out) as Outcome;
}

export async function journaledKey(journal: string, op: string): Promise<string | undefined> {
  const file = JSON.parse(await readFile(journal, "utf8")) as { operations: Record<string, { idem_key: string }> };
  return file.operations[op]?.idem_key;
}
