//! TLS on the service's listeners, the KV-cache service's and the metrics endpoint's
//! (rustls with ring): the certificate chain and key from PEM files, and, when given, the
//! CAs whose certificates clients must present (mutual TLS); and a KV-cache service's
//! connections to other servers (`peer_config`). KV-cache blocks derive from
//! users' prompts, and a scrape tells what a DPU carries: on a network others share,
//! neither should cross it in the clear.

use crate::ir::TlsFiles;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

/// Why the TLS configuration cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// a PEM file cannot be read, or holds none of what it should
    #[error("{}: {what}", path.display())]
    File { path: PathBuf, what: String },
    /// rustls refuses the client CAs or the protocol versions
    #[error("{0}")]
    Rustls(#[from] rustls::Error),
    /// the key is not the certificate's, or either is unusable
    #[error("{} with {}: {source}", cert.display(), key.display())]
    KeyPair {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
    /// the client CAs make no verifier
    #[error("tls_client_ca: {0}")]
    ClientCa(#[from] rustls::server::VerifierBuilderError),
}

/// The certificates in a PEM file, at least one.
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bad = |what: String| TlsError::File {
        path: path.to_owned(),
        what,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no PEM certificate in it".into()));
    }
    Ok(certs)
}

/// The private key of `files`.
fn private_key(files: &TlsFiles) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(&files.key).map_err(|e| TlsError::File {
        path: files.key.clone(),
        what: e.to_string(),
    })
}

/// The CA certificates in a PEM file, as the roots a peer's certificate must chain to.
fn roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for ca in certificates(path)? {
        roots.add(ca)?;
    }
    Ok(roots)
}

/// Why `files`' certificate and key make no configuration.
fn key_pair(files: &TlsFiles) -> impl FnOnce(rustls::Error) -> TlsError + '_ {
    |source| TlsError::KeyPair {
        cert: files.cert.clone(),
        key: files.key.clone(),
        source,
    }
}

/// ring, which rustls now marks as lacking post-quantum key exchange (its aws-lc-rs has
/// X25519MLKEM768): ring builds for the DPU's Arm cores with nothing but the cross
/// linker, where aws-lc-rs compiles a C library for them. Key exchange is X25519 or the
/// NIST curves.
#[allow(deprecated)]
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The server configuration `files` describe: TLS 1.2 and 1.3 with rustls's safe
/// defaults.
pub fn server_config(files: &TlsFiles) -> Result<Arc<ServerConfig>, TlsError> {
    let certs = certificates(&files.cert)?;
    let key = private_key(files)?;
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()?;
    let builder = match &files.client_ca {
        Some(path) => {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots(path)?), provider)
                    .build()?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let config = builder
        .with_single_cert(certs, key)
        .map_err(key_pair(files))?;
    Ok(Arc::new(config))
}

/// The configuration a KV-cache service connects to another server with (a node of its
/// cluster it hands keys to, the target of `MIGRATE`), from its own `files`: it trusts
/// the CAs of `tls_client_ca`, which sign every node's certificate in a cluster whose
/// nodes authenticate each other, and presents its own certificate as a client's. `None`
/// without `tls_client_ca`: nothing to verify the other server with.
fn peer_config(files: &TlsFiles) -> Result<Option<Arc<ClientConfig>>, TlsError> {
    let Some(ca) = &files.client_ca else {
        return Ok(None);
    };
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots(ca)?)
        .with_client_auth_cert(certificates(&files.cert)?, private_key(files)?)
        .map_err(key_pair(files))?;
    Ok(Some(Arc::new(config)))
}

/// A listener's TLS configuration, made again from its files when asked (on SIGHUP), so
/// that certificates are rotated without a restart; each connection takes the one current
/// when it arrives. A KV-cache service's also holds the configuration it connects to
/// other servers with (`peer_config`), rotated with it.
#[derive(Debug)]
pub struct Rotating {
    files: TlsFiles,
    /// Whether connections out are made too.
    peers: bool,
    current: Mutex<Configs>,
}

/// The configurations a [`Rotating`] hands out.
#[derive(Debug)]
struct Configs {
    server: Arc<ServerConfig>,
    peer: Option<Arc<ClientConfig>>,
}

impl Rotating {
    /// The configuration `files` describe now, and when `peers`, the one connections
    /// out take (`peer_config`).
    pub fn new(files: &TlsFiles, peers: bool) -> Result<Rotating, TlsError> {
        Ok(Rotating {
            files: files.clone(),
            peers,
            current: Mutex::new(configs(files, peers)?),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Configs> {
        self.current.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The configuration for a connection arriving now.
    pub fn current(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.lock().server)
    }

    /// The configuration for a connection made now to another server; `None` where
    /// there is no `tls_client_ca` to verify it with (or connections out were not asked).
    pub fn peer(&self) -> Option<Arc<ClientConfig>> {
        self.lock().peer.clone()
    }

    /// Reads the files again; when they no longer make a configuration, the one before
    /// stays and the error says why.
    pub fn reread(&self) -> Result<(), TlsError> {
        let fresh = configs(&self.files, self.peers)?;
        *self.lock() = fresh;
        Ok(())
    }
}

fn configs(files: &TlsFiles, peers: bool) -> Result<Configs, TlsError> {
    Ok(Configs {
        server: server_config(files)?,
        peer: if peers { peer_config(files)? } else { None },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_or_empty_files_say_which() {
        let dir = std::env::temp_dir().join(format!("dpuflow-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "not PEM\n").unwrap();
        let files = |cert: &Path| TlsFiles {
            cert: cert.to_owned(),
            key: dir.join("key.pem"),
            client_ca: None,
        };
        let e = server_config(&files(&dir.join("absent.pem"))).unwrap_err();
        assert!(e.to_string().contains("absent.pem"), "{e}");
        let e = server_config(&files(&empty)).unwrap_err();
        assert!(e.to_string().contains("no PEM certificate"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
