//! Order statistics over samples (milliseconds, requests, bytes): nearest-rank percentiles,
//! so a p95 over 30 runs is an observed run, never an interpolation.

/// A summary of samples.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// 50th percentile.
    pub median: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
    /// Arithmetic mean.
    pub mean: f64,
}

/// The nearest-rank `p`-th percentile (0 < p ≤ 100) of `sorted` (ascending, non-empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl Summary {
    /// Summarises `samples` (any order); `None` when there are none.
    pub fn of(samples: &[f64]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        let mut s = samples.to_vec();
        s.sort_by(f64::total_cmp);
        Some(Self {
            n: s.len(),
            median: percentile(&s, 50.0),
            p95: percentile(&s, 95.0),
            p99: percentile(&s, 99.0),
            min: s[0],
            max: s[s.len() - 1],
            mean: s.iter().sum::<f64>() / s.len() as f64,
        })
    }

    /// `median / p95` in milliseconds, e.g. `312.4 / 340.1 ms`.
    pub fn ms_median_p95(&self) -> String {
        format!("{:.1} / {:.1} ms", self.median, self.p95)
    }

    /// `median / p95` in milliseconds, each with its sign (an overhead can be negative).
    pub fn signed_ms_median_p95(&self) -> String {
        format!("{:+.1} / {:+.1} ms", self.median, self.p95)
    }

    /// `median / p99` in milliseconds.
    pub fn ms_median_p99(&self) -> String {
        format!("{:.1} / {:.1} ms", self.median, self.p99)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nearest rank: over 1..=30 the median is 15, the p95 is 29 and the p99 is 30.
    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=30).rev().map(f64::from).collect();
        let s = Summary::of(&v).unwrap();
        assert_eq!((s.median, s.p95, s.p99), (15.0, 29.0, 30.0));
        assert_eq!((s.min, s.max, s.n), (1.0, 30.0, 30));
        assert_eq!(Summary::of(&[]), None);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
    }
}
