//! The modules' floors (docs/architecture.md): the cluster builds on the broker, the broker on
//! `shard`, and never the other way. Read from the sources, so an import that climbs a floor
//! fails here rather than growing back into a circle. Doc links may point anywhere: they are
//! read by people, not compiled into a dependency.

use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, recursively, in name order.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(dir).expect("a source directory").flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            out.extend(sources(&p));
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
    out
}

/// The lines of `file` that are code (not comments) and name `path`.
fn code_naming(file: &Path, path: &str) -> Vec<String> {
    let text = std::fs::read_to_string(file).expect("a readable source");
    text.lines()
        .map(str::trim_start)
        .filter(|l| !l.starts_with("//"))
        .filter(|l| l.contains(path))
        .map(|l| format!("{}: {l}", file.display()))
        .collect()
}

fn climbing(floor: &str, above: &[&str]) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join(floor);
    let files = if root.is_dir() { sources(&root) } else { vec![root.with_extension("rs")] };
    assert!(files.iter().all(|f| f.is_file()) && !files.is_empty(), "found the sources of {floor}");
    files.iter().flat_map(|f| above.iter().flat_map(move |p| code_naming(f, p))).collect()
}

#[test]
fn the_broker_never_names_the_cluster() {
    let found = climbing("broker", &["crate::cluster", "super::super::cluster"]);
    assert!(
        found.is_empty(),
        "broker/ imports the cluster (it takes what it needs from crate::shard):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_shard_floor_names_neither_the_broker_nor_the_cluster() {
    let found = climbing("shard", &["crate::cluster", "crate::broker", "super::super::"]);
    assert!(found.is_empty(), "shard/ climbs a floor:\n{}", found.join("\n"));
}

#[test]
fn the_wire_and_storage_floors_name_no_state_machine() {
    let floors = [
        "storage",
        "binary",
        "message",
        "frame",
        "jwt",
        "auth",
        "routing",
        "transport",
        "negotiate",
        "payload",
        "flags",
        "features",
        "error_code",
    ];
    let found: Vec<String> = floors
        .iter()
        .flat_map(|f| climbing(f, &["crate::broker", "crate::cluster", "crate::client", "crate::shard"]))
        .collect();
    assert!(found.is_empty(), "a floor below the state machines names one:\n{}", found.join("\n"));
}

/// Small modules named after what they hold (docs/architecture.md, "The drivers and the binary,
/// by file"): no source file of the workspace, tests included, grows past 1,000 lines. The
/// vendored quinn is upstream's layout and is left out.
#[test]
fn no_source_file_of_the_workspace_is_over_a_thousand_lines() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root");
    let crates = [
        "felix-proto",
        "felix-driver-common",
        "felix-driver-tokio",
        "felix-driver-blocking",
        "felix-node",
        "felix-py",
        "fuzz",
    ];
    let mut long = Vec::new();
    let mut read = 0;
    for c in crates {
        for sub in ["src", "tests", "benches", "fuzz_targets", "examples"] {
            let dir = workspace.join(c).join(sub);
            if !dir.is_dir() {
                continue;
            }
            for f in sources(&dir) {
                let lines = std::fs::read_to_string(&f).expect("a readable source").lines().count();
                read += 1;
                if lines > 1_000 {
                    long.push(format!("{}: {lines} lines", f.display()));
                }
            }
        }
    }
    assert!(read > 300, "read the workspace's sources ({read} files)");
    assert!(long.is_empty(), "split these into modules named after what they hold:\n{}", long.join("\n"));
}
