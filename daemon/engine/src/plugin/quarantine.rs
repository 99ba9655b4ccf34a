//! Libraries quarantined across restarts: a plugin that crashed or hung the daemon, or its own
//! helper process, is not loaded again until its file changes or an administrator lets it back.
//!
//! The list is a text file in the daemon's state directory, one library per line:
//! `path<TAB>size<TAB>mtime<TAB>since<TAB>reason`, where `size` and `mtime` (nanoseconds) identify
//! the file that misbehaved: installing another version lifts the quarantine by itself, and
//! deleting the line lifts it by hand. Writes replace the file atomically.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

#[derive(Clone, Debug, PartialEq)]
struct Entry {
    path: PathBuf,
    size: u64,
    mtime: i64,
    /// Seconds since the epoch.
    since: u64,
    reason: String,
}

/// The quarantine list and the file it is kept in.
#[derive(Debug)]
pub struct Quarantine {
    file: PathBuf,
    entries: Mutex<Vec<Entry>>,
}

/// A file's identity for the list: its size and modification time (nanoseconds).
fn identity(path: &Path) -> Option<(u64, i64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path)
        .ok()
        .map(|m| (m.size(), m.mtime().saturating_mul(1_000_000_000).saturating_add(m.mtime_nsec())))
}

fn parse(text: &str) -> Vec<Entry> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.splitn(5, '\t');
            Some(Entry {
                path: PathBuf::from(f.next()?),
                size: f.next()?.parse().ok()?,
                mtime: f.next()?.parse().ok()?,
                since: f.next()?.parse().ok()?,
                reason: f.next()?.to_owned(),
            })
        })
        .collect()
}

impl Quarantine {
    /// The list kept in `file` (empty when the file does not exist yet).
    pub fn open(file: &Path) -> Quarantine {
        let entries = std::fs::read_to_string(file).map(|t| parse(&t)).unwrap_or_default();
        Quarantine { file: file.to_owned(), entries: Mutex::new(entries) }
    }

    pub fn file(&self) -> &Path {
        &self.file
    }

    /// Why `path` may not be loaded, when it is quarantined (and has not changed since).
    pub fn check(&self, path: &Path) -> Option<String> {
        let id = identity(path)?;
        let entries = self.entries.lock().ok()?;
        let e = entries.iter().find(|e| e.path == path && (e.size, e.mtime) == id)?;
        Some(format!(
            "quarantined since {} UTC: {}; install another version of the file, or delete its line from {}, to load it again",
            crate::time::utc(e.since as i64),
            e.reason,
            self.file.display()
        ))
    }

    /// Quarantines `path` for `reason`, on disk at once.
    pub fn add(&self, path: &Path, reason: &str) -> std::io::Result<()> {
        let Some((size, mtime)) = identity(path) else { return Ok(()) };
        let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let reason = reason.replace(['\t', '\n'], " ");
        let mut entries = self.entries.lock().map_err(|_| std::io::Error::other("quarantine list poisoned"))?;
        entries.retain(|e| e.path != path);
        entries.push(Entry { path: path.to_owned(), size, mtime, since, reason });
        let text: String = entries
            .iter()
            .map(|e| format!("{}\t{}\t{}\t{}\t{}\n", e.path.display(), e.size, e.mtime, e.since, e.reason))
            .collect();
        if let Some(d) = self.file.parent() {
            std::fs::create_dir_all(d)?;
        }
        let tmp = self.file.with_extension("new");
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, &self.file)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quarantine_outlives_the_process_and_ends_with_a_new_file() {
        let dir = std::env::temp_dir().join(format!("inferd-quarantine-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let lib = dir.join("libx.so");
        std::fs::write(&lib, b"one").unwrap();
        let list = dir.join("state/plugin-quarantine");
        let q = Quarantine::open(&list);
        assert_eq!(q.check(&lib), None);
        q.add(&lib, "its helper died of\tSIGSEGV").unwrap();
        // Read back by another process's view of the file.
        let why = Quarantine::open(&list).check(&lib).expect("quarantined");
        assert!(why.contains("its helper died of SIGSEGV") && why.contains("plugin-quarantine"), "{why}");
        // Another version of the file is not the one that misbehaved.
        std::fs::write(&lib, b"version two").unwrap();
        assert_eq!(Quarantine::open(&list).check(&lib), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
