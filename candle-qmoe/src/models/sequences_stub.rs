//! **TEMPORARY STUB** of the multi-sequence forward API (`SequenceCache`, `SequenceInput`,
//! `MoeForCausalLm::forward_sequences`, `ExpertTraffic`), with the real signatures and a naive
//! body, so that the `server` example builds and is tested before the real implementation lands;
//! this file is deleted when it is merged.
//!
//! A [`SequenceCache`] here holds only the sequence's token ids; [`MoeForCausalLm::forward_sequences`]
//! runs each item alone: it clears the model's own KV cache and runs the item's whole history
//! (plus its new tokens) through [`MoeForCausalLm::forward`]. [`MoeForCausalLm::expert_traffic`]
//! returns zeros.

use candle::Tensor;

use super::MoeForCausalLm;
use crate::generation::{prefill, PREFILL_CHUNK};

/// The KV caches of one sequence, for every layer of a model (stub: its token ids).
#[derive(Clone, Debug, Default)]
pub struct SequenceCache {
    tokens: Vec<u32>,
}

impl SequenceCache {
    /// Tokens cached (the next token's position).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether no token is cached.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// KV bytes held (stub: 0).
    pub fn allocated_bytes(&self) -> usize {
        0
    }
}

/// One sequence's part of a step: its cache and the tokens to append (1 for decode, a chunk for
/// prefill).
pub struct SequenceInput<'a> {
    /// The sequence's cache.
    pub cache: &'a mut SequenceCache,
    /// The tokens to append.
    pub tokens: &'a [u32],
}

/// Counters of the routed experts' work (cumulative, all MoE layers; stub: zeros).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct ExpertTraffic {
    /// MoE block calls.
    pub calls: u64,
    /// Tokens routed (sum over calls).
    pub tokens: u64,
    /// Distinct experts computed, summed over calls.
    pub experts_read: u64,
    /// Their weight bytes (each distinct expert's slab once per call).
    pub bytes_read: u64,
}

impl MoeForCausalLm {
    /// An empty sequence.
    pub fn new_sequence(&self) -> SequenceCache {
        SequenceCache::default()
    }

    /// Each item's last-position logits `[vocab]` (F32), in item order, after appending its
    /// tokens; on error no cache is changed (stub: each item re-runs its whole history alone).
    pub fn forward_sequences(
        &mut self,
        batch: &mut [SequenceInput<'_>],
    ) -> candle::Result<Vec<Tensor>> {
        let mut histories = Vec::with_capacity(batch.len());
        let mut logits = Vec::with_capacity(batch.len());
        for item in batch.iter() {
            let history = [item.cache.tokens.as_slice(), item.tokens].concat();
            self.clear_kv_cache();
            logits.push(prefill(self, &history, PREFILL_CHUNK)?);
            histories.push(history);
        }
        self.clear_kv_cache();
        for (item, history) in batch.iter_mut().zip(histories) {
            item.cache.tokens = history;
        }
        Ok(logits)
    }

    /// Cumulative expert traffic of all MoE blocks since load (stub: zeros).
    pub fn expert_traffic(&self) -> ExpertTraffic {
        ExpertTraffic::default()
    }
}
