/** Helpers shared by the tests. */

import assert from "node:assert/strict";
import { mkdtemp } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";

/** The error `promise` rejects with, checked to be a `kind`. */
export async function failure<E extends Error>(promise: Promise<unknown>, kind: abstract new (...args: never[]) => E): Promise<E> {
  try {
    await promise;
  } catch (error) {
    assert.ok(error instanceof kind, `expected ${kind.name}, got ${String(error)}`);
    return error;
  }
  return assert.fail(`expected ${kind.name}, got a response`);
}

export async function journalIn(): Promise<string> {
  return join(await mkdtemp(join(tmpdir(), "idempotency-client-")), "journal.json");
}
