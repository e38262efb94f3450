//! The Python client (felix-py) built as a wheel and its pytest suite run against brokers it
//! starts from this build's `felix-node`: single broker and a three-broker cluster with a
//! leader killed mid-stream. Part of `cargo test --workspace`, so the README's one test command
//! covers the bindings too.
//!
//! It makes a virtual environment in `target/py-venv` (once), installs maturin, pytest and
//! pytest-asyncio into it from PyPI, builds the wheel with maturin into its own target
//! directory (`target/py-build`: the outer `cargo test` holds the workspace's build lock), and
//! installs it. Needs `python3` (3.9 or later, with venv) and a Rust toolchain; a machine
//! without them fails here, saying so, rather than skipping.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_felix-node");

/// Runs `cmd` to completion within `limit`, killing it past that; its combined output.
fn run(what: &str, cmd: &mut Command, limit: Duration) -> String {
    let out = tempfile::NamedTempFile::new().unwrap();
    let err = out.reopen().unwrap();
    let mut child = cmd
        .stdout(Stdio::from(out.reopen().unwrap()))
        .stderr(Stdio::from(err))
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: could not start {cmd:?}: {e}"));
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let text = std::fs::read_to_string(out.path()).unwrap_or_default();
    match status {
        Some(s) if s.success() => text,
        Some(s) => panic!("{what} failed ({s}):\n{text}"),
        None => panic!("{what} did not finish within {limit:?}:\n{text}"),
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

#[test]
fn the_python_client_builds_as_a_wheel_and_passes_its_pytest_suite() {
    let root = root();
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let venv = target.join("py-venv");
    let py = venv.join("bin").join("python");
    let python = std::env::var("FELIX_PYTHON").unwrap_or_else(|_| "python3".into());
    if !py.exists() {
        run(
            "making the virtual environment (python3 -m venv; Debian: apt-get install python3-venv)",
            Command::new(&python).args(["-m", "venv"]).arg(&venv),
            Duration::from_secs(120),
        );
    }
    let tools = venv.join(".felix-tools");
    if !tools.exists() {
        run(
            "installing maturin, pytest and pytest-asyncio from PyPI",
            Command::new(&py).args([
                "-m",
                "pip",
                "install",
                "-q",
                "--disable-pip-version-check",
                "maturin>=1.5,<2",
                "pytest>=7",
                "pytest-asyncio>=0.21",
            ]),
            Duration::from_secs(600),
        );
        std::fs::write(&tools, b"").unwrap();
    }
    let wheels = target.join("py-wheels");
    let _ = std::fs::remove_dir_all(&wheels);
    run(
        "building the wheel (maturin build)",
        Command::new(venv.join("bin").join("maturin"))
            .args(["build", "-q", "-m"])
            .arg(root.join("felix-py").join("Cargo.toml"))
            .arg("-o")
            .arg(&wheels)
            .env("CARGO_TARGET_DIR", target.join("py-build")),
        Duration::from_secs(1800),
    );
    let wheel = std::fs::read_dir(&wheels)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .expect("maturin wrote a wheel");
    run(
        "installing the wheel",
        Command::new(&py)
            .args(["-m", "pip", "install", "-q", "--disable-pip-version-check", "--force-reinstall", "--no-deps"])
            .arg(&wheel),
        Duration::from_secs(120),
    );
    let out = run(
        "the pytest suite (felix-py/tests)",
        Command::new(&py)
            .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
            .arg(root.join("felix-py").join("tests"))
            .current_dir(root.join("felix-py"))
            .env("FELIX_NODE_BIN", BIN),
        Duration::from_secs(900),
    );
    eprintln!("{out}");
    let summary = out.lines().rev().find(|l| l.contains(" passed")).unwrap_or_default();
    assert!(summary.contains(" passed") && !summary.contains("failed"), "{out}");
}
