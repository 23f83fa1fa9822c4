// stripe-node's built-in retries under `idemcheck client`: one `stripe.customers.create` against the
// kit (host, port and protocol from $IDEMCHECK_URL), with `maxNetworkRetries: 3`. The SDK makes the
// Idempotency-Key itself (once per call, before its retry loop); the adapter passes none, so what
// is checked is the SDK's own behaviour. Its retries are counted, not timed (it has no setting for
// $IDEMCHECK_MAX_ELAPSED).
//
//   idemcheck client --path /v1/customers -- node conformance/clients/stripe-node/adapter.mjs
//
// Two things the adapter does for the SDK, neither about retries: stripe-node answers a non-2xx
// whose body lacks Stripe's `error` member as a success (the kit's answers are RFC 9457 problems),
// so the adapter fails on `lastResponse.statusCode` >= 300; and its keep-alive agent can keep the
// process alive after the answer, so the adapter exits explicitly.
//
// The stripe package is looked up under $THIRD_PARTY_CLIENTS_NODE (default
// target/tools/third-party-clients-node, where conformance/clients/run installs it).
import { createRequire } from "node:module";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "../../..");
const modules = process.env.THIRD_PARTY_CLIENTS_NODE ?? join(root, "target/tools/third-party-clients-node");
const Stripe = createRequire(join(modules, "package.json"))("stripe");

const url = new URL(process.env.IDEMCHECK_URL);
const stripe = new Stripe("sk_test_idemcheck", {
  host: url.hostname,
  port: Number(url.port),
  protocol: url.protocol.replace(":", ""),
  maxNetworkRetries: 3,
});
let code = 0;
try {
  const customer = await stripe.customers.create({ email: "idemcheck@example.com" });
  const status = customer.lastResponse.statusCode;
  console.log(status, JSON.stringify(customer));
  if (status >= 300) code = 1;
} catch (error) {
  console.error(`${error.type ?? error.name}: ${error.message}`);
  code = 1;
}
process.exit(code);
