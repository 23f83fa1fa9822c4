/**
 * One logical create through the client, as a separate process: the tests kill it, rerun it, and
 * run several at once on one journal.
 *
 *     node operation.js URL TOKEN JOURNAL OPERATION BODY_JSON [PATH [HEADERS_JSON]]
 *
 * PATH is where the create goes (`/v1/workers`, leasebroker's, unless given); HEADERS_JSON, an
 * object of headers sent with it besides the bearer token.
 *
 * Prints one JSON line: the status, the body, whether the answer came from the journal, or the error.
 */

import { Client, IdempotencyError, type Json } from "../src/index.js";

const [url, token, journal, operation, body, path = "/v1/workers", extra = "{}"] = process.argv.slice(2);
if (url === undefined || token === undefined || journal === undefined || operation === undefined || body === undefined) {
  console.error("usage: operation.js URL TOKEN JOURNAL OPERATION BODY_JSON [PATH [HEADERS_JSON]]");
  process.exit(2);
}
const client = new Client({ baseUrl: url, headers: { Authorization: `Bearer ${token}`, ...(JSON.parse(extra) as Record<string, string>) }, journal, maxElapsedMs: 120_000 });
try {
  const response = await client.request({ method: "POST", path, body: JSON.parse(body) as Json, operation });
  const journaled = response.headers.has("idempotency-client-journal");
  console.log(JSON.stringify({ status: response.status, body: (await response.json()) as unknown, journal: journaled }));
} catch (error) {
  if (!(error instanceof IdempotencyError)) throw error;
  console.log(JSON.stringify({ error: error.name, message: error.message }));
  process.exitCode = 1;
}
