#![no_main]
//! See `felix_proto::fuzzing::binary_payload` for what this target checks.
libfuzzer_sys::fuzz_target!(|data: &[u8]| felix_proto::fuzzing::binary_payload(data));
