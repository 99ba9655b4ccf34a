//! The model store: the directory whose models a daemon lists and loads on use without a
//! `[[model]]` entry: `$XDG_DATA_HOME/inferd/models` for a user's daemon,
//! `/var/lib/inferd/models` for the system's (`server.model_store` names another). Every
//! `*.gguf` file in it is a model, and so is every directory holding a Hugging Face model
//! (`config.json` beside `*.safetensors`); a model's name is its file name without `.gguf`.
//! A file with `mmproj` in its name is a vision projector, not a model: `NAME.mmproj.gguf` (as
//! `inferctl pull` installs one) or `mmproj-NAME.gguf` pairs with `NAME.gguf`, whose requests
//! may then hold images. Transfers under way (`*.partial`, `inferctl pull`) and anything else
//! are not models.

use std::path::{Path, PathBuf};

/// The name requests use for the model at `path` (when its entry gives none).
pub fn model_name(path: &Path) -> String {
    let file = path.file_name().and_then(|s| s.to_str()).unwrap_or("model");
    file.strip_suffix(".gguf").unwrap_or(file).to_string()
}

/// Whether a transfer's whole file `path` reads as a model (its GGUF header, within the
/// reader's budgets), or, named as a projector, as a vision projector (every tensor its
/// encoder needs, mapped): checked before it is installed; `Err` says why not.
pub fn readable(path: &Path) -> Result<(), String> {
    if is_projector(path) {
        return inferd_engine::vision::VisionEncoder::load(path)
            .map(drop)
            .map_err(|e| format!("not a vision projector inferd reads: {e}"));
    }
    inferd_engine::model::facts::Facts::read(path).map(drop).map_err(|e| format!("not a model inferd reads: {e}"))
}

/// Whether the file at `path` is named as a vision projector ([`inferctl::pull::is_projector`]).
pub fn is_projector(path: &Path) -> bool {
    path.file_name().and_then(|s| s.to_str()).is_some_and(inferctl::pull::is_projector)
}

/// The projector the store pairs with the model file `path`: `NAME.mmproj.gguf` or
/// `mmproj-NAME.gguf` beside `NAME.gguf`.
pub fn projector_of(path: &Path) -> Option<PathBuf> {
    if path.is_dir() {
        return None;
    }
    let (dir, name) = (path.parent()?, model_name(path));
    [format!("{name}.mmproj.gguf"), format!("mmproj-{name}.gguf")]
        .into_iter()
        .map(|f| dir.join(f))
        .find(|p| p.is_file())
}

/// Whether `path` is a model the store serves.
fn is_model(path: &Path) -> bool {
    if path.is_dir() {
        return path.join("config.json").is_file()
            && std::fs::read_dir(path).is_ok_and(|d| {
                d.flatten().any(|e| e.path().extension().and_then(|x| x.to_str()) == Some("safetensors"))
            });
    }
    path.extension().and_then(|x| x.to_str()) == Some("gguf") && path.is_file() && !is_projector(path)
}

/// The models in `dir`, by name (none when it does not exist).
pub fn scan(dir: &Path) -> Vec<(String, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut found: Vec<(String, PathBuf)> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| !model_name(p).starts_with('.') && is_model(p))
        .map(|p| (model_name(&p), p))
        .collect();
    found.sort();
    found
}

/// Makes the store the daemon's own before it serves it: created if missing, and writable by
/// its owner alone (a store other users could write would let them plant files or links that
/// another user's transfer writes through), with transfers an earlier run left removed. A
/// store owned by someone else is used as it is, with a warning when others may write it.
pub fn prepare(dir: &Path) {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if let Err(e) = std::fs::create_dir_all(dir) {
        eprintln!("inferd: creating the model store {}: {e}", dir.display());
        return;
    }
    let Ok(meta) = std::fs::metadata(dir) else { return };
    let mode = meta.mode() & 0o7777;
    if mode & 0o2022 != 0 {
        if Some(meta.uid()) == super::config::effective_uid() {
            let fixed = mode & !0o2022;
            match std::fs::set_permissions(dir, std::fs::Permissions::from_mode(fixed)) {
                Ok(()) => eprintln!(
                    "inferd: the model store {} was writable by others ({mode:04o}); now {fixed:04o}: models are installed through the daemon (inferctl pull)",
                    dir.display()
                ),
                Err(e) => eprintln!("inferd: restricting the model store {}: {e}", dir.display()),
            }
        } else {
            eprintln!(
                "inferd: warning: the model store {} ({mode:04o}) is not the daemon's and others may write it",
                dir.display()
            );
        }
    }
    super::upload::clean(dir);
}

/// Deletes a store model's file or directory.
pub fn remove(path: &Path) -> std::io::Result<()> {
    if path.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    }
}

/// The files holding a model's weights: the GGUF file, or a directory's `*.safetensors`.
fn weight_files(path: &Path) -> Vec<PathBuf> {
    match std::fs::read_dir(path) {
        Ok(d) if path.is_dir() => {
            let mut v: Vec<PathBuf> = d
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().and_then(|x| x.to_str()) == Some("safetensors"))
                .collect();
            v.sort();
            v
        }
        _ => vec![path.to_path_buf()],
    }
}

/// Reads the weights of the models at `paths` once through the page cache, calling
/// `progress(done, total)` in bytes as it goes: a model on a cold disk loads at the disk's
/// speed here, where its progress can be shown, instead of in the first forward pass's page
/// faults. Unreadable files are left for the loader to report.
pub fn read_ahead(paths: &[&Path], progress: &dyn Fn(u64, u64)) {
    use std::io::Read;
    let files: Vec<PathBuf> = paths.iter().flat_map(|p| weight_files(p)).collect();
    let total: u64 = files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum();
    let mut done = 0u64;
    let mut buf = vec![0u8; 8 << 20];
    progress(0, total);
    for f in files {
        let Ok(mut file) = std::fs::File::open(&f) else { continue };
        while let Ok(n) = file.read(&mut buf) {
            if n == 0 {
                break;
            }
            done += n as u64;
            progress(done.min(total), total);
        }
    }
}

/// The store of a daemon in `mode` when the config names none.
pub fn default_dir(mode: super::config::Mode) -> PathBuf {
    match mode {
        super::config::Mode::System => PathBuf::from("/var/lib/inferd/models"),
        super::config::Mode::User => inferctl::pull::user_store(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_lists_gguf_files_and_model_directories_only() {
        let dir = std::env::temp_dir().join(format!("inferd-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("Qwen2.5-0.5B")).unwrap();
        std::fs::write(dir.join("Qwen2.5-0.5B/config.json"), "{}").unwrap();
        std::fs::write(dir.join("Qwen2.5-0.5B/model.safetensors"), "").unwrap();
        std::fs::create_dir_all(dir.join("empty-dir")).unwrap();
        for f in ["b.Q4_K_M.gguf", "a.gguf", "c.gguf.partial", "notes.txt", ".hidden.gguf", "a.mmproj.gguf"] {
            std::fs::write(dir.join(f), "").unwrap();
        }
        std::fs::write(dir.join("mmproj-b.Q4_K_M.gguf"), "").unwrap();
        std::fs::write(dir.join("mmproj-other-f16.gguf"), "").unwrap();
        let names: Vec<String> = scan(&dir).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["Qwen2.5-0.5B", "a", "b.Q4_K_M"], "projectors are no models");
        // Each model's own projector, by either name; none for a directory.
        assert_eq!(projector_of(&dir.join("a.gguf")), Some(dir.join("a.mmproj.gguf")));
        assert_eq!(projector_of(&dir.join("b.Q4_K_M.gguf")), Some(dir.join("mmproj-b.Q4_K_M.gguf")));
        assert_eq!(projector_of(&dir.join("Qwen2.5-0.5B")), None);
        remove(&dir.join("mmproj-b.Q4_K_M.gguf")).unwrap();
        assert_eq!(projector_of(&dir.join("b.Q4_K_M.gguf")), None);
        assert!(scan(&dir.join("missing")).is_empty());
        remove(&dir.join("Qwen2.5-0.5B")).unwrap();
        remove(&dir.join("a.gguf")).unwrap();
        assert_eq!(scan(&dir).len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
