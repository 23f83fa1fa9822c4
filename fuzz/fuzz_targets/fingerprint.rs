#![no_main]

libfuzzer_sys::fuzz_target!(|input: idempotency_fuzz::fingerprint::Input| idempotency_fuzz::fingerprint::check(&input));
