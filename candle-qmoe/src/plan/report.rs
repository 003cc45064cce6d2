//! Plans in words: the component table and the one-line summary.

use std::fmt::Display;

use super::bytes::{format_bytes, ByteRange};
use super::{moe_layers, ExpertStorage, Plan};
use crate::models::ModelSpec;

impl Plan {
    /// The components as an aligned table: name, min, max and, with a budget, the max's share
    /// of it (`>1000%` beyond ten times it); a total row last.
    pub fn table(&self, budget: Option<u64>) -> String {
        // Shares beyond 10× the budget say nothing more than "far too large".
        let share = |bytes: u64| {
            budget.map_or(String::new(), |b| match 100.0 * bytes as f64 / b as f64 {
                s if s > 1000.0 => format!(" {:>8}", ">1000%"),
                s => format!(" {s:>7.1}%"),
            })
        };
        let row = |name: &dyn Display, bytes: ByteRange| {
            format!(
                "{name:<20} {:>12} {:>12}{}\n",
                format_bytes(bytes.min),
                format_bytes(bytes.max),
                share(bytes.max)
            )
        };
        let header = if budget.is_some() { "    share" } else { "" };
        let mut out = format!("{:<20} {:>12} {:>12}{header}\n", "component", "min", "max");
        for c in &self.components {
            out += &row(&c.component, c.bytes);
        }
        out + &row(&"total", self.total())
    }

    /// One line describing the model, target, context and residency.
    pub fn summary(&self) -> String {
        let o = &self.options;
        let experts = match o.experts {
            ExpertStorage::Int4(g) => format!("int4 g{}", g.get()),
            ExpertStorage::Dense(d) => format!("dense {d:?}"),
        };
        let per_sequence = if o.batch > 1 { " per sequence" } else { "" };
        format!(
            "{} on {}, {:?} compute, {experts} experts, ctx {}, batch {}, prefill chunk {}{}, \
             resident experts per layer {}",
            self.spec.model_type,
            o.target.name(),
            o.dtype,
            self.ctx,
            o.batch,
            o.prefill_chunk.min(self.ctx),
            per_sequence,
            describe_residency(&self.spec, &self.resident)
        )
    }
}

/// `resident` (per decoder layer) in words: `64 of 64 (all)`, `26 of 64` or `26–27 of 64`.
fn describe_residency(spec: &ModelSpec, resident: &[usize]) -> String {
    let moe = moe_layers(spec);
    let slots = moe.iter().map(|&(i, _)| resident[i]);
    let (Some(lo), Some(hi)) = (slots.clone().min(), slots.max()) else {
        return "none (no MoE layer)".into();
    };
    let experts = moe.iter().map(|&(_, m)| m.num_experts).max().unwrap_or(0);
    match (lo, hi) {
        _ if moe.iter().all(|&(i, m)| resident[i] == m.num_experts) => {
            format!("{experts} of {experts} (all)")
        }
        _ if lo == hi => format!("{lo} of {experts}"),
        _ => format!("{lo}–{hi} of {experts}"),
    }
}
