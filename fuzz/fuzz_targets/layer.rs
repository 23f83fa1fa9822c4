#![no_main]

libfuzzer_sys::fuzz_target!(|input: idempotency_fuzz::layer::Input| idempotency_fuzz::layer::check(&input));
