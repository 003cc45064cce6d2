//! Counters of the expert cache ([`ResidencyStats`]).

use serde::Serialize;

/// What the expert cache did, per layer or summed over layers.
///
/// `h2d_bytes` counts the bytes copied into device slots after start-up (misses and
/// prefetches); the copies that fill the cache at start-up are `preload_bytes`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ResidencyStats {
    /// Routed experts a step found resident.
    pub hits: u64,
    /// Routed experts a step had to copy in (or compute from the host source).
    pub misses: u64,
    /// Resident experts evicted to make room.
    pub evictions: u64,
    /// Bytes copied host → device after start-up.
    pub h2d_bytes: u64,
    /// Bytes copied host → device at start-up (the initial fill).
    pub preload_bytes: u64,
    /// Experts copied in ahead of time by prefetch.
    pub prefetch_issued: u64,
    /// Prefetched experts that the next step used.
    pub prefetch_used: u64,
    /// Prefetched experts that the next step did not use.
    pub prefetch_wasted: u64,
    /// Missed experts computed on the CPU from the host source instead of being copied.
    pub hybrid_cpu_experts: u64,
    /// Seconds the compute waited for copies (host time spent in the copy path of a step).
    pub stall_s: f64,
    /// Slot-table generations published.
    pub generations: u64,
}

impl ResidencyStats {
    /// Adds `other`'s counters to these.
    pub fn add(&mut self, other: &Self) {
        self.hits += other.hits;
        self.misses += other.misses;
        self.evictions += other.evictions;
        self.h2d_bytes += other.h2d_bytes;
        self.preload_bytes += other.preload_bytes;
        self.prefetch_issued += other.prefetch_issued;
        self.prefetch_used += other.prefetch_used;
        self.prefetch_wasted += other.prefetch_wasted;
        self.hybrid_cpu_experts += other.hybrid_cpu_experts;
        self.stall_s += other.stall_s;
        self.generations += other.generations;
    }

    /// What happened between the snapshot `before` and these counters (e.g. the measured part
    /// of a run after its warm-up); counters never go below zero.
    pub fn since(&self, before: &Self) -> Self {
        Self {
            hits: self.hits.saturating_sub(before.hits),
            misses: self.misses.saturating_sub(before.misses),
            evictions: self.evictions.saturating_sub(before.evictions),
            h2d_bytes: self.h2d_bytes.saturating_sub(before.h2d_bytes),
            preload_bytes: self.preload_bytes.saturating_sub(before.preload_bytes),
            prefetch_issued: self.prefetch_issued.saturating_sub(before.prefetch_issued),
            prefetch_used: self.prefetch_used.saturating_sub(before.prefetch_used),
            prefetch_wasted: self.prefetch_wasted.saturating_sub(before.prefetch_wasted),
            hybrid_cpu_experts: self
                .hybrid_cpu_experts
                .saturating_sub(before.hybrid_cpu_experts),
            stall_s: (self.stall_s - before.stall_s).max(0.0),
            generations: self.generations.saturating_sub(before.generations),
        }
    }

    /// Hits over routed experts looked up, `None` before any lookup.
    pub fn hit_rate(&self) -> Option<f64> {
        let n = self.hits + self.misses;
        (n > 0).then(|| self.hits as f64 / n as f64)
    }
}
