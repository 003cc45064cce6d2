//! Where a forward pass's time goes: an opt-in, process-wide tally of wall time per part of the
//! model (projections, attention, routers, routed experts, the output head, …).
//!
//! Off by default, when each timed part costs one relaxed atomic load. [`enable`] turns it on;
//! [`snapshot`] reads the running totals and [`Profile::since`] subtracts an earlier snapshot, so
//! that a caller times a phase (e.g. decoding, in [`crate::generation::generate`]). The parts do
//! not nest, so their times add up to at most the wall time of the passes they cover; what is left
//! over is everything between them (the embedding lookup, tensor bookkeeping, sampling).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A part of a forward pass that [`time`] measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Part {
    /// The q, k and v projections.
    QkvProjection,
    /// q/k norm, rotary embedding, the KV cache and the attention itself.
    Attention,
    /// The attention's output projection.
    OutputProjection,
    /// The layers' RMS norms and residual additions.
    NormsAndResiduals,
    /// The MoE routers: logits, softmax, top-k.
    Router,
    /// The routed experts.
    RoutedExperts,
    /// Shared experts (Qwen MoE).
    SharedExpert,
    /// The MLP of dense layers.
    DenseMlp,
    /// The final norm and the output head (`lm_head`).
    LmHead,
}

impl Part {
    /// Every part, in the order of a forward pass.
    pub const ALL: [Self; 9] = [
        Self::QkvProjection,
        Self::Attention,
        Self::OutputProjection,
        Self::NormsAndResiduals,
        Self::Router,
        Self::RoutedExperts,
        Self::SharedExpert,
        Self::DenseMlp,
        Self::LmHead,
    ];

    /// The name in reports and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::QkvProjection => "qkv_projection",
            Self::Attention => "attention",
            Self::OutputProjection => "output_projection",
            Self::NormsAndResiduals => "norms_and_residuals",
            Self::Router => "router",
            Self::RoutedExperts => "routed_experts",
            Self::SharedExpert => "shared_expert",
            Self::DenseMlp => "dense_mlp",
            Self::LmHead => "lm_head",
        }
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; Part::ALL.len()] = [const { AtomicU64::new(0) }; Part::ALL.len()];
static CALLS: [AtomicU64; Part::ALL.len()] = [const { AtomicU64::new(0) }; Part::ALL.len()];

/// Turns the tally on or off for the whole process.
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether the tally is on.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Runs `f`, adding its wall time to `part` when the tally is on.
#[inline]
pub fn time<R>(part: Part, f: impl FnOnce() -> R) -> R {
    if !enabled() {
        return f();
    }
    let start = Instant::now();
    let out = f();
    let nanos = start.elapsed().as_nanos().try_into().unwrap_or(u64::MAX);
    NANOS[part as usize].fetch_add(nanos, Ordering::Relaxed);
    CALLS[part as usize].fetch_add(1, Ordering::Relaxed);
    out
}

/// Running totals per part, or their difference between two snapshots.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Profile {
    totals: [(Duration, u64); Part::ALL.len()],
}

impl Profile {
    /// The time and number of calls of `part`.
    pub fn get(&self, part: Part) -> (Duration, u64) {
        self.totals[part as usize]
    }

    /// The totals since `earlier`, a snapshot taken before this one.
    pub fn since(&self, earlier: &Profile) -> Profile {
        let mut totals = self.totals;
        for ((time, calls), (t0, c0)) in totals.iter_mut().zip(&earlier.totals) {
            *time = time.saturating_sub(*t0);
            *calls = calls.saturating_sub(*c0);
        }
        Profile { totals }
    }

    /// These totals and `other`'s added (e.g. the decoding of several responses).
    pub fn plus(&self, other: &Profile) -> Profile {
        let mut totals = self.totals;
        for ((time, calls), (t, c)) in totals.iter_mut().zip(&other.totals) {
            *time += *t;
            *calls += c;
        }
        Profile { totals }
    }

    /// The time of every part together.
    pub fn total(&self) -> Duration {
        self.totals.iter().map(|(t, _)| *t).sum()
    }

    /// The parts that were called, in forward order, with their time and calls.
    pub fn parts(&self) -> impl Iterator<Item = (Part, Duration, u64)> + '_ {
        Part::ALL
            .into_iter()
            .map(|p| {
                let (time, calls) = self.get(p);
                (p, time, calls)
            })
            .filter(|(_, _, calls)| *calls > 0)
    }
}

/// The running totals now.
pub fn snapshot() -> Profile {
    let mut totals = [(Duration::ZERO, 0); Part::ALL.len()];
    for (i, t) in totals.iter_mut().enumerate() {
        *t = (
            Duration::from_nanos(NANOS[i].load(Ordering::Relaxed)),
            CALLS[i].load(Ordering::Relaxed),
        );
    }
    Profile { totals }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_only_while_enabled_and_subtracts_snapshots() {
        // Only this test turns the tally on, so nothing counts while it is off; while it is on,
        // another test running a model in parallel may add calls (checked as "at least").
        let before = snapshot();
        enable(false);
        assert_eq!(time(Part::DenseMlp, || 7), 7);
        assert_eq!(snapshot().since(&before).get(Part::DenseMlp).1, 0);
        enable(true);
        let sleep = Duration::from_millis(5);
        time(Part::DenseMlp, || std::thread::sleep(sleep));
        time(Part::DenseMlp, || std::thread::sleep(sleep));
        enable(false);
        let d = snapshot().since(&before);
        let (t, calls) = d.get(Part::DenseMlp);
        assert!(calls >= 2 && t >= 2 * sleep, "{calls} calls, {t:?}");
        assert!(d.total() >= t);
        assert!(d.parts().any(|(p, ..)| p == Part::DenseMlp));
        assert_eq!(d.plus(&d).get(Part::DenseMlp), (2 * t, 2 * calls));
        assert_eq!(d.since(&d), Profile::default());
    }
}
