#![no_main]
//! See `felix_proto::fuzzing::replica_log` for what this target checks.
libfuzzer_sys::fuzz_target!(|data: &[u8]| felix_proto::fuzzing::replica_log(data));
