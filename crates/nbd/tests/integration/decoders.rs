//! The decoders on stable, so CI covers what the fuzz targets cover:
//! replays the committed corpus (`tests/corpus/{option,request}`, the
//! seeds of `fuzz/`), feeds random bytes, and checks that every valid
//! option round-trips through its encoding.

#![allow(clippy::unwrap_used)]
// Reads the corpus from the source tree, outside the env seam.
#![allow(clippy::disallowed_methods)]

use std::path::Path;

use proptest::prelude::*;

use blizzard_nbd::fuzzing;
use blizzard_nbd::proto::*;

fn corpus(kind: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus").join(kind);
    let mut out: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap())
        })
        .collect();
    out.sort();
    assert!(out.len() >= 10, "corpus {dir:?} is missing");
    out
}

/// Every committed option input decodes without panicking, and the ones
/// that should be refused are.
#[test]
fn option_corpus_replays() {
    for (name, data) in corpus("option") {
        fuzzing::option(&data);
        // Inputs kept from fuzz campaigns (`fuzz-*`, see fuzz/README.md)
        // only have to decode without panicking; the expectations below
        // are for the hand-written ones, whose names say what they are.
        if name.starts_with("fuzz-") {
            continue;
        }
        let code = u32::from_be_bytes(data[..4].try_into().unwrap());
        let decoded = decode_option(code, &data[4..]);
        let should_fail = [
            "nul",
            "not_utf8",
            "list_with_data",
            "past_end",
            "mismatch",
            "truncated",
            "huge_count",
            "trailing",
        ]
        .iter()
        .any(|k| name.contains(k));
        assert_eq!(decoded.is_err(), should_fail, "{name}: {decoded:?}");
    }
}

/// Every committed request input validates without panicking.
#[test]
fn request_corpus_replays() {
    for (name, data) in corpus("request") {
        fuzzing::request(&data);
        if name == "bad_magic" || name == "truncated" {
            assert!(decode_request(&data).is_err(), "{name}");
        }
    }
}

fn name() -> impl Strategy<Value = String> {
    "[a-z0-9:_-]{0,40}"
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Random bytes never panic the option decoder.
    #[test]
    fn random_options(data in proptest::collection::vec(any::<u8>(), 0..300)) {
        fuzzing::option(&data);
    }

    /// Random option data after a known option number.
    #[test]
    fn random_option_data(code in 1u32..12, data in proptest::collection::vec(any::<u8>(), 0..200)) {
        let mut d = code.to_be_bytes().to_vec();
        d.extend_from_slice(&data);
        fuzzing::option(&d);
    }

    /// Random request headers (with the right magic, so validation runs).
    #[test]
    fn random_requests(mut data in proptest::collection::vec(any::<u8>(), 28..40), cmd in 0u16..10) {
        data[..4].copy_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
        data[6..8].copy_from_slice(&cmd.to_be_bytes());
        fuzzing::request(&data);
    }

    /// Well-formed GO and SET_META_CONTEXT options round-trip.
    #[test]
    fn valid_options_round_trip(n in name(), infos in proptest::collection::vec(0u16..5, 0..6), qs in proptest::collection::vec(name(), 0..5)) {
        for o in [
            ClientOption::Go(InfoRequest { name: n.clone(), info: infos.clone() }),
            ClientOption::Info(InfoRequest { name: n.clone(), info: infos.clone() }),
            ClientOption::SetMetaContext(MetaContextRequest { export: n.clone(), queries: qs.clone() }),
            ClientOption::ListMetaContext(MetaContextRequest { export: n.clone(), queries: qs.clone() }),
            ClientOption::ExportName(n.clone()),
        ] {
            let enc = o.encode();
            let h = decode_option_header(&enc).unwrap();
            prop_assert_eq!(decode_option(h.option, &enc[16..]).unwrap(), o);
        }
    }
}
