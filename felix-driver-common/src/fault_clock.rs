//! A broker's wall clock set off, for clock-fault tests.
//!
//! A broker reads the system clock once, at start: its wall time after that is the start
//! reading plus the monotonic time since (so a clock stepped while it runs changes nothing
//! until it restarts), and its leases, timeouts and deadlines use the monotonic clock alone.
//! A clock jump therefore reaches a broker as the wall time it starts with. With
//! `FELIX_FAULT_WALL_OFFSET_MS=N` (signed) in its environment a broker starts with its wall
//! clock N ms off the system's: as if its machine's clock had been stepped by N before it
//! (re)started. Off (the default) it is 0.

/// The environment variable that sets a broker's wall clock off.
pub const WALL_OFFSET_ENV: &str = "FELIX_FAULT_WALL_OFFSET_MS";

/// The system's wall time (µs since the Unix epoch) moved by the configured offset; a value
/// that does not parse is ignored (said once in the log).
pub fn wall_micros(system_micros: u64) -> u64 {
    let Ok(v) = std::env::var(WALL_OFFSET_ENV) else { return system_micros };
    match v.trim().parse::<i64>() {
        Ok(ms) => {
            tracing::warn!("{WALL_OFFSET_ENV}={ms}: this broker's wall clock is {ms} ms off the system's");
            system_micros.saturating_add_signed(ms.saturating_mul(1000))
        }
        Err(_) => {
            tracing::error!("{WALL_OFFSET_ENV}={v:?} is not a whole number of milliseconds; ignored");
            system_micros
        }
    }
}
