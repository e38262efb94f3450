//! How the command line is shaped beyond what clap derives: environment variables renamed
//! (the old name still read), the one-line help, the runtime flag hidden where it means nothing,
//! man pages.

use crate::cli::Command;
use std::process::ExitCode;

/// Environment variables renamed to follow their flag (`--http` is `FELIX_HTTP`), old name
/// first: the old name still works, with a warning, so no deployment breaks.
pub(crate) const RENAMED_ENV: &[(&str, &str)] = &[
    ("FELIX_SUBSCRIBER_QUEUE_CAPACITY", "FELIX_QUEUE_CAPACITY"),
    ("FELIX_SUBSCRIBER_QUEUE_BYTES_MAX", "FELIX_QUEUE_BYTES_MAX"),
    ("FELIX_GROUP_VISIBILITY_TIMEOUT_MS", "FELIX_GROUP_VISIBILITY_MS"),
    ("FELIX_DEFAULT_RETENTION_RECORDS", "FELIX_RETENTION_RECORDS"),
    ("FELIX_DEFAULT_MEMORY_BYTES", "FELIX_MEMORY_BYTES"),
    ("FELIX_DURABLE_MAX_RECORDS_PER_READ", "FELIX_MAX_RECORDS_PER_READ"),
    ("FELIX_TLS_REQUIRE_ALPN", "FELIX_REQUIRE_ALPN"),
    ("FELIX_HTTP_LISTEN", "FELIX_HTTP"),
    ("FELIX_METRICS_ADDR", "FELIX_METRICS"),
];

/// Reads each renamed variable under its old name when the new one is not set: the flags
/// that read the new name read the old one instead (the environment itself is left alone).
pub(crate) fn adopt_renamed_env(mut cmd: clap::Command) -> clap::Command {
    for (old, new) in RENAMED_ENV {
        if std::env::var_os(old).is_some() && std::env::var_os(new).is_none() {
            eprintln!("warning: {old} is now {new}; the old name still works for now");
            cmd = read_env_from(cmd, new, old);
        }
    }
    cmd
}

/// Every argument of `cmd` and its subcommands that reads `new` reads `old` instead.
pub(crate) fn read_env_from(mut cmd: clap::Command, new: &str, old: &'static str) -> clap::Command {
    let ids: Vec<clap::Id> = cmd
        .get_arguments()
        .filter(|a| a.get_env() == Some(std::ffi::OsStr::new(new)))
        .map(|a| a.get_id().clone())
        .collect();
    for id in ids {
        cmd = cmd.mut_arg(id, |a| a.env(old));
    }
    let subs: Vec<String> = cmd.get_subcommands().map(|s| s.get_name().to_owned()).collect();
    for sub in subs {
        cmd = cmd.mut_subcommand(sub, |sc| read_env_from(sc, new, old));
    }
    cmd
}

/// `-h` short, `--help` whole: an argument whose help says more than one sentence shows its
/// first sentence (and its `[default: ...]`) under `-h`. Clap does that for doc comments of
/// several paragraphs; ours are one paragraph each, so `-h` printed all of it.
pub(crate) fn short_help(mut cmd: clap::Command) -> clap::Command {
    let ids: Vec<(clap::Id, String)> =
        cmd.get_arguments().filter_map(|a| Some((a.get_id().clone(), a.get_help()?.to_string()))).collect();
    for (id, help) in ids {
        if let Some(short) = first_sentence(&help) {
            cmd = cmd.mut_arg(id, |a| a.help(short).long_help(help));
        }
    }
    let subs: Vec<String> = cmd.get_subcommands().map(|s| s.get_name().to_owned()).collect();
    for sub in subs {
        cmd = cmd.mut_subcommand(sub, short_help);
    }
    cmd
}

/// `serve`'s runtime threads when `--worker-threads` is not given: one on a machine of two
/// cores or fewer, else tokio's default (one per core).
///
/// Why: a broker with two runtime threads on two cores, beside its own storage threads and
/// usually its clients, has its idle worker woken to search for work on every packet. One
/// worker halved its CPU per record at 10,000 records/s and its p99 (0.84 → 0.47 ms), lost
/// nothing at saturation, and answered one-at-a-time acknowledged publishes from Python 1.2–1.3×
/// as fast (docs/benchmarks.md). Other commands keep tokio's default: `bench` without `--addr`
/// runs a broker and its clients in one process.
pub(crate) fn default_serve_workers(command: &Command, cores: usize) -> Option<usize> {
    (matches!(command, Command::Serve(_)) && cores <= 2).then_some(1)
}

/// `--worker-threads` is global (every command runs on the async runtime), but it means
/// nothing to a user of `cluster status`, `token mint` or `completions`: their help leaves it
/// out. A hidden copy of the flag in those commands takes its place (clap gives a subcommand
/// the global flag only when it has none of that name), so it is still accepted there.
pub(crate) fn hide_runtime_flag(mut cmd: clap::Command) -> clap::Command {
    let hidden = || {
        clap::Arg::new("worker_threads")
            .long("worker-threads")
            .value_parser(clap::value_parser!(u16).range(1..=1024))
            .env("FELIX_WORKER_THREADS")
            .global(true)
            .hide(true)
    };
    for name in ["cluster", "token", "completions", "man", "conformance"] {
        cmd = cmd.mut_subcommand(name, |c| c.arg(hidden()));
    }
    cmd
}

/// The first sentence of `help` with its `[default: ...]`, when there is more to it.
pub(crate) fn first_sentence(help: &str) -> Option<String> {
    let end = help.match_indices(". ").map(|(i, _)| i).find(|&i| {
        // Not an abbreviation like "e.g. " or "i.e. ".
        !help[..i].ends_with("e.g") && !help[..i].ends_with("i.e")
    })?;
    let mut short = help[..end].to_owned();
    if let Some(d) = help.find("[default:").filter(|&d| d > end) {
        let close = help[d..].find(']').map_or(help.len(), |c| d + c + 1);
        short.push(' ');
        short.push_str(&help[d..close]);
    }
    Some(short)
}

/// `felix-node man`: the pages clap_mangen renders from the same definitions `--help` shows.
pub(crate) fn man_pages(cmd: clap::Command, out: Option<&std::path::Path>) -> ExitCode {
    let done = match out {
        Some(dir) => std::fs::create_dir_all(dir)
            .and_then(|()| clap_mangen::generate_to(cmd, dir))
            .map(|()| eprintln!("man pages written to {}", dir.display()))
            .map_err(|e| format!("writing man pages to {}: {e}", dir.display())),
        None => {
            let mut page = Vec::new();
            match clap_mangen::Man::new(cmd).render(&mut page) {
                Ok(()) => return print_all(&page),
                Err(e) => Err(e.to_string()),
            }
        }
    };
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Writes `bytes` to standard output; a reader that went away (`| head`) is not an error.
pub(crate) fn print_all(bytes: &[u8]) -> ExitCode {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: writing to standard output: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Cli;
    use clap::Parser;

    #[test]
    fn serve_on_a_small_machine_runs_one_runtime_thread_unless_told_otherwise() {
        let parse = |args: &[&str]| Cli::try_parse_from(args).map(|c| c.command).map_err(|e| e.to_string());
        let serve = parse(&["felix-node", "serve"]).expect("serve parses");
        assert_eq!(default_serve_workers(&serve, 1), Some(1));
        assert_eq!(default_serve_workers(&serve, 2), Some(1));
        assert_eq!(default_serve_workers(&serve, 4), None, "larger machines keep one per core");
        let bench = parse(&["felix-node", "bench"]).expect("bench parses");
        assert_eq!(default_serve_workers(&bench, 2), None, "an in-process bench runs broker and clients");
    }
}
