//! Stored responses of OpenAI's Responses API: what `previous_response_id` continues and
//! `GET`/`DELETE /v1/responses/{id}` reach. One JSON file per response under the state
//! directory, in a directory per user (`responses/UID/resp_….json`, the daemon's alone: mode
//! 0700), so a user reaches only their own; at most [`PER_USER`] responses and [`BYTES_PER_USER`]
//! bytes per user, the oldest going first. Files are written whole under a temporary name and renamed into place, so a crash
//! leaves the old set or the new one.

use std::path::{Path, PathBuf};

/// The responses kept per user.
pub const PER_USER: usize = 1000;

/// The bytes of responses kept per user (a conversation's record grows with each turn).
pub const BYTES_PER_USER: u64 = 256 << 20;

/// The store: its directory, and one writer at a time (the bound's count and its evictions).
#[derive(Debug)]
pub struct Responses {
    dir: PathBuf,
    writing: tokio::sync::Mutex<()>,
}

/// Whether `id` is one this store gives out: `resp_` and 32 hexadecimal digits (nothing else
/// reaches a path).
pub fn valid_id(id: &str) -> bool {
    id.strip_prefix("resp_").is_some_and(|h| h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// A new response id: `resp_` and 32 hexadecimal digits from the process's random hash keys.
pub fn new_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let state = std::collections::hash_map::RandomState::new();
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let half = |salt: u64| {
        let mut h = state.build_hasher();
        h.write_u128(t);
        h.write_u64(salt);
        h.finish()
    };
    format!("resp_{:016x}{:016x}", half(1), half(2))
}

impl Responses {
    pub fn new(dir: PathBuf) -> Responses {
        Responses { dir, writing: tokio::sync::Mutex::new(()) }
    }

    fn user_dir(&self, uid: u32) -> PathBuf {
        self.dir.join(uid.to_string())
    }

    fn path(&self, uid: u32, id: &str) -> Option<PathBuf> {
        valid_id(id).then(|| self.user_dir(uid).join(format!("{id}.json")))
    }

    /// Keeps `record` as user `uid`'s response `id`, dropping the user's oldest beyond
    /// [`PER_USER`].
    pub async fn put(&self, uid: u32, id: &str, record: &serde_json::Value) -> std::io::Result<()> {
        let Some(path) = self.path(uid, id) else {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a response id"));
        };
        let _one = self.writing.lock().await;
        let (dir, bytes) = (self.user_dir(uid), record.to_string().into_bytes());
        tokio::task::spawn_blocking(move || {
            make_private_dir(&dir)?;
            let tmp = dir.join(format!(".{}.tmp", std::process::id()));
            std::fs::write(&tmp, bytes)?;
            std::fs::rename(&tmp, &path)?;
            evict(&dir, PER_USER, BYTES_PER_USER)
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())))
    }

    /// User `uid`'s response `id`, if it is kept.
    pub async fn get(&self, uid: u32, id: &str) -> Option<serde_json::Value> {
        let path = self.path(uid, id)?;
        let bytes = tokio::fs::read(path).await.ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Removes user `uid`'s response `id`: whether it was kept.
    pub async fn delete(&self, uid: u32, id: &str) -> bool {
        let Some(path) = self.path(uid, id) else { return false };
        let _one = self.writing.lock().await;
        tokio::fs::remove_file(path).await.is_ok()
    }
}

/// Creates `dir` (and its parents) readable by the daemon alone.
fn make_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// Removes the oldest responses of `dir` beyond `keep` of them or `bytes` in all.
fn evict(dir: &Path, keep: usize, bytes: u64) -> std::io::Result<()> {
    let mut files: Vec<(std::time::SystemTime, String, PathBuf, u64)> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with("resp_") && n.ends_with(".json")))
        .filter_map(|e| {
            let meta = e.metadata().ok()?;
            Some((meta.modified().ok()?, e.file_name().to_string_lossy().into_owned(), e.path(), meta.len()))
        })
        .collect();
    files.sort();
    let mut total: u64 = files.iter().map(|f| f.3).sum();
    let mut left = files.len();
    for (_, _, path, len) in &files {
        // The newest always stays: it was just written for an answer.
        if (left <= keep && total <= bytes) || left == 1 {
            break;
        }
        let _ = std::fs::remove_file(path);
        total -= len;
        left -= 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked_before_they_reach_a_path() {
        let id = new_id();
        assert!(valid_id(&id), "{id}");
        assert_ne!(new_id(), id);
        for bad in [
            "resp_../../etc/passwd",
            "resp_",
            "msg_0123456789abcdef0123456789abcdef",
            "resp_0123456789abcdef0123456789abcdeg",
        ] {
            assert!(!valid_id(bad), "{bad}");
        }
    }

    #[test]
    fn each_user_keeps_their_own_and_the_oldest_go_first() {
        let dir = std::env::temp_dir().join(format!("inferd-stored-{}", std::process::id()));
        let store = Responses::new(dir.clone());
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let a = new_id();
            store.put(1000, &a, &serde_json::json!({ "n": 1 })).await.unwrap();
            assert_eq!(store.get(1000, &a).await, Some(serde_json::json!({ "n": 1 })));
            assert_eq!(store.get(1001, &a).await, None, "another user's response is not theirs");
            assert!(!store.delete(1001, &a).await);
            let mode =
                std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(dir.join("1000")).unwrap().permissions());
            assert_eq!(mode & 0o777, 0o700);
            assert!(store.delete(1000, &a).await);
            assert_eq!(store.get(1000, &a).await, None);
        });
        for i in 0..5 {
            let p = dir.join("1000").join(format!("resp_{i:032x}.json"));
            std::fs::write(&p, "{}").unwrap();
            let t = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000 + i);
            std::fs::File::options().write(true).open(&p).unwrap().set_modified(t).unwrap();
        }
        let left = || {
            let mut l: Vec<String> = std::fs::read_dir(dir.join("1000"))
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            l.sort();
            l
        };
        evict(&dir.join("1000"), 3, u64::MAX).unwrap();
        assert_eq!(left(), (2..5).map(|i| format!("resp_{i:032x}.json")).collect::<Vec<_>>());
        // A budget of one file's bytes: the oldest go, the newest stays.
        evict(&dir.join("1000"), 3, 2).unwrap();
        assert_eq!(left(), [format!("resp_{:032x}.json", 4)]);
        let _ = std::fs::remove_dir_all(dir);
    }
}
