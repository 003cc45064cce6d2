//! Eviction policies of the expert cache: [`Lru`] (the default), [`Lfu`] and [`Lfru`] behind the
//! [`EvictionPolicy`] trait.
//!
//! A policy only orders experts; the store decides which experts may be evicted (resident and
//! not needed by the current step) and asks the policy for a victim among them. Every access gets
//! a fresh tick of a logical clock, so there are no ties in recency.

use std::str::FromStr;

use crate::QmoeError;

/// Chooses which resident expert to evict.
pub trait EvictionPolicy: Send + std::fmt::Debug {
    /// `expert` was used (a hit, or just copied in) at logical time `tick`.
    fn on_access(&mut self, expert: usize, tick: u64);
    /// `expert` left the cache.
    fn on_evict(&mut self, expert: usize);
    /// The expert to evict among `candidates` (non-empty, resident, evictable) at time `tick`.
    fn victim(&self, candidates: &[usize], tick: u64) -> usize;
}

/// The built-in policies, by name (`lru`, `lfu`, `lfru`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PolicyKind {
    /// Least recently used.
    #[default]
    Lru,
    /// Least frequently used since admission, ties broken by recency.
    Lfu,
    /// Least frequently *recently* used: a use count that halves every `half_life` accesses.
    Lfru,
}

impl PolicyKind {
    /// A fresh policy for a layer of `num_experts` experts.
    pub fn build(self, num_experts: usize) -> Box<dyn EvictionPolicy> {
        match self {
            Self::Lru => Box::new(Lru::new(num_experts)),
            Self::Lfu => Box::new(Lfu::new(num_experts)),
            Self::Lfru => Box::new(Lfru::new(num_experts, LFRU_HALF_LIFE)),
        }
    }
}

impl FromStr for PolicyKind {
    type Err = QmoeError;
    fn from_str(s: &str) -> Result<Self, QmoeError> {
        match s.to_ascii_lowercase().as_str() {
            "lru" => Ok(Self::Lru),
            "lfu" => Ok(Self::Lfu),
            "lfru" => Ok(Self::Lfru),
            other => Err(QmoeError::unsupported(
                "eviction policy",
                other,
                "is not supported (expected lru, lfu or lfru)",
            )),
        }
    }
}

/// Accesses after which an [`Lfru`] count has halved.
pub const LFRU_HALF_LIFE: f64 = 64.0;

/// The candidate with the smallest `key` (the first one on equal keys).
fn argmin_by<K: PartialOrd>(candidates: &[usize], key: impl Fn(usize) -> K) -> usize {
    let mut best = candidates[0];
    let mut best_key = key(best);
    for &c in &candidates[1..] {
        let k = key(c);
        if k < best_key {
            (best, best_key) = (c, k);
        }
    }
    best
}

/// Least recently used.
#[derive(Clone, Debug)]
pub struct Lru {
    last: Vec<u64>,
}

impl Lru {
    /// For `num_experts` experts.
    pub fn new(num_experts: usize) -> Self {
        Self {
            last: vec![0; num_experts],
        }
    }
}

impl EvictionPolicy for Lru {
    fn on_access(&mut self, expert: usize, tick: u64) {
        self.last[expert] = tick;
    }
    fn on_evict(&mut self, _expert: usize) {}
    fn victim(&self, candidates: &[usize], _tick: u64) -> usize {
        argmin_by(candidates, |e| self.last[e])
    }
}

/// Least frequently used since admission; ties go to the least recently used.
#[derive(Clone, Debug)]
pub struct Lfu {
    count: Vec<u64>,
    last: Vec<u64>,
}

impl Lfu {
    /// For `num_experts` experts.
    pub fn new(num_experts: usize) -> Self {
        Self {
            count: vec![0; num_experts],
            last: vec![0; num_experts],
        }
    }
}

impl EvictionPolicy for Lfu {
    fn on_access(&mut self, expert: usize, tick: u64) {
        self.count[expert] += 1;
        self.last[expert] = tick;
    }
    fn on_evict(&mut self, expert: usize) {
        self.count[expert] = 0;
    }
    fn victim(&self, candidates: &[usize], _tick: u64) -> usize {
        argmin_by(candidates, |e| (self.count[e], self.last[e]))
    }
}

/// Least frequently recently used: each expert's use count decays by half every `half_life`
/// ticks, so experts that were popular long ago age out (LFU's weakness) while a burst of
/// one-off experts does not flush the steady ones (LRU's weakness).
#[derive(Clone, Debug)]
pub struct Lfru {
    score: Vec<f64>,
    last: Vec<u64>,
    half_life: f64,
}

impl Lfru {
    /// For `num_experts` experts, counts halving every `half_life` ticks.
    pub fn new(num_experts: usize, half_life: f64) -> Self {
        Self {
            score: vec![0.0; num_experts],
            last: vec![0; num_experts],
            half_life,
        }
    }

    fn decayed(&self, expert: usize, tick: u64) -> f64 {
        let age = tick.saturating_sub(self.last[expert]) as f64;
        self.score[expert] * (-age / self.half_life).exp2()
    }
}

impl EvictionPolicy for Lfru {
    fn on_access(&mut self, expert: usize, tick: u64) {
        self.score[expert] = self.decayed(expert, tick) + 1.0;
        self.last[expert] = tick;
    }
    fn on_evict(&mut self, expert: usize) {
        self.score[expert] = 0.0;
    }
    fn victim(&self, candidates: &[usize], tick: u64) -> usize {
        argmin_by(candidates, |e| (self.decayed(e, tick), self.last[e]))
    }
}
