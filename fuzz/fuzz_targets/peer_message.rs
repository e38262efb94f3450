#![no_main]
//! See `felix_proto::fuzzing::peer_message` for what this target checks. The harness owns the
//! clock: felix-proto never reads one.
libfuzzer_sys::fuzz_target!(|data: &[u8]| felix_proto::fuzzing::peer_message(data, std::time::Instant::now()));
