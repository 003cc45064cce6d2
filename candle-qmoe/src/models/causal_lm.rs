//! The model trunk every port shares: embeddings, decoder layers, final norm and `lm_head`.

use std::sync::Arc;

use candle::{DType, Device, Module, Tensor};
use candle_nn::{embedding, Embedding, VarBuilder};

use super::config::{ModelConfig, ModelSpec};
use super::experts::ExpertsLoader;
use super::layers::{
    causal_mask, fused_attention, scaled, DecoderLayer, FeedForward, KvStore, RmsNorm,
    RotaryEmbedding, SeqSpan,
};
use crate::linear::{activation_dtype, DenseLinear};
use crate::moe::ExpertTraffic;
use crate::pool;
use crate::profile;
use crate::{QmoeError, SparseMoe};

/// The KV caches of one sequence, for every layer of a model (made by
/// [`MoeForCausalLm::new_sequence`]; see [`MoeForCausalLm::forward_sequences`]).
#[derive(Clone, Debug)]
pub struct SequenceCache {
    layers: Vec<KvStore>,
    len: usize,
    shape: KvShape,
}

/// What a cache must match to be used with a model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct KvShape {
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl SequenceCache {
    fn new(shape: KvShape) -> Self {
        Self {
            layers: vec![KvStore::Empty; shape.layers],
            len: 0,
            shape,
        }
    }

    /// Tokens cached: the position of the sequence's next token.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes the keys and values of all layers hold allocated.
    pub fn allocated_bytes(&self) -> usize {
        self.layers.iter().map(KvStore::allocated_bytes).sum()
    }

    /// Bytes of keys and values per position over all layers: what a decoded token's attention
    /// reads per position of its context.
    pub fn bytes_per_position(&self) -> usize {
        self.layers.iter().map(KvStore::bytes_per_position).sum()
    }

    /// Drops every layer's positions from `self.len` on: undoes a failed step's appends. (If a
    /// layer could not be cut, which cannot happen, the sequence starts over.)
    fn roll_back(&mut self) {
        let len = self.len;
        if self.layers.iter_mut().any(|kv| kv.truncate(len).is_err()) {
            *self = Self::new(self.shape);
        }
    }
}

/// One sequence's part of a step: its cache and the tokens to append (1 to decode, a chunk of
/// the prompt to prefill).
#[derive(Debug)]
pub struct SequenceInput<'a> {
    /// The sequence's KV caches (from [`MoeForCausalLm::new_sequence`] of the same model).
    pub cache: &'a mut SequenceCache,
    /// The tokens to append, at positions `cache.len()..`.
    pub tokens: &'a [u32],
}

/// A sequence's part of a step as the trunk runs it: tokens `start..start + len` of the step.
struct Part<'a> {
    cache: &'a mut SequenceCache,
    start: usize,
    len: usize,
}

/// A decoder-only MoE causal LM (the layout of OLMoE, Qwen2-MoE, Qwen3-MoE and Mixtral) with a
/// KV cache.
///
/// [`Self::forward`] and its siblings run one sequence (or a batch of equal-length rows) over the
/// model's own cache; [`Self::forward_sequences`] runs several sequences, each with its own
/// [`SequenceCache`], in one pass. Both go through the same step.
///
/// Weights use the Hugging Face names (`model.embed_tokens`, `model.layers.{i}.*`, `model.norm`,
/// `lm_head`, absent when `tie_word_embeddings` makes it `embed_tokens`) and are kept in the VarBuilder's dtype; activations are in [`activation_dtype`] of
/// it (on the CPU, BF16 weights compute with F32 activations). MoE blocks are [`SparseMoe`] with
/// the routed experts an [`ExpertsLoader`] provides. Logits are returned in F32.
#[derive(Clone, Debug)]
pub struct MoeForCausalLm {
    spec: ModelSpec,
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: DenseLinear,
    cache: SequenceCache,
    dtype: DType,
    activations: DType,
    device: Device,
}

/// What one pass over the layers produced.
struct Pass {
    logits: Tensor,
    router_logits: Vec<Tensor>,
}

impl MoeForCausalLm {
    /// Builds the model from a config (a port's `Config`, [`super::AnyConfig`] or a
    /// [`ModelSpec`]), a VarBuilder over the checkpoint and the routed-experts source.
    pub fn new(
        cfg: &impl ModelConfig,
        vb: VarBuilder,
        experts: &dyn ExpertsLoader,
    ) -> candle::Result<Self> {
        let mut spec = cfg.spec()?;
        // As transformers 5: a checkpoint that stores its own `lm_head.weight` beside
        // `tie_word_embeddings: true` is not tied (transformers unties when the two differ;
        // when they are equal the stored copy gives the same logits). The model's spec says so.
        if spec.tie_word_embeddings && vb.contains_tensor("lm_head.weight") {
            spec.tie_word_embeddings = false;
        }
        let (dtype, device) = (vb.dtype(), vb.device().clone());
        let activations = activation_dtype(dtype, &device);
        let vb_m = vb.pp("model");
        let embed_tokens = embedding(spec.vocab_size, spec.hidden_size, vb_m.pp("embed_tokens"))?;
        let rotary = Arc::new(RotaryEmbedding::new(
            spec.rope_theta,
            spec.head_dim,
            spec.max_position_embeddings,
            activations,
            &device,
        )?);
        let layers = (0..spec.num_layers())
            .map(|i| DecoderLayer::new(&spec, i, rotary.clone(), experts, vb_m.pp("layers").pp(i)))
            .collect::<candle::Result<Vec<_>>>()?;
        let norm = RmsNorm::new(spec.hidden_size, spec.rms_norm_eps, vb_m.pp("norm"))?;
        let lm_head = if spec.tie_word_embeddings {
            DenseLinear::new(embed_tokens.embeddings().clone(), None)?
        } else {
            DenseLinear::load_no_bias(spec.hidden_size, spec.vocab_size, vb.pp("lm_head"))?
        };
        let cache = SequenceCache::new(KvShape {
            layers: layers.len(),
            kv_heads: spec.num_kv_heads,
            head_dim: spec.head_dim,
        });
        Ok(Self {
            spec,
            embed_tokens,
            layers,
            norm,
            lm_head,
            cache,
            dtype,
            activations,
            device,
        })
    }

    /// Logits `[B, vocab]` (F32) of the last position of `input_ids [B, S]`, whose first token
    /// sits at position `seqlen_offset` (= the number of tokens already in the KV cache).
    pub fn forward(&mut self, input_ids: &Tensor, seqlen_offset: usize) -> candle::Result<Tensor> {
        Ok(self.run(input_ids, seqlen_offset, true, false)?.logits)
    }

    /// Logits `[B, S, vocab]` (F32) of every position, e.g. for parity checks and perplexity.
    pub fn forward_all(
        &mut self,
        input_ids: &Tensor,
        seqlen_offset: usize,
    ) -> candle::Result<Tensor> {
        Ok(self.run(input_ids, seqlen_offset, false, false)?.logits)
    }

    /// Like [`Self::forward_all`], plus the router logits `[B, S, experts]` (F32) of each MoE layer
    /// in layer order.
    pub fn forward_all_with_router_logits(
        &mut self,
        input_ids: &Tensor,
        seqlen_offset: usize,
    ) -> candle::Result<(Tensor, Vec<Tensor>)> {
        let pass = self.run(input_ids, seqlen_offset, false, true)?;
        Ok((pass.logits, pass.router_logits))
    }

    fn check_input(
        &self,
        input_ids: &Tensor,
        seqlen_offset: usize,
    ) -> candle::Result<(usize, usize)> {
        let invalid = |argument: &str, reason: String| -> candle::Error {
            QmoeError::InvalidArgument {
                argument: argument.into(),
                reason,
            }
            .into()
        };
        let Ok((b, s)) = input_ids.dims2() else {
            return Err(invalid(
                "input_ids",
                format!("must be [batch, seq_len], got shape {:?}", input_ids.dims()),
            ));
        };
        if b == 0 || s == 0 {
            return Err(invalid(
                "input_ids",
                format!("it is empty (shape {:?})", input_ids.dims()),
            ));
        }
        if !input_ids.dtype().is_int() {
            return Err(invalid(
                "input_ids",
                format!(
                    "token ids must be integers (u32 or i64), got {:?}",
                    input_ids.dtype()
                ),
            ));
        }
        if seqlen_offset != self.cache.len {
            return Err(invalid(
                "seqlen_offset",
                format!(
                    "{seqlen_offset} but the KV cache holds {} tokens; call clear_kv_cache() \
                     before starting a new sequence",
                    self.cache.len
                ),
            ));
        }
        let ids = input_ids
            .to_dtype(DType::I64)?
            .flatten_all()?
            .to_vec1::<i64>()?;
        self.check_tokens(seqlen_offset, s, ids)?;
        Ok((b, s))
    }

    /// `new` more tokens `ids` after `cached` ones: within the context and the vocabulary.
    fn check_tokens(
        &self,
        cached: usize,
        new: usize,
        ids: impl IntoIterator<Item = i64>,
    ) -> candle::Result<()> {
        let context = self.spec.max_position_embeddings;
        if cached + new > context {
            return Err(QmoeError::ContextExceeded {
                cached,
                new,
                context,
            }
            .into());
        }
        let vocab_size = self.spec.vocab_size;
        if let Some(token) = ids.into_iter().find(|&t| t < 0 || t as usize >= vocab_size) {
            return Err(QmoeError::TokenOutOfVocab { token, vocab_size }.into());
        }
        Ok(())
    }

    /// An empty [`SequenceCache`] for this model, for [`Self::forward_sequences`].
    pub fn new_sequence(&self) -> SequenceCache {
        SequenceCache::new(self.cache.shape)
    }

    /// One forward over several sequences at once: all tokens of the step go through the
    /// embeddings, every projection, router and MoE block together as one `[1, N, H]` tensor
    /// (each MoE block routes once, so each distinct expert's weights are read once per step),
    /// while rotary embedding and attention run per sequence over its own cache. Items may mix
    /// decode (1 token) and prefill chunks.
    ///
    /// Returns each item's last-position logits `[vocab]` (F32), in item order, and appends the
    /// tokens to the items' caches. Errors — an empty batch or item, a cache of another model,
    /// [`QmoeError::ContextExceeded`] for an item, [`QmoeError::TokenOutOfVocab`], or a failure
    /// inside the pass — change no cache (a cache may keep a grown allocation).
    pub fn forward_sequences(
        &mut self,
        batch: &mut [SequenceInput<'_>],
    ) -> candle::Result<Vec<Tensor>> {
        let invalid = |argument: String, reason: String| -> candle::Error {
            QmoeError::InvalidArgument { argument, reason }.into()
        };
        if batch.is_empty() {
            return Err(invalid("batch".into(), "it holds no sequence".into()));
        }
        for (i, item) in batch.iter().enumerate() {
            let (got, want) = (item.cache.shape, self.cache.shape);
            if got != want {
                return Err(invalid(
                    format!("batch[{i}].cache"),
                    format!(
                        "it was made by a model with {} layers of {} kv heads × {}, this model \
                         has {} layers of {} × {}; use this model's new_sequence()",
                        got.layers,
                        got.kv_heads,
                        got.head_dim,
                        want.layers,
                        want.kv_heads,
                        want.head_dim
                    ),
                ));
            }
            if item.tokens.is_empty() {
                return Err(invalid(format!("batch[{i}].tokens"), "it is empty".into()));
            }
            let ids = item.tokens.iter().map(|&t| i64::from(t));
            self.check_tokens(item.cache.len, item.tokens.len(), ids)?;
        }
        let tokens: Vec<u32> = batch.iter().flat_map(|it| it.tokens).copied().collect();
        let n = tokens.len();
        let ids = Tensor::from_vec(tokens, (1, n), &self.device)?;
        let mut start = 0;
        let mut parts: Vec<Part> = batch
            .iter_mut()
            .map(|item| {
                let len = item.tokens.len();
                start += len;
                Part {
                    cache: &mut *item.cache,
                    start: start - len,
                    len,
                }
            })
            .collect();
        let this = &*self;
        this.on_pool(|| {
            let (xs, _) = this.step(&ids, &mut parts, false)?;
            let last: Vec<u32> = parts.iter().map(|p| (p.start + p.len - 1) as u32).collect();
            let last = Tensor::new(last.as_slice(), &this.device)?;
            let logits = this.logits(&xs.index_select(&last, 1)?)?.squeeze(0)?;
            (0..parts.len()).map(|i| logits.get(i)).collect()
        })
    }

    /// One step over `ids [B, N]`, whose parts belong to the sequences of `parts`: embeddings,
    /// every decoder layer (attention per part), the hidden states `[B, N, H]` before the final
    /// norm and, when `want_router`, the MoE layers' router logits `[B, N, E]` (F32). On success
    /// the parts' tokens are appended to their caches; on error every cache is rolled back.
    fn step(
        &self,
        ids: &Tensor,
        parts: &mut [Part],
        want_router: bool,
    ) -> candle::Result<(Tensor, Vec<Tensor>)> {
        // The fused CPU attention needs no mask: positions imply it.
        let fused = fused_attention(&self.device, self.activations);
        let masks = parts
            .iter()
            .map(|p| match fused {
                true => Ok(None),
                false => causal_mask(p.len, p.cache.len, &self.device),
            })
            .collect::<candle::Result<Vec<_>>>()?;
        let run = |parts: &mut [Part]| -> candle::Result<(Tensor, Vec<Tensor>)> {
            let ids = ids.to_dtype(DType::U32)?.to_device(&self.device)?;
            let embedded = self
                .embed_tokens
                .forward(&ids)?
                .to_dtype(self.activations)?;
            let mut xs = scaled(embedded, self.spec.multipliers.embedding)?;
            let (b, n, _) = xs.dims3()?;
            let mut router_logits = Vec::new();
            for (l, layer) in self.layers.iter().enumerate() {
                let mut spans: Vec<SeqSpan> = parts
                    .iter_mut()
                    .zip(&masks)
                    .map(|(p, mask)| {
                        let cache = &mut *p.cache;
                        SeqSpan {
                            offset: cache.len,
                            kv: &mut cache.layers[l],
                            start: p.start,
                            len: p.len,
                            mask: mask.as_ref(),
                        }
                    })
                    .collect();
                let (next, router) = layer.forward(&xs, &mut spans)?;
                xs = next;
                if let (true, Some(r)) = (want_router, router) {
                    router_logits.push(r.to_dtype(DType::F32)?.reshape((b, n, ()))?);
                }
            }
            Ok((xs, router_logits))
        };
        let out = run(parts);
        for p in parts.iter_mut() {
            match out {
                Ok(_) => p.cache.len += p.len,
                Err(_) => p.cache.roll_back(),
            }
        }
        out
    }

    /// Runs one pass `f` on rayon's pool with its workers awake ([`pool::with_workers_awake`])
    /// when the model computes on the CPU; elsewhere `f` runs as it is.
    fn on_pool<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match self.device {
            Device::Cpu => pool::with_workers_awake(f),
            _ => f(),
        }
    }

    /// Final norm and `lm_head` of hidden states `[B, S, H]`: logits `[B, S, vocab]` (F32).
    fn logits(&self, xs: &Tensor) -> candle::Result<Tensor> {
        profile::time(profile::Part::LmHead, || {
            let logits = self.lm_head.forward(&self.norm.forward(xs)?)?;
            scaled(
                logits.to_dtype(DType::F32)?,
                1.0 / self.spec.multipliers.logits_divisor,
            )
        })
    }

    fn run(
        &mut self,
        input_ids: &Tensor,
        offset: usize,
        last_only: bool,
        want_router: bool,
    ) -> candle::Result<Pass> {
        let (_, s) = self.check_input(input_ids, offset)?;
        // The model's own cache runs through the same step as any sequence's.
        let empty = self.new_sequence();
        let mut cache = std::mem::replace(&mut self.cache, empty);
        let part = Part {
            cache: &mut cache,
            start: 0,
            len: s,
        };
        let this = &*self;
        let out = this.on_pool(|| {
            let (mut xs, router_logits) = this.step(input_ids, &mut [part], want_router)?;
            if last_only {
                xs = xs.narrow(1, s - 1, 1)?;
            }
            let logits = this.logits(&xs)?;
            let logits = if last_only {
                logits.squeeze(1)?
            } else {
                logits
            };
            Ok(Pass {
                logits,
                router_logits,
            })
        });
        self.cache = cache;
        out
    }

    /// Empties every layer's KV cache; the next call starts at `seqlen_offset = 0`.
    pub fn clear_kv_cache(&mut self) {
        self.cache = self.new_sequence();
    }

    /// Tokens held in the KV cache (the next call's `seqlen_offset`).
    pub fn cached_len(&self) -> usize {
        self.cache.len
    }

    /// Cumulative routed-expert traffic of all MoE blocks since the model was built (see
    /// [`ExpertTraffic`]; a clone of the model shares its counters).
    pub fn expert_traffic(&self) -> ExpertTraffic {
        self.moe_blocks().map(|(_, m)| m.traffic()).sum()
    }

    /// The architecture the model was built from.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The dtype of the non-expert weights (the VarBuilder's).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dtype of the activations ([`activation_dtype`] of the weights' dtype and device).
    pub fn activation_dtype(&self) -> DType {
        self.activations
    }

    /// Requantizes the non-expert projections (attention, dense MLPs, shared experts,
    /// `lm_head`) to INT8 with an FP16 scale per group of 32 columns, computed against 8-bit
    /// activations: about half the bytes per token of BF16. Routers, norms and embeddings stay
    /// as loaded. CPU only: on another device this is a [`QmoeError::UnsupportedConfig`].
    pub fn quantize_dense_int8(&mut self) -> candle::Result<()> {
        for layer in self.layers.iter_mut() {
            layer.quantize_int8()?;
        }
        self.lm_head = self.lm_head.to_int8()?;
        Ok(())
    }

    /// How the non-expert projections are stored: `bf16`, `f16`, `f32` or `int8`.
    pub fn dense_weights(&self) -> &'static str {
        self.lm_head.weight_format()
    }

    /// Weight bytes one decoded token reads: every layer's norms, attention and feed-forward
    /// (a MoE layer's router, top-k experts and shared expert), the final norm, `lm_head` and
    /// one embedding row. With the KV cache this is the memory traffic that bounds decode.
    pub fn weight_bytes_per_token(&self) -> usize {
        let embeddings = self.embed_tokens.embeddings();
        let embedding_row = embeddings.dim(1).unwrap_or(0) * embeddings.dtype().size_in_bytes();
        self.weight_bytes_by_part()
            .iter()
            .map(|(_, b)| b)
            .sum::<usize>()
            + embedding_row
    }

    /// [`Self::weight_bytes_per_token`] by the part of the pass that reads them, summed over
    /// the layers, in [`profile::Part::ALL`]'s order (the embedding row aside): next to a
    /// [`profile::Profile`], each part's bandwidth.
    pub fn weight_bytes_by_part(&self) -> Vec<(profile::Part, usize)> {
        let head = self.norm.weight_bytes() + self.lm_head.weight_bytes();
        let all: Vec<_> = self
            .layers
            .iter()
            .flat_map(DecoderLayer::weight_bytes_by_part)
            .chain([(profile::Part::LmHead, head)])
            .collect();
        profile::Part::ALL
            .into_iter()
            .map(|p| (p, all.iter().filter(|(q, _)| *q == p).map(|(_, b)| b).sum()))
            .collect()
    }

    /// Bytes the KV caches of all layers hold allocated.
    pub fn kv_cache_bytes(&self) -> usize {
        self.cache.allocated_bytes()
    }

    /// Bytes of keys and values per cached position of the model's own sequence, over all
    /// layers (0 before the first pass): times the context length, what a decoded token's
    /// attention reads.
    pub fn kv_bytes_per_position(&self) -> usize {
        self.cache.bytes_per_position()
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The decoder layers.
    pub fn layers(&self) -> &[DecoderLayer] {
        &self.layers
    }

    /// Links every MoE block to the next one so that it prefetches the next layer's likely
    /// experts (see [`SparseMoe::prefetch_for`]); returns how many blocks were linked (0 when
    /// no backend can prefetch).
    pub fn enable_prefetch(&mut self) -> usize {
        let blocks: Vec<SparseMoe> = self.moe_blocks().map(|(_, m)| m.clone()).collect();
        let mut linked = 0;
        let mut next = blocks.iter().skip(1);
        for layer in self.layers.iter_mut() {
            if let FeedForward::Moe(m) = layer.mlp_mut() {
                match next.next() {
                    Some(n) => linked += usize::from(m.prefetch_for(n)),
                    None => break,
                }
            }
        }
        linked
    }

    /// The MoE blocks as `(layer index, block)`, in layer order.
    pub fn moe_blocks(&self) -> impl Iterator<Item = (usize, &SparseMoe)> {
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(i, l)| match l.mlp() {
                FeedForward::Moe(m) => Some((i, m)),
                FeedForward::Dense(_) => None,
            })
    }
}
