//! `felix-node token keygen|mint`: signing keys and signed tokens (JWT, EdDSA) for brokers that
//! trust a JWK set (`serve --jwks`), so operators and tests can mint tokens without another
//! service.

use clap::{Args, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct TokenArgs {
    #[command(subcommand)]
    op: TokenOp,
}

#[derive(Subcommand, Debug)]
enum TokenOp {
    /// Make an Ed25519 signing key (DIR/signing-key.pk8, readable by its owner only) and the
    /// JWK set brokers trust it by (DIR/jwks.json, for `serve --jwks`).
    Keygen {
        /// Where to write both files.
        #[arg(long, default_value = ".")]
        out: PathBuf,
        /// The key id tokens name in their header.
        #[arg(long, default_value = "k1")]
        kid: String,
    },
    /// Print a token signed with a key from `keygen`.
    Mint {
        /// The signing key (signing-key.pk8).
        #[arg(long)]
        key: PathBuf,
        /// Its key id.
        #[arg(long, default_value = "k1")]
        kid: String,
        /// The tenant the token is for.
        #[arg(long)]
        tenant: String,
        /// The principal (recorded as the publisher) [default: the tenant].
        #[arg(long)]
        sub: Option<String>,
        /// A permission, ACTION:OBJECT (repeat): stream.publish:stream:T/NS/STREAM,
        /// stream.subscribe:.., cache.read:cache:T/NS/CACHE, cache.write:.., group.consume:..,
        /// group.manage:.., stream.admin:.., ns.manage:namespace:T/NS, tenant.manage:tenant:T,
        /// node.view:cluster:*; `*` matches one whole segment.
        #[arg(long = "perm", required = true)]
        perms: Vec<String>,
        /// How long it is valid (e.g. 15m, 1h).
        #[arg(long, value_parser = crate::commands::parse_duration, default_value = "1h")]
        ttl: std::time::Duration,
        /// A token id (to revoke it by).
        #[arg(long)]
        jti: Option<String>,
        /// Issuer.
        #[arg(long, default_value = "felix-auth")]
        issuer: String,
        /// Audience.
        #[arg(long, default_value = "felix-broker")]
        audience: String,
    },
}

pub fn run(a: TokenArgs) -> Result<ExitCode, String> {
    match a.op {
        TokenOp::Keygen { out, kid } => {
            let rng = ring::rand::SystemRandom::new();
            let pkcs8 = ring::signature::Ed25519KeyPair::generate_pkcs8(&rng).map_err(|e| format!("keygen: {e}"))?;
            let public = felix_proto::jwt::public_key(pkcs8.as_ref()).map_err(|e| e.to_string())?;
            std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
            let key_path = out.join("signing-key.pk8");
            let mut opts = std::fs::OpenOptions::new();
            opts.write(true).create_new(true);
            #[cfg(unix)]
            {
                use std::os::unix::fs::OpenOptionsExt;
                opts.mode(0o600);
            }
            let mut f = opts.open(&key_path).map_err(|e| format!("{}: {e} (not overwritten)", key_path.display()))?;
            std::io::Write::write_all(&mut f, pkcs8.as_ref()).map_err(|e| format!("{}: {e}", key_path.display()))?;
            let jwks_path = out.join("jwks.json");
            let jwks = felix_proto::jwt::Jwks::single(&kid, &public).to_json();
            std::fs::write(&jwks_path, format!("{jwks}\n")).map_err(|e| format!("{}: {e}", jwks_path.display()))?;
            eprintln!("signing key  {}  (keep it secret)", key_path.display());
            eprintln!("JWK set      {}  (give it to brokers: serve --jwks)", jwks_path.display());
            Ok(ExitCode::SUCCESS)
        }
        TokenOp::Mint { key, kid, tenant, sub, perms, ttl, jti, issuer, audience } => {
            let pkcs8 = std::fs::read(&key).map_err(|e| format!("{}: {e}", key.display()))?;
            for p in &perms {
                felix_proto::jwt::Perm::parse(p).map_err(|e| format!("--perm: {e}"))?;
            }
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_err(|e| e.to_string())?
                .as_secs();
            let claims = felix_proto::jwt::Claims {
                iss: issuer,
                aud: audience,
                sub: sub.unwrap_or_else(|| tenant.clone()),
                tid: tenant,
                exp: now + ttl.as_secs().max(1),
                iat: now,
                nbf: None,
                jti,
                perms,
            };
            let token = felix_proto::jwt::mint(&pkcs8, &kid, &claims).map_err(|e| format!("{}: {e}", key.display()))?;
            println!("{token}");
            Ok(ExitCode::SUCCESS)
        }
    }
}
