//! Model management as a right of its own (`server.manage`): installing, replacing, removing
//! and unloading models, and setting how long they stay loaded, change what every other user
//! of the daemon gets, so only root, the daemon's own user and the users and groups the config
//! names may do them. Everyone else who may open the socket may use the models.
//!
//! Checked where the caller is known: the Unix socket's peer (`SO_PEERCRED`) and a D-Bus
//! caller (the bus names its uid). A loopback TCP peer has no uid and never manages. Group
//! membership is read from `/etc/passwd` and `/etc/group` at each check, so a change applies
//! without a restart.

use super::api::ApiError;

/// Who may manage models, as configured.
#[derive(Debug, Clone)]
pub struct Managers {
    /// `server.manage`: user names and `@group` names.
    entries: Vec<String>,
    /// The daemon's own uid (a user's daemon is managed by its user).
    own: Option<u32>,
}

impl Managers {
    pub fn new(entries: &[String]) -> Managers {
        Managers { entries: entries.to_vec(), own: super::config::effective_uid() }
    }

    /// Names in `server.manage` that match no user or group here (they grant nothing).
    pub fn unknown(&self) -> Vec<String> {
        self.entries
            .iter()
            .filter(|e| match e.strip_prefix('@') {
                Some(g) => group(g).is_none(),
                None => user_by_name(e).is_none(),
            })
            .cloned()
            .collect()
    }

    /// Whether `uid` may manage models (`None`: a TCP peer, who may not).
    pub fn may(&self, uid: Option<u32>) -> bool {
        let Some(uid) = uid else { return false };
        if uid == 0 || Some(uid) == self.own {
            return true;
        }
        let Some((name, gid)) = user_by_uid(uid) else { return false };
        self.entries.iter().any(|e| match e.strip_prefix('@') {
            Some(g) => group(g).is_some_and(|(id, members)| id == gid || members.contains(&name)),
            None => *e == name,
        })
    }

    /// `Ok` when `uid` may manage models, else a 403 saying what it tried and who may.
    pub fn check(&self, uid: Option<u32>, what: &str) -> Result<(), ApiError> {
        if self.may(uid) {
            return Ok(());
        }
        let who = if self.entries.is_empty() { String::new() } else { format!(", {}", self.entries.join(", ")) };
        Err(ApiError::new(
            403,
            format!("{what} is model management, which only root, the daemon's user{who} may do (server.manage)"),
            None,
        ))
    }
}

/// The fields of the `/etc/passwd` line `pick` chooses: (name, uid, gid).
fn passwd(pick: impl Fn(&str, u32) -> bool) -> Option<(String, u32, u32)> {
    let text = std::fs::read_to_string("/etc/passwd").ok()?;
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        let (name, uid, gid) = (*f.first()?, f.get(2)?.parse().ok()?, f.get(3)?.parse().ok()?);
        pick(name, uid).then(|| (name.to_string(), uid, gid))
    })
}

/// A user's name and primary group.
fn user_by_uid(uid: u32) -> Option<(String, u32)> {
    passwd(|_, u| u == uid).map(|(n, _, g)| (n, g))
}

fn user_by_name(name: &str) -> Option<u32> {
    passwd(|n, _| n == name).map(|(_, u, _)| u)
}

/// A group's gid and member names.
fn group(name: &str) -> Option<(u32, Vec<String>)> {
    let text = std::fs::read_to_string("/etc/group").ok()?;
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        if *f.first()? != name {
            return None;
        }
        let members =
            f.get(3).map_or_else(Vec::new, |m| m.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect());
        Some((f.get(2)?.parse().ok()?, members))
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests: a failed unwrap is a failed test
mod tests {
    use super::*;

    #[test]
    fn root_and_the_daemons_user_manage_and_tcp_peers_do_not() {
        let m = Managers { entries: Vec::new(), own: Some(4242) };
        assert!(m.may(Some(0)) && m.may(Some(4242)));
        assert!(!m.may(None));
        // A user that exists but is named nowhere (nobody, on Debian 65534).
        if user_by_uid(65534).is_some() {
            assert!(!m.may(Some(65534)));
            let e = m.check(Some(65534), "removing a model").unwrap_err();
            assert!(e.status == 403 && e.message.contains("server.manage"), "{}", e.message);
        }
    }

    #[test]
    fn named_users_and_groups_manage() {
        // nobody (65534) and its primary group, on Debian nogroup.
        let Some((name, gid)) = user_by_uid(65534) else { return };
        let by_name = Managers { entries: vec![name.clone()], own: None };
        assert!(by_name.may(Some(65534)));
        let gname = std::fs::read_to_string("/etc/group").ok().and_then(|t| {
            t.lines()
                .find(|l| l.split(':').nth(2) == Some(&gid.to_string()))
                .map(|l| l.split(':').next().unwrap_or("").to_string())
        });
        if let Some(g) = gname {
            assert!(Managers { entries: vec![format!("@{g}")], own: None }.may(Some(65534)));
        }
        let nobody_else = Managers { entries: vec!["@no-such-group-here".into(), "no-such-user".into()], own: None };
        assert!(!nobody_else.may(Some(65534)));
        assert_eq!(nobody_else.unknown().len(), 2);
    }
}
