//! The docs are checked against the code. The driver guides name every output a driver must
//! handle: docs/embedding.md (the guide for a new driver) and docs/architecture.md list each
//! `BrokerOutput` variant, read here from the enum's source, so a new variant without its line
//! in the docs fails this test. And docs/architecture.md names every module of the broker, the
//! cluster and the shard floor, read here from the source tree, so a new file without its line
//! (or a line left for a file that went) fails too.

/// The variants of one enum of output.rs, read from its source.
fn variants_of(name: &str) -> Vec<String> {
    let src = include_str!("../src/broker/output.rs");
    let body = src.split(&format!("pub enum {name} {{")).nth(1).expect("the enum is in output.rs");
    let body = &body[..body.find("\n}").expect("the enum ends")];
    body.lines()
        .filter_map(|l| l.strip_prefix("    "))
        .filter(|l| l.starts_with(|c: char| c.is_ascii_uppercase()))
        .map(|l| l.chars().take_while(char::is_ascii_alphanumeric).collect())
        .collect()
}

/// Every output: the groups of `BrokerOutput` (a driver matches those), and the variants of
/// each group's enum (what it does for each).
fn variants() -> Vec<String> {
    let groups = variants_of("BrokerOutput");
    assert_eq!(groups, ["Transport", "Storage", "Cluster"], "the groups of BrokerOutput");
    let mut all = groups.clone();
    for g in &groups {
        all.extend(variants_of(&format!("{g}Output")));
    }
    all
}

/// Whether `text` holds `word` as a whole word.
fn names(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let after = text[i + word.len()..].chars().next();
        !before.is_some_and(|c| c.is_ascii_alphanumeric()) && !after.is_some_and(|c| c.is_ascii_alphanumeric())
    })
}

#[test]
fn every_broker_output_is_named_in_the_driver_guides() {
    let vs = variants();
    assert!(vs.len() >= 26 && vs.contains(&"Transmit".to_string()), "read the enums: {vs:?}");
    for (doc, text) in [
        ("docs/embedding.md", include_str!("../../docs/embedding.md")),
        ("docs/architecture.md", include_str!("../../docs/architecture.md")),
    ] {
        let missing: Vec<&String> = vs.iter().filter(|v| !names(text, v)).collect();
        assert!(missing.is_empty(), "{doc} does not name BrokerOutput::{missing:?}");
    }
}

/// The modules of `felix-proto/src/{dir}`: each `*.rs` file but `mod.rs`, and each directory
/// holding a `mod.rs`, by name, sorted.
fn modules_in(dir: &str) -> Vec<String> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join(dir);
    let mut names: Vec<String> = std::fs::read_dir(&path)
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let p = e.path();
            if p.is_dir() {
                return p.join("mod.rs").exists().then_some(name);
            }
            let stem = name.strip_suffix(".rs")?;
            (stem != "mod").then(|| stem.to_owned())
        })
        .collect();
    names.sort();
    names
}

#[test]
fn docs_architecture_names_every_module_of_the_broker_the_cluster_and_the_shard_floor() {
    let text = include_str!("../../docs/architecture.md");
    let mut missing = Vec::new();
    for dir in ["broker", "cluster", "shard"] {
        let modules = modules_in(dir);
        assert!(modules.len() >= 5, "read {dir}: {modules:?}");
        for m in modules {
            // As a module (`serving`), a path from it (`meta::MetaNode`), a path to it
            // (`shard::copy`) or a file (`node_meta.rs`).
            let named = [format!("`{m}`"), format!("`{m}::"), format!("{dir}::{m}"), format!("{m}.rs")]
                .iter()
                .any(|form| text.contains(form.as_str()));
            if !named {
                missing.push(format!("{dir}/{m}"));
            }
        }
    }
    assert!(missing.is_empty(), "docs/architecture.md does not name {missing:?}");
}
