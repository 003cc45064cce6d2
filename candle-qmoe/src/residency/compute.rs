//! [`ExpertCompute`]: the part of resident experts that differs between memory backends — how
//! a step's experts are computed from the arena — and the [`Split`] of a step into [`Piece`]s
//! whose experts fit the cache at once.

use std::ops::Range;

use candle::Tensor;

use super::device::MemoryBackend;
use super::experts::{CostModel, ResidentExperts};
use crate::kernels::RoutePlan;

/// How a [`MemoryBackend`] computes routed experts from its slots; [`ResidentExperts`] does the
/// rest (locking, the hybrid decision, the split into pieces, residency and retirement).
pub trait ExpertCompute: MemoryBackend + Sized {
    /// How a step that needs more experts than the cache holds is split.
    const SPLIT: Split;

    /// Bandwidths the hybrid decision compares (measured on first use).
    fn cost_model(&self) -> CostModel;

    /// The weighted sum of the routed experts' outputs for a call whose shapes are checked,
    /// served through [`ResidentExperts::serve`]; the result has the dtype of `xs`.
    fn forward_resident(
        experts: &ResidentExperts<Self>,
        xs: &Tensor,
        expert_ids: &Tensor,
        weights: &Tensor,
    ) -> candle::Result<Tensor>;
}

/// How a step is split so that each piece's cached experts fit the cache at once; every split
/// leaves each token's output bit-identical to one unsplit call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Runs of ascending experts over all tokens, for kernels that continue each output sum
    /// where the previous piece stopped (the CPU kernel): every expert is copied in at most
    /// once per step. A step always has at least one piece (which publishes pending copies).
    Experts,
    /// Runs of consecutive tokens with all their experts, for kernels that write whole outputs
    /// (the CUDA kernels). A step of zero tokens has no piece.
    Tokens,
}

/// One part of a step: the routed slots of `plan.groups[groups]` whose token is in `tokens`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The tokens covered (all of them for [`Split::Experts`]).
    pub tokens: Range<usize>,
    /// The indices of the plan's groups covered (all of them for [`Split::Tokens`]).
    pub groups: Range<usize>,
    /// The piece's experts that are read from the cache (those not computed from the host
    /// source), ascending; at most the cache's capacity.
    pub cached: Vec<usize>,
}

impl Piece {
    /// The piece's routed slots of `plan`, grouped by expert.
    pub fn routes(&self, plan: &RoutePlan) -> RoutePlan {
        let k = plan.top_k;
        let groups = plan.groups[self.groups.clone()].iter();
        RoutePlan {
            top_k: k,
            tokens: plan.tokens,
            groups: match self.tokens == (0..plan.tokens) {
                true => groups.cloned().collect(),
                false => groups
                    .map(|(e, slots)| {
                        let s = slots.iter().copied();
                        (*e, s.filter(|s| self.tokens.contains(&(s / k))).collect())
                    })
                    .filter(|(_, slots): &(usize, Vec<usize>)| !slots.is_empty())
                    .collect(),
            },
        }
    }
}

impl Split {
    /// The pieces of a step routed by `plan`, where experts marked in `on_cpu` are computed
    /// from the host source (they take no slot) and at most `capacity` (≥ top-k) others fit.
    pub fn pieces(self, plan: &RoutePlan, on_cpu: &[bool], capacity: usize) -> Vec<Piece> {
        match self {
            Self::Experts => expert_runs(plan, on_cpu, capacity),
            Self::Tokens => token_runs(plan, on_cpu, capacity),
        }
    }
}

/// [`Split::Experts`]: a piece ends before the group whose expert would overfill the cache.
fn expert_runs(plan: &RoutePlan, on_cpu: &[bool], capacity: usize) -> Vec<Piece> {
    let all_tokens = 0..plan.tokens;
    let mut pieces = Vec::new();
    let (mut first, mut cached) = (0, Vec::new());
    for (i, &(e, _)) in plan.groups.iter().enumerate() {
        if on_cpu[e] {
            continue;
        }
        if cached.len() == capacity {
            pieces.push(Piece {
                tokens: all_tokens.clone(),
                groups: first..i,
                cached: std::mem::take(&mut cached),
            });
            first = i;
        }
        cached.push(e);
    }
    pieces.push(Piece {
        tokens: all_tokens,
        groups: first..plan.groups.len(),
        cached,
    });
    pieces
}

/// [`Split::Tokens`]: a piece ends before the token whose experts would overfill the cache.
fn token_runs(plan: &RoutePlan, on_cpu: &[bool], capacity: usize) -> Vec<Piece> {
    let (t, k) = (plan.tokens, plan.top_k);
    let mut rows = vec![0; t * k];
    for (e, slots) in &plan.groups {
        for &s in slots {
            rows[s] = *e;
        }
    }
    let mut pieces = Vec::new();
    let mut start = 0;
    while start < t {
        let mut wanted = vec![false; on_cpu.len()];
        let (mut count, mut end) = (0, start);
        while end < t {
            let row = || rows[end * k..(end + 1) * k].iter().filter(|&&e| !on_cpu[e]);
            let new = row().filter(|&&e| !wanted[e]).count();
            if count + new > capacity {
                break;
            }
            row().for_each(|&e| wanted[e] = true);
            count += new;
            end += 1;
        }
        pieces.push(Piece {
            tokens: start..end,
            groups: 0..plan.groups.len(),
            cached: (0..on_cpu.len()).filter(|&e| wanted[e]).collect(),
        });
        start = end;
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plan of 7 tokens, top-2, over 6 experts: every token routes to `t % 6` and `(t + 3) % 6`.
    fn plan() -> RoutePlan {
        let ids: Vec<u32> = (0..7u32).flat_map(|t| [t % 6, (t + 3) % 6]).collect();
        RoutePlan::new(&ids, 2, 6).unwrap()
    }

    /// Each routed slot lies in exactly one piece, and each piece's cached experts are the
    /// sorted, distinct experts it reads that are not on the CPU, within the capacity.
    fn check(split: Split, on_cpu: &[bool], capacity: usize) -> Vec<Piece> {
        let plan = plan();
        let pieces = split.pieces(&plan, on_cpu, capacity);
        let mut seen = vec![0; plan.tokens * plan.top_k];
        for p in &pieces {
            let read: Vec<usize> = p.routes(&plan).experts().filter(|&e| !on_cpu[e]).collect();
            assert_eq!(read, p.cached, "{split:?} {p:?}");
            assert!(p.cached.len() <= capacity, "{split:?} {p:?}");
            for (_, slots) in p.routes(&plan).groups {
                slots.iter().for_each(|&s| seen[s] += 1);
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{split:?}: {seen:?}");
        pieces
    }

    #[test]
    fn expert_runs_fill_the_cache_in_ascending_order() {
        let pieces = check(Split::Experts, &[false; 6], 4);
        let cached: Vec<_> = pieces.iter().map(|p| p.cached.clone()).collect();
        assert_eq!(cached, [vec![0, 1, 2, 3], vec![4, 5]]);
        // Experts on the CPU take no slot but stay in order within their piece.
        let on_cpu = [false, true, false, false, true, false];
        let pieces = check(Split::Experts, &on_cpu, 2);
        let groups: Vec<_> = pieces.iter().map(|p| p.groups.clone()).collect();
        assert_eq!(groups, [0..3, 3..6]);
    }

    #[test]
    fn token_runs_end_before_an_overfull_token() {
        let pieces = check(Split::Tokens, &[false; 6], 4);
        let tokens: Vec<_> = pieces.iter().map(|p| p.tokens.clone()).collect();
        assert_eq!(tokens, [0..2, 2..4, 4..6, 6..7]);
        let pieces = check(Split::Tokens, &[true, false, false, true, false, false], 2);
        assert_eq!(pieces.len(), 4);
    }

    #[test]
    fn an_empty_step_has_one_expert_run_and_no_token_run() {
        let plan = RoutePlan::new(&[], 2, 6).unwrap();
        let experts = Split::Experts.pieces(&plan, &[false; 6], 2);
        assert_eq!(experts.len(), 1);
        assert!(experts[0].cached.is_empty());
        assert!(Split::Tokens.pieces(&plan, &[false; 6], 2).is_empty());
    }
}
