//! Fitting a plan to a budget: the largest per-layer expert capacities (and, if allowed, the
//! longest context) whose maximum fits, or a [`QmoeError::DoesNotFit`] naming the component
//! that does not.

use super::bytes::format_bytes;
use super::{moe_layers, plan_err, Component, ComponentBytes, ExpertStorage, Plan, PlanOptions};
use crate::models::FfnSpec;
use crate::residency::Resident;
use crate::QmoeError;

/// Default fraction of the budget [`Plan::fit`] holds back on top of every range's maximum.
pub const DEFAULT_MARGIN: f64 = 0.02;

/// The order in which a refusal adds components up: the runtime and the weights first (in the
/// order they are loaded), then what the context, the chunk size and the residency change.
const FIT_ORDER: [Component; 7] = [
    Component::RuntimeOverhead,
    Component::NonExpertWeights,
    Component::PackSource,
    Component::KvCache,
    Component::Workspace,
    Component::Staging,
    Component::ExpertCache,
];

/// How [`Plan::fit`] chooses.
#[derive(Clone, Debug, PartialEq)]
pub struct FitOptions {
    /// One weight per MoE layer (e.g. its recorded misses): heavier layers get spare slots
    /// first, in proportion to their weight; `None`: all layers alike.
    pub weights: Option<Vec<f64>>,
    /// Reduce the context when top-k slots per layer do not fit at the requested one.
    pub allow_ctx_reduction: bool,
    /// Fraction of the budget held back on top of every component's maximum.
    pub margin: f64,
}

impl Default for FitOptions {
    fn default() -> Self {
        Self {
            weights: None,
            allow_ctx_reduction: false,
            margin: DEFAULT_MARGIN,
        }
    }
}

/// The result of [`Plan::fit`].
#[derive(Clone, Debug)]
pub struct Fit {
    /// The chosen plan: its residency and context.
    pub plan: Plan,
    /// The budget fitted to.
    pub budget: u64,
    /// Bytes held back as margin.
    pub margin_bytes: u64,
    /// The context that was asked for (the plan's is smaller when it was reduced).
    pub requested_ctx: usize,
}

impl Fit {
    /// Whether the context was reduced to fit.
    pub fn ctx_reduced(&self) -> bool {
        self.plan.ctx() < self.requested_ctx
    }

    /// Budget left after the margin and the plan's maximum.
    pub fn headroom(&self) -> u64 {
        (self.budget - self.margin_bytes).saturating_sub(self.plan.total().max)
    }
}

impl Plan {
    /// Checks that this exact plan fits `budget` with `margin` (a fraction of the budget) held
    /// back on top of every component's maximum; otherwise [`QmoeError::DoesNotFit`] naming the
    /// component that does not fit, with the breakdown and the smallest budget that fits this
    /// plan ([`QmoeError::Plan`] for a zero budget or a margin outside `[0, 1)`).
    pub fn admit(&self, budget: u64, margin: f64) -> Result<(), QmoeError> {
        let usable = usable_budget(budget, margin)?;
        if self.total().max <= usable {
            return Ok(());
        }
        Err(self.refusal(
            budget,
            usable,
            &format!(
                "this plan needs a budget of at least {}",
                format_bytes(needed_budget(self.total().max, margin))
            ),
        ))
    }

    /// The largest per-layer expert capacities whose maximum total fits `budget`, or a refusal.
    ///
    /// Full residency is taken when it fits. Otherwise every MoE layer gets its top-k slots and
    /// the remaining budget is dealt out one slot at a time to the layer with the highest
    /// `weight / (extra slots + 1)` (equal weights: round-robin, so capacities differ by at most
    /// one). Partial residency only helps where it costs less than full residency: not for
    /// dense experts, and not for INT4 experts on the CPU, where the pack is in memory anyway
    /// and a slot arena only adds to it; there the fit is full residency or nothing.
    ///
    /// When even the cheapest plan does not fit, the context is reduced to the largest that fits
    /// if [`FitOptions::allow_ctx_reduction`]; otherwise the error is
    /// [`QmoeError::DoesNotFit`]: the component that does not fit, with the breakdown of the
    /// cheapest plan, the smallest budget that holds it, and the largest context within this
    /// budget; when no context fits, the component and breakdown are those of the cheapest plan
    /// at ctx 1. Bad options (layer weights, margin, a zero budget) are [`QmoeError::Plan`].
    pub fn fit(&self, budget: u64, opts: &FitOptions) -> Result<Fit, QmoeError> {
        let usable = usable_budget(budget, opts.margin)?;
        let moe = moe_layers(&self.spec);
        let weights = match &opts.weights {
            None => vec![1.0; moe.len()],
            Some(w) if w.len() != moe.len() => {
                return Err(plan_err(format!(
                    "{} layer weights given for {} MoE layers",
                    w.len(),
                    moe.len()
                )))
            }
            Some(w) if w.iter().any(|x| !(x.is_finite() && *x >= 0.0)) => {
                return Err(plan_err(format!(
                    "layer weights must be finite and non-negative, got {w:?}"
                )))
            }
            Some(w) => w.clone(),
        };
        let fit = |plan| Fit {
            plan,
            budget,
            margin_bytes: budget - usable,
            requested_ctx: self.ctx,
        };
        if let Some(plan) = self.fit_at(self.ctx, usable, &weights)? {
            return Ok(fit(plan));
        }
        let largest_ctx = self.largest_ctx(usable)?;
        if let (true, Some(ctx)) = (opts.allow_ctx_reduction, largest_ctx) {
            if let Some(plan) = self.fit_at(ctx, usable, &weights)? {
                return Ok(fit(plan));
            }
        }
        let minimal = self.smallest(self.ctx)?;
        let need = needed_budget(minimal.total().max, opts.margin);
        let mut advice = format!(
            "a budget of at least {} at ctx {}",
            format_bytes(need),
            self.ctx
        );
        advice += &match largest_ctx {
            Some(c) if opts.allow_ctx_reduction => format!("; ctx {c} fits this budget"),
            Some(c) => format!(
                ", or ctx ≤ {c} within this budget (allow context reduction: \
                 --allow-ctx-reduction)"
            ),
            None => format!(
                "; no context length fits {}: the breakdown above is at ctx 1, where the \
                 context costs least",
                format_bytes(budget)
            ),
        };
        // When no context fits, name what does not fit even at the smallest one: shortening
        // the context cannot help the component a plan at the requested context would name.
        let refused = match largest_ctx {
            None if self.ctx > 1 => self.smallest(1)?,
            _ => minimal,
        };
        Err(refused.refusal(budget, usable, &advice))
    }

    /// The same model and options at another context and residency.
    fn variant(&self, ctx: usize, residency: Resident) -> Result<Self, QmoeError> {
        let options = PlanOptions {
            ctx: Some(ctx),
            residency,
            ..self.options.clone()
        };
        Self::estimate(&self.spec, &options)
    }

    /// The cheapest plan at `ctx`: top-k slots per MoE layer, or full residency where that
    /// costs less (dense experts; INT4 experts on the CPU, whose pack is in memory anyway).
    fn smallest(&self, ctx: usize) -> Result<Self, QmoeError> {
        let full = self.variant(ctx, Resident::All)?;
        if matches!(self.options.experts, ExpertStorage::Dense(_)) {
            return Ok(full);
        }
        let top_k = self
            .spec
            .layers
            .iter()
            .map(|l| match l {
                FfnSpec::Moe(m) => m.top_k,
                FfnSpec::Dense { .. } => 0,
            })
            .collect();
        let top_k = self.variant(ctx, Resident::PerLayer(top_k))?;
        Ok(match top_k.total().max < full.total().max {
            true => top_k,
            false => full,
        })
    }

    /// The plan at `ctx` with the largest capacities within `usable` bytes, if any fits.
    fn fit_at(&self, ctx: usize, usable: u64, weights: &[f64]) -> Result<Option<Self>, QmoeError> {
        let full = self.variant(ctx, Resident::All)?;
        if full.total().max <= usable {
            return Ok(Some(full));
        }
        let minimal = self.smallest(ctx)?;
        let Some(mut free) = usable.checked_sub(minimal.total().max) else {
            return Ok(None);
        };
        if minimal.resident == full.resident {
            return Ok(None);
        }
        let moe = moe_layers(&self.spec);
        let mut slots = minimal.resident.clone();
        let cost: Vec<u64> = moe
            .iter()
            .map(|&(_, m)| {
                self.options
                    .experts
                    .expert_bytes(self.spec.hidden_size, m.intermediate_size)
            })
            .collect();
        let extra = |j: usize, slots: &[usize]| slots[moe[j].0] - moe[j].1.top_k;
        loop {
            let next = (0..moe.len())
                .filter(|&j| slots[moe[j].0] < moe[j].1.num_experts && cost[j] <= free)
                .max_by(|&a, &b| {
                    let pa = weights[a] / (extra(a, &slots) + 1) as f64;
                    let pb = weights[b] / (extra(b, &slots) + 1) as f64;
                    pa.total_cmp(&pb)
                        .then(extra(b, &slots).cmp(&extra(a, &slots)))
                        .then(b.cmp(&a))
                });
            let Some(j) = next else { break };
            slots[moe[j].0] += 1;
            free -= cost[j];
        }
        Ok(Some(self.variant(ctx, Resident::PerLayer(slots))?))
    }

    /// The largest context below the requested one at which the cheapest plan fits.
    fn largest_ctx(&self, usable: u64) -> Result<Option<usize>, QmoeError> {
        let fits = |ctx: usize| -> Result<bool, QmoeError> {
            Ok(self.smallest(ctx)?.total().max <= usable)
        };
        if self.ctx <= 1 || !fits(1)? {
            return Ok(None);
        }
        // Invariant: `lo` fits, `hi` does not.
        let (mut lo, mut hi) = (1, self.ctx);
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Ok(Some(lo))
    }

    /// The error for a plan whose maximum exceeds `usable`: adds the components up in
    /// [`FIT_ORDER`] and names the first one that crosses the budget.
    fn refusal(&self, budget: u64, usable: u64, advice: &str) -> QmoeError {
        let mut ordered: Vec<&ComponentBytes> = self.components.iter().collect();
        ordered.sort_by_key(|c| FIT_ORDER.iter().position(|&n| n == c.component));
        // The total exceeds `usable`, so some component crosses it; every plan has components.
        let crossing = ordered
            .iter()
            .scan(0u64, |used, c| {
                *used = used.saturating_add(c.bytes.max);
                Some(*used > usable)
            })
            .position(|crossed| crossed)
            .unwrap_or(ordered.len() - 1);
        let (before, culprit) = (&ordered[..crossing], ordered[crossing]);
        let used: u64 = before.iter().map(|c| c.bytes.max).sum();
        let loaded: Vec<String> = before
            .iter()
            .filter(|c| c.bytes.max > 0)
            .map(|c| format!("{} {}", c.component, format_bytes(c.bytes.max)))
            .collect();
        let after = match loaded.is_empty() {
            true => String::new(),
            false => format!(" after {}", loaded.join(", ")),
        };
        QmoeError::DoesNotFit {
            component: culprit.component,
            needed: culprit.bytes.max,
            available: usable - used,
            breakdown: format!(
                "a budget of {} ({} after the margin) does not fit {}{after}.\nbreakdown ({}):\n\
                 {}what would fit: {advice}",
                format_bytes(budget),
                format_bytes(usable),
                self.spec.model_type,
                self.summary(),
                self.table(Some(budget)),
            ),
        }
    }
}

/// The budget minus the margin; an error for a margin outside `[0, 1)` or a zero budget.
fn usable_budget(budget: u64, margin: f64) -> Result<u64, QmoeError> {
    if !(0.0..1.0).contains(&margin) {
        return Err(plan_err(format!(
            "margin {margin} must be a fraction of the budget in [0, 1)"
        )));
    }
    if budget == 0 {
        return Err(plan_err("the budget must be greater than zero"));
    }
    Ok(budget - (budget as f64 * margin).ceil() as u64)
}

/// The smallest budget whose usable part (after `margin`) holds `bytes`.
fn needed_budget(bytes: u64, margin: f64) -> u64 {
    let mut budget = (bytes as f64 / (1.0 - margin)).ceil() as u64;
    while budget < u64::MAX && usable_budget(budget, margin).is_ok_and(|u| u < bytes) {
        budget += 1;
    }
    budget
}
