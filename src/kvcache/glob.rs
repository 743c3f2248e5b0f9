//! Redis's glob-style key patterns (`KEYS`, `SCAN … MATCH`): `*` any run of bytes, `?` one
//! byte, `[abc]`, `[^abc]` and `[a-z]` a byte of (or not of) a set, `\x` the byte `x`.

/// Whether `key` matches `pattern`. An empty key matches only an empty pattern, and `*`
/// (which Redis's `KEYS` and `SCAN` take as every key without matching).
pub fn matches(pattern: &[u8], key: &[u8]) -> bool {
    if key.is_empty() {
        return pattern.is_empty() || pattern == b"*";
    }
    // Where to resume after the last `*`: the pattern after it, and the key position it
    // has swallowed up to.
    let mut star: Option<(usize, usize)> = None;
    let (mut p, mut k) = (0, 0);
    while k < key.len() {
        match step(pattern, p, key[k]) {
            Step::Star => {
                star = Some((p + 1, k));
                p += 1;
                continue;
            }
            Step::Match(next) => {
                p = next;
                k += 1;
                continue;
            }
            Step::Fail => {}
        }
        // Let the last `*` take one more byte, or fail.
        match star {
            Some((after, taken)) => {
                star = Some((after, taken + 1));
                p = after;
                k = taken + 1;
            }
            None => return false,
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

enum Step {
    /// `*` at this position.
    Star,
    /// The byte matches the element at this position; the next element's position.
    Match(usize),
    Fail,
}

/// The element of `pattern` at `p` against byte `b`.
fn step(pattern: &[u8], p: usize, b: u8) -> Step {
    match pattern.get(p) {
        None => Step::Fail,
        Some(b'*') => Step::Star,
        Some(b'?') => Step::Match(p + 1),
        Some(b'\\') if p + 1 < pattern.len() => {
            if pattern[p + 1] == b {
                Step::Match(p + 2)
            } else {
                Step::Fail
            }
        }
        Some(b'[') => set(pattern, p + 1, b),
        Some(&c) => {
            if c == b {
                Step::Match(p + 1)
            } else {
                Step::Fail
            }
        }
    }
}

/// A `[...]` set starting after its `[` at `p`; an unclosed set matches up to the
/// pattern's end, as Redis's does. As in Redis, a byte followed by `-` and any byte is a
/// range, `]` included: `[a-]` is the bytes from `]` to `a`, and the set goes on after it.
fn set(pattern: &[u8], mut p: usize, b: u8) -> Step {
    let negate = pattern.get(p) == Some(&b'^');
    if negate {
        p += 1;
    }
    let mut hit = false;
    while p < pattern.len() && pattern[p] != b']' {
        if pattern[p] == b'\\' && p + 1 < pattern.len() {
            hit |= pattern[p + 1] == b;
            p += 2;
        } else if p + 2 < pattern.len() && pattern[p + 1] == b'-' {
            let (lo, hi) = (
                pattern[p].min(pattern[p + 2]),
                pattern[p].max(pattern[p + 2]),
            );
            hit |= (lo..=hi).contains(&b);
            p += 3;
        } else {
            hit |= pattern[p] == b;
            p += 1;
        }
    }
    if hit != negate {
        Step::Match((p + 1).min(pattern.len()))
    } else {
        Step::Fail
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn patterns_as_redis_reads_them() {
        let yes = [
            ("*", ""),
            ("*", "layer0"),
            ("layer?", "layer7"),
            ("h[ae]llo", "hallo"),
            ("h[^e]llo", "hallo"),
            ("h[a-b]llo", "hbllo"),
            ("*:kv_bytes", "model@1:kv_bytes"),
            ("a*b*c", "axxbyyc"),
            ("a\\*", "a*"),
            ("[\\]]", "]"),
            ("[a-]", "^"),
            ("h[a-]llo", "ho"),
        ];
        for (p, k) in yes {
            assert!(matches(p.as_bytes(), k.as_bytes()), "{p} should match {k}");
        }
        let no = [
            ("layer?", "layer"),
            ("h[^e]llo", "hello"),
            ("h[a-b]llo", "hcllo"),
            ("a*b*c", "axxbyy"),
            ("a\\*", "ab"),
            ("", "x"),
            ("[a-]", "-"),
            ("h[a-]llo", "hallo"),
            ("**", ""),
            ("?", ""),
        ];
        for (p, k) in no {
            assert!(
                !matches(p.as_bytes(), k.as_bytes()),
                "{p} should not match {k}"
            );
        }
    }

    /// Every byte escaped: the pattern matches exactly its key.
    fn escaped(key: &[u8]) -> Vec<u8> {
        key.iter().flat_map(|&b| [b'\\', b]).collect()
    }

    proptest! {
        #[test]
        fn a_key_matches_itself_escaped_and_any_star(
            key in proptest::collection::vec(any::<u8>(), 0..20),
            other in proptest::collection::vec(any::<u8>(), 0..20),
        ) {
            prop_assert!(matches(&escaped(&key), &key));
            prop_assert_eq!(matches(&escaped(&key), &other), key == other);
            prop_assert!(matches(b"*", &key));
            let mut prefix = escaped(&key);
            prefix.push(b'*');
            let mut longer = key.clone();
            longer.extend_from_slice(&other);
            prop_assert!(matches(&prefix, &longer));
        }

        /// Any pattern against any key: an answer, never a panic.
        #[test]
        fn never_panics(
            pattern in proptest::collection::vec(prop_oneof![Just(b'*'), Just(b'?'), Just(b'['), Just(b']'), Just(b'\\'), Just(b'^'), Just(b'-'), Just(b'a')], 0..12),
            key in proptest::collection::vec(prop_oneof![Just(b'a'), Just(b'b'), Just(b']')], 0..12),
        ) {
            let _ = matches(&pattern, &key);
        }
    }
}
