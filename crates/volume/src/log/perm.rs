//! The order in which log writes visit physical blocks (Blizzard §2.5.3): a
//! permutation of `0..n` kept in O(1) space. A linear congruential
//! generator `x ← (a·x + c) mod m` over `m` = the next power of two ≥ n has
//! full period when `c` is odd and `a ≡ 1 (mod 4)` (Hull–Dobell); values
//! ≥ n are skipped ("cycle walking"), which leaves a permutation of `0..n`
//! because every value in `0..m` appears once per period. Fewer than half
//! the steps are skipped, since m < 2n.
//!
//! The whole state is four integers and a counter, stored in checkpoints so
//! recovery resumes the walk exactly where the checkpoint left it.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Permutation {
    pub n: u64,
    pub m: u64,
    pub a: u64,
    pub c: u64,
    /// The generator's current value; the next position is derived from it.
    pub x: u64,
}

impl Permutation {
    /// A permutation of `0..n` chosen by `seed`.
    pub fn new(n: u64, seed: u64) -> Permutation {
        let n = n.max(1);
        let m = n.next_power_of_two().max(8);
        let mut s = seed;
        let mut mix = || {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        // a ≡ 5 (mod 8) satisfies a ≡ 1 (mod 4) and scatters better than
        // small multipliers; c odd. Both well mixed from the seed, so
        // neighbouring seeds give unrelated orders.
        let a = ((mix() % (m / 8).max(1)) * 8 + 5) % m;
        let c = (mix() % m) | 1;
        let x = mix() % m;
        Permutation { n, m, a, c, x }
    }

    fn step(&self, x: u64) -> u64 {
        ((self.a as u128 * x as u128 + self.c as u128) % self.m as u128) as u64
    }

    /// The next position, advancing the walk.
    pub fn next_position(&mut self) -> u64 {
        loop {
            self.x = self.step(self.x);
            if self.x < self.n {
                return self.x;
            }
        }
    }

    /// The next position without advancing.
    pub fn peek(&self) -> u64 {
        let mut p = *self;
        p.next_position()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any size and seed: n consecutive positions are exactly 0..n, and
        /// the next n are the same sequence again.
        #[test]
        fn full_period(n in 1u64..5000, seed in any::<u64>()) {
            let mut p = Permutation::new(n, seed);
            let first: Vec<u64> = (0..n).map(|_| p.next_position()).collect();
            let mut sorted = first.clone();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..n).collect::<Vec<_>>());
            let second: Vec<u64> = (0..n).map(|_| p.next_position()).collect();
            prop_assert_eq!(first, second);
        }

        /// The state is a few integers: copying it mid-walk resumes exactly.
        #[test]
        fn resumes_from_saved_state(n in 1u64..3000, seed in any::<u64>(), k in 0usize..5000) {
            let mut p = Permutation::new(n, seed);
            for _ in 0..k {
                p.next_position();
            }
            let saved = p;
            let mut q = saved;
            prop_assert_eq!(q.peek(), q.next_position());
            let mut p2 = saved;
            for _ in 0..50 {
                prop_assert_eq!(p.next_position(), p2.next_position());
            }
        }
    }

    /// Different seeds give different orders (the walk jumps around).
    #[test]
    fn seeds_differ() {
        let a: Vec<u64> = {
            let mut p = Permutation::new(1000, 1);
            (0..20).map(|_| p.next_position()).collect()
        };
        let b: Vec<u64> = {
            let mut p = Permutation::new(1000, 2);
            (0..20).map(|_| p.next_position()).collect()
        };
        assert_ne!(a, b);
        assert!(a.windows(2).filter(|w| w[1] == w[0] + 1).count() < 5, "{a:?} is nearly sequential");
    }
}
