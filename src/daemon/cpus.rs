//! Where the service's threads run (`--cpus`), as DPDK's lcore list, Open vSwitch's
//! `pmd-cpu-mask` and VPP's `corelist-workers` place theirs: the dataplane's threads each
//! bound to one CPU of the list (the I/O thread to the first, the workers to the others
//! in turn), and every other thread (the metrics endpoint, the export, reloads, KV-cache
//! clients) to the CPUs the process may use that the list leaves, so they never take a
//! dataplane thread's core.

/// Why a CPU list cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CpuListError {
    /// not a CPU list
    #[error("`{0}` is not a CPU list (such as 2-5,8; CPUs below {MAX_CPUS})")]
    Syntax(String),
    /// a CPU the process may not run on
    #[error("CPU {cpu} is not one this process may run on (it may use {allowed})")]
    NotAllowed { cpu: usize, allowed: String },
}

/// CPUs a list may name: those an affinity mask holds (`cpu_set_t`, sched_setaffinity(2)).
pub const MAX_CPUS: usize = 1024;

/// A CPU list as Linux writes them ("List format" in cpuset(7)): CPUs and ranges of them
/// separated by commas, `0-3,8,10-11`. Ascending, each CPU once.
pub fn parse(text: &str) -> Result<Vec<usize>, CpuListError> {
    let bad = || CpuListError::Syntax(text.to_owned());
    let cpu = |s: &str| {
        s.parse::<usize>()
            .ok()
            .filter(|&c| c < MAX_CPUS && !s.starts_with('+'))
    };
    let mut cpus = Vec::new();
    for item in text.trim().split(',') {
        let (first, last) = match item.split_once('-') {
            Some((a, b)) => (cpu(a).ok_or_else(bad)?, cpu(b).ok_or_else(bad)?),
            None => {
                let c = cpu(item).ok_or_else(bad)?;
                (c, c)
            }
        };
        if first > last {
            return Err(bad());
        }
        cpus.extend(first..=last);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// `cpus` (ascending) in list format, runs of consecutive CPUs as ranges.
pub fn format(cpus: &[usize]) -> String {
    let mut items = Vec::new();
    let mut rest = cpus;
    while let Some(&first) = rest.first() {
        let run = rest
            .iter()
            .enumerate()
            .take_while(|&(i, &c)| c == first + i)
            .count();
        let last = rest[run - 1];
        items.push(if run == 1 {
            first.to_string()
        } else {
            format!("{first}-{last}")
        });
        rest = &rest[run..];
    }
    items.join(",")
}

/// The CPU of each of the service's threads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The I/O thread's.
    pub io: usize,
    /// Each worker thread's, by worker.
    pub workers: Vec<usize>,
    /// The other threads' (together).
    pub control: Vec<usize>,
}

impl Placement {
    /// The I/O thread on the first of `dataplane`, `workers` worker threads on the others
    /// in turn (on the first too when it is the only one), the other threads on what
    /// `allowed` (the CPUs the process may use) leaves, or on all of it when the dataplane
    /// takes every one.
    pub fn new(
        dataplane: &[usize],
        workers: usize,
        allowed: &[usize],
    ) -> Result<Placement, CpuListError> {
        if let Some(&cpu) = dataplane.iter().find(|c| !allowed.contains(c)) {
            return Err(CpuListError::NotAllowed {
                cpu,
                allowed: format(allowed),
            });
        }
        let io = *dataplane
            .first()
            .ok_or_else(|| CpuListError::Syntax(String::new()))?;
        let for_workers = if dataplane.len() > 1 {
            &dataplane[1..]
        } else {
            dataplane
        };
        let workers = (0..workers)
            .map(|w| for_workers[w % for_workers.len()])
            .collect();
        let left: Vec<usize> = allowed
            .iter()
            .copied()
            .filter(|c| !dataplane.contains(c))
            .collect();
        let control = if left.is_empty() {
            allowed.to_vec()
        } else {
            left
        };
        Ok(Placement {
            io,
            workers,
            control,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_read_as_linux_writes_them() {
        assert_eq!(parse("0-3,8,10-11"), Ok(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse("5"), Ok(vec![5]));
        assert_eq!(parse(" 3,1,2-3 "), Ok(vec![1, 2, 3]));
        for bad in [
            "", "a", "1-", "-1", "3-1", "1,,2", "1 ,2", "+1", "1024", "0-1024",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(format(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(format(&[]), "");
    }

    #[test]
    fn the_dataplane_takes_its_cpus_and_the_rest_take_what_is_left() {
        let allowed: Vec<usize> = (0..8).collect();
        assert_eq!(
            Placement::new(&[2, 3, 4], 2, &allowed),
            Ok(Placement {
                io: 2,
                workers: vec![3, 4],
                control: vec![0, 1, 5, 6, 7],
            })
        );
        // More workers than CPUs: they share them in turn.
        assert_eq!(
            Placement::new(&[2, 3, 4], 3, &allowed).map(|p| p.workers),
            Ok(vec![3, 4, 3])
        );
        // One CPU: everything of the dataplane on it.
        assert_eq!(
            Placement::new(&[6], 2, &allowed).map(|p| (p.io, p.workers)),
            Ok((6, vec![6, 6]))
        );
        // Every CPU the dataplane's: the other threads go anywhere.
        assert_eq!(
            Placement::new(&[0, 1], 1, &[0, 1]).map(|p| p.control),
            Ok(vec![0, 1])
        );
        assert_eq!(
            Placement::new(&[1, 9], 1, &allowed),
            Err(CpuListError::NotAllowed {
                cpu: 9,
                allowed: "0-7".into()
            })
        );
    }

    proptest::proptest! {
        /// Any set of CPUs survives being written as a list and read back.
        #[test]
        fn lists_round_trip(cpus in proptest::collection::btree_set(0usize..MAX_CPUS, 1..64)) {
            let cpus: Vec<usize> = cpus.into_iter().collect();
            proptest::prop_assert_eq!(parse(&format(&cpus)), Ok(cpus));
        }

        /// Any text is read or refused, never a panic; what is read is ascending, unique
        /// and within the mask.
        #[test]
        fn any_text_is_read_or_refused(text in "[0-9,\\- ]{0,24}") {
            if let Ok(cpus) = parse(&text) {
                proptest::prop_assert!(cpus.windows(2).all(|w| w[0] < w[1]));
                proptest::prop_assert!(cpus.iter().all(|&c| c < MAX_CPUS));
            }
        }
    }
}
