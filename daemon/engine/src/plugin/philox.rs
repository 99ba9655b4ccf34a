//! Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): a
//! counter-based generator. The output for a (key, counter) pair depends on nothing else, so a
//! seeded request draws the same numbers whatever else runs in the batch, in any order.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = u64::from(a) * u64::from(b);
    ((p >> 32) as u32, p as u32)
}

/// Ten rounds of Philox4x32 on `ctr` under `key`.
pub fn philox4x32_10(mut ctr: [u32; 4], mut key: [u32; 2]) -> [u32; 4] {
    for round in 0..10 {
        if round > 0 {
            key[0] = key[0].wrapping_add(W0);
            key[1] = key[1].wrapping_add(W1);
        }
        let (hi0, lo0) = mulhilo(M0, ctr[0]);
        let (hi1, lo1) = mulhilo(M1, ctr[2]);
        ctr = [hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0];
    }
    ctr
}

/// The ABI's `random(stream, counter)` under a request's 64-bit seed.
pub fn random(seed: u64, stream: u64, counter: u64) -> [u32; 4] {
    philox4x32_10(
        [counter as u32, (counter >> 32) as u32, stream as u32, (stream >> 32) as u32],
        [seed as u32, (seed >> 32) as u32],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answers_of_the_reference_implementation() {
        // The Random123 known-answer vectors for philox4x32_10.
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]);
        assert_eq!(
            philox4x32_10([0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344], [0xa409_3822, 0x299f_31d0]),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn streams_counters_and_seeds_are_independent() {
        let a = random(7, 0, 0);
        assert_ne!(a, random(7, 1, 0));
        assert_ne!(a, random(7, 0, 1));
        assert_ne!(a, random(8, 0, 0));
        assert_eq!(a, random(7, 0, 0));
    }
}
