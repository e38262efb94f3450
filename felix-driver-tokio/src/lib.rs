//! felix-driver-tokio: moves bytes and time between quinn/tokio and the `felix-proto` state
//! machines. It makes no protocol decision.
