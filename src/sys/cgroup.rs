//! The memory the control groups this process runs in leave it: a container's limit, or a
//! systemd unit's `MemoryMax=`, is often far below what the machine has available, and a
//! start sized by the machine would be killed by the group's OOM killer as the workers
//! write their tables, with no word of why.
//!
//! cgroup v2 (Documentation/admin-guide/cgroup-v2.rst): `memory.max` ("max" for none),
//! `memory.current`; cgroup v1 (Documentation/admin-guide/cgroup-v1/memory.rst):
//! `memory.limit_in_bytes` (a value near 2^63 for none), `memory.usage_in_bytes`. Usage
//! counts the page cache, of which the inactive part is reclaimed before the group would
//! kill: it is counted as room, as the kubelet's working set does.

use std::path::{Path, PathBuf};

/// Which hierarchy a group's files are in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

/// The room left under the memory limit of every group this process is in, its own and
/// each one above it up to the hierarchy's mount, in bytes: the least of them. `None`
/// where no group limits memory, or none can be read.
pub fn memory_room() -> Option<u64> {
    own_memory_groups()
        .iter()
        .filter_map(|(dir, version)| room_in(dir, *version))
        .min()
}

/// The directories of the memory groups this process is in, its own first, each with
/// its hierarchy's version; none where they cannot be read.
pub fn own_memory_groups() -> Vec<(PathBuf, Version)> {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    memory_groups(&read("/proc/self/cgroup"), &read("/proc/self/mountinfo"))
}

/// The directories of the memory groups this process is in, its own first and then each
/// one above it up to the mount of its hierarchy, from /proc/self/cgroup (`ID:CONTROLLERS:
/// PATH`, `0::PATH` for v2) and /proc/self/mountinfo (where each hierarchy is mounted, and
/// which of its groups the mount shows as its root). A v1 memory hierarchy is used where
/// there is one (the v2 one of a hybrid layout then has no memory controller).
fn memory_groups(groups: &str, mounts: &str) -> Vec<(PathBuf, Version)> {
    let v1 = groups.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then_some((path, Version::V1))
    });
    let v2 = || {
        groups
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .map(|path| (path, Version::V2))
    };
    let Some((path, version)) = v1.or_else(v2) else {
        return Vec::new();
    };
    let Some((root, mount)) = mounts.lines().find_map(|l| mount_of(l, version)) else {
        return Vec::new();
    };
    let (root, mount) = (unescape(root), unescape(mount));
    // The group's path below the mount's root (a cgroup namespace, or a container's
    // mount of its own group, shows less than the whole hierarchy), taken whole
    // components at a time: a root of /a is not above /ab.
    let root = root.trim_end_matches('/');
    let below = match path.strip_prefix(root) {
        Some(rest) if rest.is_empty() || rest.starts_with('/') => rest,
        _ => path,
    };
    let mut dir = PathBuf::from(mount);
    let mut dirs = vec![dir.clone()];
    for part in below.split('/').filter(|p| !p.is_empty()) {
        dir.push(part);
        dirs.push(dir.clone());
    }
    dirs.reverse();
    dirs.into_iter().map(|d| (d, version)).collect()
}

/// The root and mount point of a mountinfo line (proc(5): `ID PARENT MAJ:MIN ROOT
/// MOUNT OPTIONS [OPTIONAL…] - TYPE SOURCE SUPER_OPTIONS`) that mounts the hierarchy of
/// `version` holding the memory controller.
fn mount_of(line: &str, version: Version) -> Option<(&str, &str)> {
    let (mine, theirs) = line.split_once(" - ")?;
    let mut f = mine.split(' ');
    let (root, mount) = (f.nth(3)?, f.next()?);
    let mut t = theirs.split(' ');
    let (kind, _, options) = (t.next()?, t.next()?, t.next()?);
    let wanted = match version {
        Version::V2 => kind == "cgroup2",
        Version::V1 => kind == "cgroup" && options.split(',').any(|o| o == "memory"),
    };
    wanted.then_some((root, mount))
}

/// A mountinfo field as the path it names: proc(5) writes a space, tab, newline or
/// backslash in one as a backslash and three octal digits (`\040` for a space).
fn unescape(field: &str) -> String {
    let mut out = Vec::with_capacity(field.len());
    let mut bytes = field.as_bytes();
    while let Some((&b, rest)) = bytes.split_first() {
        let code = rest
            .get(..3)
            .filter(|d| b == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .and_then(|d| u8::from_str_radix(std::str::from_utf8(d).ok()?, 8).ok());
        match code {
            Some(c) => {
                out.push(c);
                bytes = &rest[3..];
            }
            None => {
                out.push(b);
                bytes = rest;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The room under one group's limit: its limit less what it uses that cannot be
/// reclaimed. `None` for a group without a limit, or whose files cannot be read.
fn room_in(dir: &Path, version: Version) -> Option<u64> {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let number = |name: &str| read(name)?.trim().parse::<u64>().ok();
    let (limit, used, inactive) = match version {
        Version::V2 => (
            number("memory.max")?,
            number("memory.current")?,
            stat_of(&read("memory.stat")?, "inactive_file"),
        ),
        Version::V1 => (
            number("memory.limit_in_bytes").filter(|&l| l < V1_NO_LIMIT)?,
            number("memory.usage_in_bytes")?,
            stat_of(&read("memory.stat")?, "total_inactive_file"),
        ),
    };
    Some(limit.saturating_sub(used.saturating_sub(inactive)))
}

/// v1 says "no limit" with the largest page-aligned value below 2^63; anything from 2^62
/// is no limit a machine has.
const V1_NO_LIMIT: u64 = 1 << 62;

/// A value of memory.stat (`NAME VALUE` lines), 0 where absent.
fn stat_of(stat: &str, name: &str) -> u64 {
    stat.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID_MOUNTS: &str = "\
        30 25 0:26 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw\n\
        31 25 0:27 / /sys/fs/cgroup/cpu rw,nosuid - cgroup cgroup rw,cpu\n\
        35 25 0:31 / /sys/fs/cgroup/memory rw,nosuid shared:9 - cgroup cgroup rw,memory\n";

    /// `dirs`, each in a hierarchy of `version`.
    fn in_version(version: Version, dirs: &[&str]) -> Vec<(PathBuf, Version)> {
        dirs.iter().map(|d| (PathBuf::from(d), version)).collect()
    }

    /// A hybrid layout (v1 controllers, an empty v2 hierarchy beside them): the v1
    /// memory hierarchy's groups, the process's own first.
    #[test]
    fn hybrid_layouts_use_the_v1_memory_hierarchy() {
        let groups = "4:memory:/system.slice/dpuflow.service\n1:cpu:/\n0::/\n";
        let dirs = memory_groups(groups, HYBRID_MOUNTS);
        let want = in_version(
            Version::V1,
            &[
                "/sys/fs/cgroup/memory/system.slice/dpuflow.service",
                "/sys/fs/cgroup/memory/system.slice",
                "/sys/fs/cgroup/memory",
            ],
        );
        assert_eq!(dirs, want);
    }

    /// A container that mounts its own group as the hierarchy's root sees its path from
    /// there, or as "/" in its own cgroup namespace.
    #[test]
    fn a_mount_of_a_group_strips_its_root() {
        let mounts = "40 30 0:26 /kubepods/pod1/c1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        for groups in ["0::/kubepods/pod1/c1\n", "0::/\n"] {
            let dirs = memory_groups(groups, mounts);
            assert_eq!(dirs, [(PathBuf::from("/sys/fs/cgroup"), Version::V2)]);
        }
        assert!(memory_groups("1:cpu:/\n", mounts).is_empty());
    }

    /// A root that is a prefix of the group's path but not a whole component of it is
    /// not above it; a mount point with a space is written escaped.
    #[test]
    fn roots_are_whole_components_and_mount_points_unescaped() {
        let mounts = "40 30 0:26 /a /sys/fs/my\\040cgroup rw - cgroup2 cgroup2 rw\n";
        let dirs = memory_groups("0::/ab/c\n", mounts);
        let want = in_version(
            Version::V2,
            &[
                "/sys/fs/my cgroup/ab/c",
                "/sys/fs/my cgroup/ab",
                "/sys/fs/my cgroup",
            ],
        );
        assert_eq!(dirs, want);
        assert_eq!(unescape("a\\134b\\0"), "a\\b\\0");
    }

    proptest::proptest! {
        /// Whatever /proc says, reading it does not panic.
        #[test]
        fn any_text_is_read_without_panic(groups in ".{0,200}", mounts in ".{0,300}") {
            let _ = memory_groups(&groups, &mounts);
        }

        /// A group's directories are the mount point and then each component of its
        /// path below the mount's root, deepest first, whatever the names.
        #[test]
        fn groups_are_found_below_their_mount(
            parts in proptest::collection::vec("[a-z0-9. \\\\]{1,6}", 0..6),
            at in 0usize..6,
            mount in proptest::collection::vec("[a-z0-9 ]{1,6}", 1..4),
        ) {
            let at = at.min(parts.len());
            let escape = |s: &str| s.replace('\\', "\\134").replace(' ', "\\040");
            let join = |p: &[String]| p.iter().map(|x| format!("/{x}")).collect::<String>();
            let root = if at == 0 { "/".to_string() } else { join(&parts[..at]) };
            let mount_point = join(&mount);
            let mounts = format!(
                "40 30 0:26 {} {} rw - cgroup2 cgroup2 rw\n",
                escape(&root),
                escape(&mount_point)
            );
            let groups = format!("0::{}\n", if parts.is_empty() { "/".into() } else { join(&parts) });
            let mut want = vec![PathBuf::from(&mount_point)];
            for p in &parts[at..] {
                let next = want.last().expect("one").join(p);
                want.push(next);
            }
            want.reverse();
            let got: Vec<PathBuf> = memory_groups(&groups, &mounts).into_iter().map(|(d, _)| d).collect();
            proptest::prop_assert_eq!(got, want);
        }
    }

    /// Room is the limit less what is used that cannot be reclaimed; a group without a
    /// limit has none to say.
    #[test]
    fn room_is_the_limit_less_the_unreclaimable_use() {
        let dir = std::env::temp_dir().join(format!("dpuflow-cgroup-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let write = |name: &str, text: &str| std::fs::write(dir.join(name), text).expect("write");
        write("memory.max", "1073741824\n");
        write("memory.current", "300000000\n");
        write(
            "memory.stat",
            "anon 200000000\nfile 100000000\ninactive_file 60000000\n",
        );
        assert_eq!(
            room_in(&dir, Version::V2),
            Some(1_073_741_824 - 240_000_000)
        );
        write("memory.max", "max\n");
        assert_eq!(room_in(&dir, Version::V2), None);
        write("memory.limit_in_bytes", "9223372036854771712\n");
        write("memory.usage_in_bytes", "5000\n");
        write("memory.stat", "inactive_file 0\ntotal_inactive_file 1000\n");
        assert_eq!(room_in(&dir, Version::V1), None);
        write("memory.limit_in_bytes", "104857600\n");
        assert_eq!(room_in(&dir, Version::V1), Some(104_857_600 - 4000));
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
