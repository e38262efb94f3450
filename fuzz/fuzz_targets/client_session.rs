#![no_main]
//! See `felix_proto::fuzzing::client_session` for what this target checks. The harness owns the
//! clock: felix-proto never reads one.
libfuzzer_sys::fuzz_target!(|data: &[u8]| felix_proto::fuzzing::client_session(data, std::time::Instant::now()));
