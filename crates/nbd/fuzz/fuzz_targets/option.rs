//! Option decoding: 4 bytes of option number, then its data.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    blizzard_nbd::fuzzing::option(data);
});
