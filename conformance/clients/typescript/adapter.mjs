// The TypeScript client (clients/typescript, built: dist/index.js) under `idemcheck client`: one
// `client.request` of a small JSON body under the operation $IDEMCHECK_OPERATION, the journal file
// in $IDEMCHECK_DIR, `maxElapsedMs` from $IDEMCHECK_MAX_ELAPSED. Exits 0 on a 2xx, 1 on an
// IdempotencyError.
//
//   (cd clients/typescript && npm ci && npm run build)
//   idemcheck client -- node conformance/clients/typescript/adapter.mjs
import { join } from "node:path";

import { Client, IdempotencyError } from "../../../clients/typescript/dist/index.js";

const env = process.env;
const client = new Client({
  baseUrl: env.IDEMCHECK_URL,
  journal: join(env.IDEMCHECK_DIR, "typescript-journal.json"),
  maxElapsedMs: Number(env.IDEMCHECK_MAX_ELAPSED) * 1000,
});
try {
  const response = await client.request({
    method: "POST",
    path: env.IDEMCHECK_PATH ?? "/v1/things",
    body: { name: "idemcheck" },
    operation: env.IDEMCHECK_OPERATION,
  });
  console.log(response.status, await response.text());
} catch (error) {
  if (!(error instanceof IdempotencyError)) throw error;
  console.error(`${error.name}: ${error.message}`);
  process.exitCode = 1;
}
