/**
 * One logical create through the client, as a separate process: the tests kill it, rerun it, and
 * run several at once on one journal.
 *
 *     node operation.js URL TOKEN JOURNAL OPERATION BODY_JSON
 *
 * Prints one JSON line: the status, the body, whether the answer came from the journal, or the error.
 */

import { Client, IdempotencyError, type Json } from "../src/index.js";

const [url, token, journal, operation, body] = process.argv.slice(2);
if (url === undefined || token === undefined || journal === undefined || operation === undefined || body === undefined) {
  console.error("usage: operation.js URL TOKEN JOURNAL OPERATION BODY_JSON");
  process.exit(2);
}
const client = new Client({ baseUrl: url, headers: { Authorization: `Bearer ${token}` }, journal, maxElapsedMs: 120_000 });
try {
  const response = await client.request({ method: "POST", path: "/v1/workers", body: JSON.parse(body) as Json, operation });
  const journaled = response.headers.has("idempotency-client-journal");
  console.log(JSON.stringify({ status: response.status, body: (await response.json()) as unknown, journal: journaled }));
} catch (error) {
  if (!(error instanceof IdempotencyError)) throw error;
  console.log(JSON.stringify({ error: error.name, message: error.message }));
  process.exitCode = 1;
}
