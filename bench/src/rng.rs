//! A small seeded random number generator (SplitMix64) and the
//! distributions the workloads draw from. Written here so a seed means the
//! same run on every machine and every version of every dependency.

/// SplitMix64: tiny, fast, and good enough for workload shapes.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// An independent stream derived from this seed and `key` (e.g. one per
    /// agent), so adding an agent never shifts another agent's draws.
    pub fn derive(seed: u64, key: u64) -> Self {
        let mut r = Rng(seed ^ key.wrapping_mul(0xD1B5_4A32_D192_ED03));
        r.next_u64();
        r
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    pub fn chance(&mut self, p: f64) -> bool {
        self.f64() < p
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.f64().max(f64::MIN_POSITIVE);
        let u2 = self.f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Lognormal with the given median and shape `sigma`.
    pub fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        median * (sigma * self.normal()).exp()
    }

    /// Index drawn with probability proportional to `weights`.
    pub fn weighted(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().sum();
        let mut x = self.f64() * total;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                return i;
            }
            x -= w;
        }
        weights.len().saturating_sub(1)
    }
}

/// Zipf-like popularity weights `1 / (i + 1)^s` for `n` items.
pub fn zipf_weights(n: usize, s: f64) -> Vec<f64> {
    (0..n).map(|i| 1.0 / ((i + 1) as f64).powf(s)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_streams_repeat_and_differ() {
        let a: Vec<u64> = (0..5).map(|_| Rng::new(7).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        let mut x = Rng::derive(7, 1);
        let mut y = Rng::derive(7, 2);
        assert_ne!(x.next_u64(), y.next_u64());
    }

    #[test]
    fn distributions_have_their_shape() {
        let mut r = Rng::new(42);
        let mut draws: Vec<f64> = (0..20_001).map(|_| r.lognormal(1500.0, 0.8)).collect();
        draws.sort_by(f64::total_cmp);
        let median = draws[10_000];
        assert!((1350.0..1650.0).contains(&median), "median {median}");
        let counts = (0..10_000).fold([0usize; 3], |mut c, _| {
            c[r.weighted(&[0.5, 0.3, 0.2])] += 1;
            c
        });
        assert!(counts[0] > counts[1] && counts[1] > counts[2], "{counts:?}");
        assert!((0..1000).all(|_| r.below(3) < 3));
    }
}
