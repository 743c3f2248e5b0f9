//! Basic authentication (RFC 7617) on the metrics endpoint: the users and their bcrypt
//! hashes come from an htpasswd file (`htpasswd -B`), what Prometheus's `basic_auth`
//! with a `password_file` sends is checked against them. Only bcrypt: the file's other
//! formats (MD5, SHA-1, crypt) are refused when it is read, as their hashes are cheap to
//! guess from.

use base64::Engine;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

/// Why the users' file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum UsersError {
    /// the file cannot be read
    #[error("{}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// a line is not `user:bcrypt-hash`
    #[error("{}:{line}: {what}", path.display())]
    Line {
        path: PathBuf,
        line: usize,
        what: String,
    },
    /// the file names no user
    #[error("{}: no user in it", path.display())]
    Empty { path: PathBuf },
}

/// One reading of the file.
#[derive(Debug)]
struct Table {
    /// By user: the bcrypt hash of their password.
    hashes: HashMap<String, String>,
    /// By user: the password their hash last accepted. bcrypt is slow on purpose (a few
    /// milliseconds at `htpasswd -B`'s cost, far more at higher ones); a scraper sends
    /// the same credentials every few seconds, and pays for the check once.
    accepted: Mutex<HashMap<String, Vec<u8>>>,
}

impl Table {
    fn read(path: &Path) -> Result<Table, UsersError> {
        let text = std::fs::read_to_string(path).map_err(|source| UsersError::Read {
            path: path.to_owned(),
            source,
        })?;
        Table::parse(&text, path)
    }

    /// The users of `text`, the file at `path`.
    fn parse(text: &str, path: &Path) -> Result<Table, UsersError> {
        let mut hashes = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let bad = |what: String| UsersError::Line {
                path: path.to_owned(),
                line: i + 1,
                what,
            };
            let Some((user, hash)) = line.split_once(':') else {
                return Err(bad("not `user:hash`".into()));
            };
            if !is_bcrypt(hash) {
                return Err(bad(format!(
                    "`{user}`'s hash is not bcrypt (make the file with `htpasswd -B`)"
                )));
            }
            if hashes.insert(user.to_owned(), hash.to_owned()).is_some() {
                return Err(bad(format!("`{user}` again")));
            }
        }
        if hashes.is_empty() {
            return Err(UsersError::Empty {
                path: path.to_owned(),
            });
        }
        Ok(Table {
            hashes,
            accepted: Mutex::new(HashMap::new()),
        })
    }

    fn admits(&self, user: &str, password: &[u8]) -> bool {
        let Some(hash) = self.hashes.get(user) else {
            return false;
        };
        // Held through the check: checks run one at a time, so a flood of wrong
        // passwords costs the endpoint one core at most, not one for each of its
        // connections.
        let mut accepted = self.accepted.lock().unwrap_or_else(PoisonError::into_inner);
        if accepted.get(user).is_some_and(|p| same(p, password)) {
            return true;
        }
        let ok = bcrypt::verify(password, hash).unwrap_or(false);
        if ok {
            accepted.insert(user.to_owned(), password.to_owned());
        }
        ok
    }
}

/// `$2a$`, `$2b$` or `$2y$`, a two-digit cost, `$`, then 53 characters of salt and hash.
fn is_bcrypt(hash: &str) -> bool {
    let b = hash.as_bytes();
    b.len() == 60
        && ["$2a$", "$2b$", "$2y$"].iter().any(|p| hash.starts_with(p))
        && b[4].is_ascii_digit()
        && b[5].is_ascii_digit()
        && b[6] == b'$'
}

/// Equal, in a time that does not tell how much of `a` matched.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |d, (x, y)| d | (x ^ y)) == 0
}

/// The user and password an `Authorization` header's value carries, if it is Basic's
/// (RFC 7617 §2: the scheme in any case, then base64 of `user:password`, the user's name
/// without a colon).
fn credentials(authorization: &str) -> Option<(String, Vec<u8>)> {
    let (scheme, encoded) = authorization.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let colon = decoded.iter().position(|&b| b == b':')?;
    let user = String::from_utf8(decoded[..colon].to_vec()).ok()?;
    Some((user, decoded[colon + 1..].to_vec()))
}

/// The users the metrics endpoint admits, read from their file at the start and again
/// on SIGHUP.
#[derive(Debug)]
pub struct Users {
    path: PathBuf,
    table: Mutex<Arc<Table>>,
}

impl Users {
    pub fn read(path: &Path) -> Result<Users, UsersError> {
        Ok(Users {
            path: path.to_owned(),
            table: Mutex::new(Arc::new(Table::read(path)?)),
        })
    }

    /// Reads the file again; where it can no longer be used, the users read before stay.
    pub fn reread(&self) -> Result<(), UsersError> {
        let table = Arc::new(Table::read(&self.path)?);
        *self.table.lock().unwrap_or_else(PoisonError::into_inner) = table;
        Ok(())
    }

    /// Whether a request's `Authorization` header (its value) names one of the users
    /// with their password.
    pub fn admit(&self, authorization: Option<&str>) -> bool {
        let Some((user, password)) = authorization.and_then(credentials) else {
            return false;
        };
        let table = Arc::clone(&self.table.lock().unwrap_or_else(PoisonError::into_inner));
        table.admits(&user, &password)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(user: &str, password: &str) -> String {
        let plain = format!("{user}:{password}");
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(plain)
        )
    }

    fn file(name: &str, text: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!("dpuflow-{name}-{}", std::process::id()));
        std::fs::write(&path, text).expect("write");
        path
    }

    #[test]
    fn users_with_their_passwords_are_admitted_and_no_one_else() {
        let hash = bcrypt::hash("s3cret", 4).expect("hash");
        let other = bcrypt::hash("pw:with:colons", 4).expect("hash");
        let path = file(
            "users",
            &format!("# scrapers\nprometheus:{hash}\n\nbackup:{other}\n"),
        );
        let users = Users::read(&path).expect("read");
        assert!(users.admit(Some(&header("prometheus", "s3cret"))));
        // Again, from what the first check kept.
        assert!(users.admit(Some(&header("prometheus", "s3cret"))));
        assert!(users.admit(Some(&header("backup", "pw:with:colons"))));
        let lower = header("prometheus", "s3cret").replace("Basic", "basic");
        assert!(users.admit(Some(&lower)));
        for refused in [
            header("prometheus", "s3cre"),
            header("prometheus", "s3cret "),
            header("backup", "s3cret"),
            header("nobody", "s3cret"),
            "Bearer s3cret".into(),
            "Basic !!!".into(),
            "Basic".into(),
        ] {
            assert!(!users.admit(Some(&refused)), "{refused}");
        }
        assert!(!users.admit(None));

        // Read again: the new file's users only, and nothing kept from before.
        let hash = bcrypt::hash("rotated", 4).expect("hash");
        std::fs::write(&path, format!("prometheus:{hash}\n")).expect("rewrite");
        users.reread().expect("reread");
        assert!(!users.admit(Some(&header("prometheus", "s3cret"))));
        assert!(users.admit(Some(&header("prometheus", "rotated"))));
        // A file spoilt since: the users before stay.
        std::fs::write(&path, "prometheus:plain\n").expect("spoil");
        assert!(users.reread().is_err());
        assert!(users.admit(Some(&header("prometheus", "rotated"))));
        std::fs::remove_file(&path).ok();
    }

    #[test]
    fn files_not_of_bcrypt_hashes_are_refused() {
        let h = bcrypt::hash("x", 4).expect("hash");
        for (name, text, says) in [
            (
                "md5",
                "u:$apr1$abc$def\n".to_owned(),
                ":1: `u`'s hash is not bcrypt",
            ),
            (
                "sha",
                format!("a:{h}\nb:{{SHA}}x\n"),
                ":2: `b`'s hash is not bcrypt",
            ),
            ("nocolon", "justaname\n".to_owned(), ":1: not `user:hash`"),
            ("twice", format!("a:{h}\na:{h}\n"), ":2: `a` again"),
            ("empty", "# none yet\n".to_owned(), "no user in it"),
        ] {
            let path = file(name, &text);
            let e = Users::read(&path).expect_err(name).to_string();
            assert!(e.contains(says), "{name}: {e}");
            std::fs::remove_file(&path).ok();
        }
    }

    proptest::proptest! {
        /// Any `Authorization` value is judged without a panic, and a Basic one carries
        /// back the user and password it was made of (a password may hold colons and any
        /// bytes; a user's name no colon).
        #[test]
        fn credentials_read_back_what_was_encoded(
            user in "[^:]{0,20}",
            password in proptest::collection::vec(proptest::num::u8::ANY, 0..40),
            other in ".{0,80}",
        ) {
            let _ = credentials(&other);
            let mut plain = user.clone().into_bytes();
            plain.push(b':');
            plain.extend_from_slice(&password);
            let encoded = base64::engine::general_purpose::STANDARD.encode(&plain);
            let read = credentials(&format!("Basic {encoded}"));
            proptest::prop_assert_eq!(read, Some((user, password)));
        }

        /// Any file's text is read or refused without a panic.
        #[test]
        fn any_users_file_is_read_or_refused(text in "(.{0,70}\n){0,6}") {
            let _ = Table::parse(&text, Path::new("users"));
        }
    }
}
