//! Request header decoding and validation: 28 header bytes, 8 bytes of
//! export size, one byte of negotiated features.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    blizzard_nbd::fuzzing::request(data);
});
