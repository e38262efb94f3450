//! `felix-node`: the Felix broker and its command-line client.

/// `println!` for the CLI's output: a closed stdout (`felix-node sim | head`) ends the process
/// quietly, as it ends `cat` or `grep`, instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut o = std::io::stdout().lock();
        if writeln!(o, $($arg)*).and_then(|()| o.flush()).is_err() {
            std::process::exit(0);
        }
    }};
}

mod bench;
mod cli;
mod commands;
mod config;
mod conformance;
mod conn_bench;
mod demo;
mod groups;
mod live;
mod node;
mod reading;
mod shape;
mod soak;
mod tokens;

use cli::*;
use shape::*;
use std::path::PathBuf;
use std::process::ExitCode;

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn,felix=info".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

fn main() -> ExitCode {
    let cmd = short_help(hide_runtime_flag(adopt_renamed_env(<Cli as clap::CommandFactory>::command())));
    let cli = <Cli as clap::FromArgMatches>::from_arg_matches(&cmd.clone().get_matches()).unwrap_or_else(|e| e.exit());
    init_tracing();
    match &cli.command {
        Command::Completions { shell } => {
            // Into a buffer first: clap_complete panics on a failed write (a closed pipe).
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut cmd.clone(), "felix-node", &mut script);
            return print_all(&script);
        }
        Command::Man { out } => return man_pages(cmd, out.as_deref()),
        _ => {}
    }
    if let Command::Sim(a) = &cli.command {
        return commands::sim(a).unwrap_or(ExitCode::FAILURE);
    }
    if let Command::Conformance { dirs, verbose, addr: None, .. } = cli.command {
        let dirs = if dirs.is_empty() { vec![PathBuf::from("vectors")] } else { dirs };
        return conformance::run(&dirs, verbose);
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    let cores = std::thread::available_parallelism().map(usize::from).unwrap_or(1);
    if let Some(n) = cli.worker_threads.map(usize::from).or_else(|| default_serve_workers(&cli.command, cores)) {
        builder.worker_threads(n);
    }
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async move {
        match cli.command {
            Command::Serve(a) => commands::serve(*a).await,
            Command::Demo { cluster: false } => demo::run().await,
            Command::Demo { cluster: true } => demo::run_cluster().await,
            Command::Publish(a) => commands::publish(a).await,
            Command::Subscribe(a) => reading::subscribe(a).await,
            Command::Read(a) => reading::read(a).await,
            Command::Cache(a) => commands::cache(a).await,
            Command::Counter(a) => commands::counter(a).await,
            Command::Cluster(a) => commands::cluster(a).await,
            Command::Token(a) => tokens::run(a),
            Command::Stream(a) => commands::stream(a).await,
            Command::Group(a) => groups::group(a).await,
            Command::Consume(a) => groups::consume(a).await,
            Command::Bench(a) => bench::run(a).await,
            Command::Soak(a) => soak::run(a).await,
            Command::Conformance {
                addr: Some(addr),
                tenant,
                token,
                ca,
                data_dir,
                server_name,
                insecure_accept_any_certificate,
                alpn,
                ..
            } => {
                let trust = node::client_trust(ca.as_deref(), &data_dir, insecure_accept_any_certificate)?;
                let token = match token {
                    Some(t) => t,
                    None => std::fs::read_to_string(node::DataDir::new(&data_dir).token())
                        .map(|t| t.trim().to_owned())
                        .map_err(|e| format!("no --token and no dev token in {}: {e}", data_dir.display()))?,
                };
                Ok(live::run(live::Target { addr, trust, server_name, tenant, token, alpn }).await)
            }
            Command::Conformance { addr: None, .. }
            | Command::Sim(_)
            | Command::Completions { .. }
            | Command::Man { .. } => unreachable!("handled above"),
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
