//! `felix-node`: the Felix broker and its command-line client.

mod conformance;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

/// Felix: a QUIC pub/sub and cache broker.
#[derive(Parser, Debug)]
#[command(name = "felix-node", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Check conformance vectors (NAME.json + NAME.hex pairs) byte for byte.
    ///
    /// For each vector the frame is decoded and compared with what the JSON says it means, then
    /// re-encoded and compared with the bytes. Prints one line per failure and ends with
    /// `N passed, M failed`; exits non-zero on any failure.
    Conformance {
        /// Directories holding vectors (default: ./vectors).
        dirs: Vec<PathBuf>,
        /// Also print a line for every vector that passes.
        #[arg(short, long)]
        verbose: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Conformance { dirs, verbose } => {
            let dirs = if dirs.is_empty() { vec![PathBuf::from("vectors")] } else { dirs };
            conformance::run(&dirs, verbose)
        }
    }
}
