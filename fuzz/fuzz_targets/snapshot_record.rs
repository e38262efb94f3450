#![no_main]
//! See `felix_proto::fuzzing::snapshot_record` for what this target checks.
libfuzzer_sys::fuzz_target!(|data: &[u8]| felix_proto::fuzzing::snapshot_record(data));
