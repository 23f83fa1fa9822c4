#![no_main]

// The first byte picks the form: raw bytes as the JSON body, or structured fields.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    match data.split_first() {
        Some((0, rest)) => {
            if let Ok(f) = arbitrary::Arbitrary::arbitrary(&mut arbitrary::Unstructured::new(rest)) {
                idempotency_fuzz::worker::check_fields(&f);
            }
        }
        Some((_, rest)) => idempotency_fuzz::worker::check_bytes(rest),
        None => {}
    }
});
