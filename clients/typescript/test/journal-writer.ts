/**
 * Writes to a journal file from a process of its own: begins and finishes `COUNT` operations named
 * `PREFIX-0`... and one shared operation, then prints the shared operation's key.
 *
 *     node journal-writer.js JOURNAL PREFIX COUNT
 */

import { FileJournal } from "../src/file-journal.js";

const [path, prefix, count] = process.argv.slice(2);
if (path === undefined || prefix === undefined || count === undefined) {
  console.error("usage: journal-writer.js JOURNAL PREFIX COUNT");
  process.exit(2);
}
const journal = await FileJournal.open(path);
const shared = await journal.begin("shared", "sha256:shared");
for (let i = 0; i < Number(count); i++) {
  const operation = `${prefix}-${String(i)}`;
  await journal.begin(operation, `sha256:${operation}`);
  await journal.finish(operation, { status: 201, headers: {}, body: new TextEncoder().encode(operation) });
}
console.log(shared.key);
