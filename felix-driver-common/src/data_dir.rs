//! What a broker keeps at the top of its data directory besides its streams: its TLS
//! certificate and key (generated on first start), and the development token clients on the
//! same machine read. Every driver uses the same layout, so `felix-node` clients find a broker's
//! certificate and token whichever driver runs it.

use crate::tls::{CertAuthority, Identity};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Where the broker keeps its files.
pub struct DataDir {
    pub root: PathBuf,
}

impl DataDir {
    pub fn new(root: impl Into<PathBuf>) -> DataDir {
        DataDir { root: root.into() }
    }
    pub fn cert(&self) -> PathBuf {
        self.root.join("tls").join("cert.pem")
    }
    pub fn key(&self) -> PathBuf {
        self.root.join("tls").join("key.pem")
    }
    pub fn token(&self) -> PathBuf {
        self.root.join("dev-token")
    }

    /// The broker's certificate: loaded, or generated (for `localhost`) on first start.
    pub fn identity(&self) -> Result<(Identity, bool), String> {
        self.identity_for(&[])
    }

    /// The broker's certificate: loaded, or generated on first start for `localhost`,
    /// 127.0.0.1, ::1 and `names` (the host names and addresses the broker is reached at).
    pub fn identity_for(&self, names: &[String]) -> Result<(Identity, bool), String> {
        if self.cert().exists() && self.key().exists() {
            return Identity::load(&self.cert(), &self.key()).map(|i| (i, false)).map_err(|e| e.to_string());
        }
        let dir = self.root.join("tls");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let all = Self::names(names);
        let (id, cert, key) = Identity::self_signed(&all).map_err(|e| e.to_string())?;
        std::fs::write(self.cert(), cert).map_err(|e| format!("{}: {e}", self.cert().display()))?;
        write_private(&self.key(), key.as_bytes())?;
        Ok((id, true))
    }

    /// The broker's certificate when the cluster shares a CA: loaded when the CA signed it,
    /// else issued by `ca` for the same names as [`DataDir::identity_for`] (the second value
    /// says so). `cert.pem` holds the certificate and then the CA's, so a client given this
    /// file trusts every broker the CA signed. A certificate the broker made before (its own
    /// self-signed one, or another CA's) is kept beside it as `cert.pem.replaced`.
    pub fn identity_from_ca(&self, ca: &CertAuthority, names: &[String]) -> Result<(Identity, bool), String> {
        if self.cert().exists() && self.key().exists() {
            let id = Identity::load(&self.cert(), &self.key()).map_err(|e| e.to_string())?;
            if id.chain.get(1) == Some(&ca.cert()) {
                return Ok((id, false));
            }
            for p in [self.cert(), self.key()] {
                let mut old = p.clone().into_os_string();
                old.push(".replaced");
                std::fs::rename(&p, &old).map_err(|e| format!("{}: {e}", p.display()))?;
            }
        }
        let dir = self.root.join("tls");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let all = Self::names(names);
        let (id, cert, key) = ca.issue_chain(&all).map_err(|e| e.to_string())?;
        write_private(&self.key(), key.as_bytes())?;
        std::fs::write(self.cert(), cert).map_err(|e| format!("{}: {e}", self.cert().display()))?;
        Ok((id, true))
    }

    /// `localhost`, 127.0.0.1, ::1 and `names`, once each.
    fn names(names: &[String]) -> Vec<&str> {
        let mut all: Vec<&str> = vec!["localhost", "127.0.0.1", "::1"];
        for n in names {
            if !n.is_empty() && !all.contains(&n.as_str()) {
                all.push(n);
            }
        }
        all
    }

    /// The development token: `given` (stored for clients to find), the stored one, or a new
    /// random one.
    pub fn dev_token(&self, given: Option<&str>) -> Result<String, String> {
        std::fs::create_dir_all(&self.root).map_err(|e| format!("{}: {e}", self.root.display()))?;
        if let Some(t) = given {
            write_private(&self.token(), t.as_bytes())?;
            return Ok(t.to_owned());
        }
        if let Ok(t) = std::fs::read_to_string(self.token()) {
            let t = t.trim().to_owned();
            if !t.is_empty() {
                return Ok(t);
            }
        }
        let t = random_token()?;
        write_private(&self.token(), t.as_bytes())?;
        Ok(t)
    }
}

fn write_private(path: &Path, data: &[u8]) -> Result<(), String> {
    use std::io::Write;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts.open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    f.write_all(data).map_err(|e| format!("{}: {e}", path.display()))
}

fn random_token() -> Result<String, String> {
    let mut buf = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .map_err(|e| format!("reading /dev/urandom: {e}"))?;
    Ok(format!("dev-{}", buf.iter().map(|b| format!("{b:02x}")).collect::<String>()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A broker given the cluster CA replaces its self-signed certificate once (keeping the
    /// old one), then keeps the issued one across restarts; another CA issues afresh.
    #[test]
    fn a_broker_takes_a_certificate_from_the_cluster_ca_once() {
        let dir = tempfile::tempdir().unwrap();
        let d = DataDir::new(dir.path());
        let (own, made) = d.identity_for(&[]).unwrap();
        assert!(made);
        let ca = CertAuthority::new("cluster").unwrap();
        let (issued, made) = d.identity_from_ca(&ca, &["10.0.0.5".into()]).unwrap();
        assert!(made, "the self-signed certificate is replaced");
        assert_eq!(issued.chain[1], ca.cert());
        assert_ne!(issued.chain[0], own.chain[0]);
        assert!(dir.path().join("tls/cert.pem.replaced").exists() && dir.path().join("tls/key.pem.replaced").exists());
        let (again, made) = d.identity_from_ca(&ca, &[]).unwrap();
        assert!(!made, "a restart keeps it");
        assert_eq!(again.chain, issued.chain);
        let names = crate::tls::cert_names(&issued.chain[0]);
        assert!(names.iter().any(|n| n == "localhost"), "{names:?}");
        let (by_other, made) = d.identity_from_ca(&CertAuthority::new("other").unwrap(), &[]).unwrap();
        assert!(made && by_other.chain[0] != issued.chain[0], "another CA issues its own");
    }
}
