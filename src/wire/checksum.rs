//! The Internet checksum (RFC 1071) and its incremental update (RFC 1624).

/// Adds `data` to a running ones'-complement sum (not yet folded).
pub fn sum(mut acc: u32, data: &[u8]) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        acc = acc.wrapping_add(u32::from(u16::from_be_bytes([c[0], c[1]])));
        // Fold early so very long buffers never overflow.
        if acc & 0x8000_0000 != 0 {
            acc = (acc & 0xffff) + (acc >> 16);
        }
    }
    if let [last] = chunks.remainder() {
        acc = acc.wrapping_add(u32::from(*last) << 8);
    }
    acc
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
    let acc = sum(sum(0, &src), &dst);
    acc + u32::from(proto) + u32::from(len)
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

    proptest! {
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
