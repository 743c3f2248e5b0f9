//! The Internet checksum (RFC 1071) and its incremental update (RFC 1624).

/// Adds `data` to a running ones'-complement sum (not yet folded; `acc` below 2^31).
///
/// Four bytes at a time: the sum of 16-bit words does not depend on the order of their
/// bytes but for one swap of the result (RFC 1071 §2 (B)), so words are added as the
/// machine reads them, into 64 bits that cannot overflow (a 2^32-word buffer would be
/// needed), folded once, and put in network order; the last one to three bytes are added
/// as big-endian words. A tenth of the instructions of a 16-bit loop on 1500 bytes.
pub fn sum(acc: u32, data: &[u8]) -> u32 {
    let mut wide = 0u64;
    let mut words = data.chunks_exact(4);
    for w in &mut words {
        wide += u64::from(u32::from_ne_bytes([w[0], w[1], w[2], w[3]]));
    }
    let native = fold(fold32(wide));
    let mut acc = acc + u32::from(u16::from_be(native));
    match *words.remainder() {
        [a] => acc += u32::from(a) << 8,
        [a, b] => acc += u32::from(u16::from_be_bytes([a, b])),
        [a, b, c] => acc += u32::from(u16::from_be_bytes([a, b])) + (u32::from(c) << 8),
        _ => {}
    }
    acc
}

/// A 64-bit ones'-complement sum folded to 32 bits (2^32 is 1 modulo 2^16 − 1).
fn fold32(wide: u64) -> u32 {
    let w = (wide & 0xffff_ffff) + (wide >> 32);
    let w = (w & 0xffff_ffff) + (w >> 32);
    (w & 0xffff) as u32 + (w >> 16) as u32
}

/// Folds a running sum into 16 bits.
pub fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

/// The checksum of `data`: the complement of its folded sum.
pub fn checksum(data: &[u8]) -> u16 {
    !fold(sum(0, data))
}

/// The sum of the IPv4 pseudo-header (RFC 768, RFC 9293 §3.1).
pub fn pseudo_v4(src: [u8; 4], dst: [u8; 4], proto: u8, len: u16) -> u32 {
    let (s, d) = (u32::from_be_bytes(src), u32::from_be_bytes(dst));
    (s >> 16) + (s & 0xffff) + (d >> 16) + (d & 0xffff) + u32::from(proto) + u32::from(len)
}

/// The sum of the IPv6 pseudo-header (RFC 8200 §8.1).
pub fn pseudo_v6(src: &[u8; 16], dst: &[u8; 16], next_header: u8, len: u32) -> u32 {
    let acc = sum(sum(0, src), dst);
    acc.wrapping_add(len >> 16)
        .wrapping_add(len & 0xffff)
        .wrapping_add(u32::from(next_header))
}

/// A checksum after one 16-bit word of the covered data changed from `old` to `new`:
/// HC' = ~(~HC + ~m + m'), RFC 1624 eqn. 3.
pub fn update16(check: u16, old: u16, new: u16) -> u16 {
    let acc = u32::from(!check) + u32::from(!old) + u32::from(new);
    !fold(acc)
}

/// [`update16`] for a 32-bit word (an IPv4 address).
pub fn update32(check: u16, old: u32, new: u32) -> u16 {
    let c = update16(check, (old >> 16) as u16, (new >> 16) as u16);
    update16(c, old as u16, new as u16)
}

/// [`update16`] for a changed run of bytes of even length starting at an even offset.
pub fn update_bytes(check: u16, old: &[u8], new: &[u8]) -> u16 {
    let acc = u32::from(!check) + u32::from(!fold(sum(0, old))) + u32::from(fold(sum(0, new)));
    !fold(acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rfc1071_example() {
        // RFC 1071 §3: the sum of 00 01 f2 03 f4 f5 f6 f7 is ddf2.
        assert_eq!(
            fold(sum(0, &[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7])),
            0xddf2
        );
    }

    /// The sum as RFC 1071 defines it, a big-endian word at a time.
    fn reference(acc: u32, data: &[u8]) -> u16 {
        let words = data.chunks(2).map(|c| {
            let pair = [c[0], c.get(1).copied().unwrap_or(0)];
            u64::from(u16::from_be_bytes(pair))
        });
        let total = words.fold(u64::from(acc), |a, w| a + w);
        let mut t = total;
        while t > 0xffff {
            t = (t & 0xffff) + (t >> 16);
        }
        t as u16
    }

    proptest! {
        /// The pseudo-headers' sums are their bytes' (RFC 9293 §3.1, RFC 8200 §8.1).
        #[test]
        fn pseudo_headers_sum_their_fields(
            src in any::<[u8; 16]>(),
            dst in any::<[u8; 16]>(),
            proto in any::<u8>(),
            len in any::<u16>(),
        ) {
            let mut v4 = src[..4].to_vec();
            v4.extend_from_slice(&dst[..4]);
            v4.extend_from_slice(&[0, proto]);
            v4.extend_from_slice(&len.to_be_bytes());
            let (s4, d4) = (src[..4].try_into().unwrap(), dst[..4].try_into().unwrap());
            prop_assert_eq!(fold(pseudo_v4(s4, d4, proto, len)), reference(0, &v4));
            let mut v6 = src.to_vec();
            v6.extend_from_slice(&dst);
            v6.extend_from_slice(&u32::from(len).to_be_bytes());
            v6.extend_from_slice(&[0, 0, 0, proto]);
            prop_assert_eq!(fold(pseudo_v6(&src, &dst, proto, u32::from(len))), reference(0, &v6));
        }

        /// Four bytes at a time, in the machine's order, folds to the sum a big-endian
        /// word at a time gives, whatever the data, its length and the sum it continues.
        #[test]
        fn wide_sum_equals_the_definition(
            data in proptest::collection::vec(any::<u8>(), 0..3000),
            acc in 0u32..0x4_0000,
        ) {
            prop_assert_eq!(fold(sum(acc, &data)), reference(acc, &data));
        }

        #[test]
        fn incremental_equals_recomputed(mut data in proptest::collection::vec(any::<u8>(), 2..64), at in any::<usize>(), new in any::<u16>()) {
            let n = data.len() / 2;
            let i = (at % n) * 2;
            let before = checksum(&data);
            let old = u16::from_be_bytes([data[i], data[i + 1]]);
            data[i..i + 2].copy_from_slice(&new.to_be_bytes());
            let after = checksum(&data);
            // Ones' complement has two zeros; both encode the same sum.
            let inc = update16(before, old, new);
            prop_assert!(inc == after || (inc == 0xffff && after == 0) || (inc == 0 && after == 0xffff));
        }
    }
}
