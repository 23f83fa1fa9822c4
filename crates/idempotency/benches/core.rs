//! The core's hot paths: parsing the `Idempotency-Key` header in both forms, and fingerprinting
//! request bodies raw and as canonical JSON.
//!
//! `cargo bench -p idempotency --bench core -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_main};
use idempotency::{FingerprintMode, Fingerprinter, IdempotencyKey, RequestParts};

fn key_parsing(c: &mut Criterion) {
    let mut g = c.benchmark_group("key_parse");
    let bare = b"7c3f5d1e-91a4-4b8c-9f02-1c4a8e5b6d10".as_slice();
    let structured = br#""7c3f5d1e-91a4-4b8c-9f02-1c4a8e5b6d10""#.as_slice();
    g.bench_function("bare", |b| b.iter(|| IdempotencyKey::parse_header(black_box(bare))));
    g.bench_function("structured", |b| b.iter(|| IdempotencyKey::parse_header(black_box(structured))));
    g.finish();
}

/// A JSON object of about `size` bytes, shaped like a create-worker request with many labels.
fn json_body(size: usize) -> Vec<u8> {
    let mut body = String::from(r#"{"image":"worker-base:2025.11","cpu":16,"memory_gb":64,"labels":{"#);
    let mut i = 0;
    while body.len() + 40 < size {
        if i > 0 {
            body.push(',');
        }
        body.push_str(&format!(r#""label-{i:05}":"value-{i:021}""#));
        i += 1;
    }
    body.push_str("}}");
    body.into_bytes()
}

fn fingerprinting(c: &mut Criterion) {
    let mut g = c.benchmark_group("fingerprint");
    for size in [1024, 64 * 1024] {
        let body = json_body(size);
        assert!(serde_json::from_slice::<serde_json::Value>(&body).is_ok(), "the bench body is JSON");
        g.throughput(Throughput::Bytes(body.len() as u64));
        for (name, mode) in [("raw", FingerprintMode::Raw), ("canonical_json", FingerprintMode::CanonicalJson)] {
            let fp = Fingerprinter::new(mode);
            g.bench_with_input(BenchmarkId::new(name, format!("{}KiB", size / 1024)), &body, |b, body| {
                b.iter(|| {
                    fp.fingerprint(black_box(&RequestParts {
                        method: "POST",
                        path: "/v1/workers",
                        query: "",
                        content_type: b"application/json",
                        body,
                    }))
                })
            });
        }
    }
    g.finish();
}

/// Every benchmark of this file, for `criterion_main!`. Written out rather than made by
/// `criterion_group!`, whose undocumented `pub fn` the workspace's `missing_docs` lint refuses.
fn benches() {
    let mut criterion = Criterion::default().configure_from_args();
    key_parsing(&mut criterion);
    fingerprinting(&mut criterion);
}

criterion_main!(benches);
