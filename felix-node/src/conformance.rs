//! `felix-node conformance DIR...`: the vector runner. The checking itself is
//! `felix_proto::conformance`; this module only reads files and reports.

use felix_proto::conformance::check_vector;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Outcome of one vector.
pub struct Outcome {
    pub name: String,
    pub result: Result<(), String>,
}

/// Checks every `*.json` vector in `dir` (sorted by name). A `.json` without its `.hex` fails.
pub fn check_dir(dir: &Path) -> Result<Vec<Outcome>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut jsons: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    jsons.sort();
    let mut out = Vec::new();
    for json in jsons {
        let name = json.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        let hex = json.with_extension("hex");
        let result = match (std::fs::read_to_string(&json), std::fs::read_to_string(&hex)) {
            (Ok(j), Ok(h)) => check_vector(&j, &h).map_err(|e| e.to_string()),
            (Err(e), _) => Err(format!("{}: {e}", json.display())),
            (_, Err(e)) => Err(format!("{}: {e}", hex.display())),
        };
        out.push(Outcome { name, result });
    }
    Ok(out)
}

pub fn run(dirs: &[PathBuf], verbose: bool) -> ExitCode {
    let (mut passed, mut failed) = (0usize, 0usize);
    for dir in dirs {
        match check_dir(dir) {
            Ok(outcomes) => {
                if outcomes.is_empty() {
                    out!("FAIL {}: no vectors found", dir.display());
                    failed += 1;
                }
                for o in outcomes {
                    match o.result {
                        Ok(()) => {
                            passed += 1;
                            if verbose {
                                out!("ok   {}/{}", dir.display(), o.name);
                            }
                        }
                        Err(e) => {
                            failed += 1;
                            out!("FAIL {}/{}: {e}", dir.display(), o.name);
                        }
                    }
                }
            }
            Err(e) => {
                failed += 1;
                out!("FAIL {e}");
            }
        }
    }
    out!("{passed} passed, {failed} failed");
    if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
