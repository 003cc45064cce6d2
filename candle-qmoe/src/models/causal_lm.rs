//! The model trunk every port shares: embeddings, decoder layers, final norm and `lm_head`.

use std::sync::Arc;

use candle::{DType, Device, Module, Tensor};
use candle_nn::{embedding, Embedding, VarBuilder};

use super::config::{ModelConfig, ModelSpec};
use super::experts::ExpertsLoader;
use super::layers::{
    causal_mask, fused_attention, DecoderLayer, FeedForward, RmsNorm, RotaryEmbedding,
};
use crate::linear::{activation_dtype, DenseLinear};
use crate::{QmoeError, SparseMoe};

/// A decoder-only MoE causal LM (the layout of OLMoE, Qwen2-MoE, Qwen3-MoE and Mixtral) with a
/// KV cache.
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
    cached: usize,
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
        let spec = cfg.spec()?;
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
        Ok(Self {
            spec,
            embed_tokens,
            layers,
            norm,
            lm_head,
            cached: 0,
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
        if seqlen_offset != self.cached {
            return Err(invalid(
                "seqlen_offset",
                format!(
                    "{seqlen_offset} but the KV cache holds {} tokens; call clear_kv_cache() \
                     before starting a new sequence",
                    self.cached
                ),
            ));
        }
        let context = self.spec.max_position_embeddings;
        if seqlen_offset + s > context {
            return Err(QmoeError::ContextExceeded {
                cached: seqlen_offset,
                new: s,
                context,
            }
            .into());
        }
        let ids = input_ids
            .to_dtype(DType::I64)?
            .flatten_all()?
            .to_vec1::<i64>()?;
        let vocab_size = self.spec.vocab_size;
        if let Some(&token) = ids.iter().find(|&&t| t < 0 || t as usize >= vocab_size) {
            return Err(QmoeError::TokenOutOfVocab { token, vocab_size }.into());
        }
        Ok((b, s))
    }

    /// Runs every decoder layer; collects the MoE layers' router logits as `[B, S, E]` F32.
    fn run_layers(
        &mut self,
        mut xs: Tensor,
        offset: usize,
        mask: Option<&Tensor>,
        want_router: bool,
    ) -> candle::Result<(Tensor, Vec<Tensor>)> {
        let (b, s, _) = xs.dims3()?;
        let mut router_logits = Vec::new();
        for layer in self.layers.iter_mut() {
            let (next, router) = layer.forward(&xs, offset, mask)?;
            xs = next;
            if let (true, Some(r)) = (want_router, router) {
                router_logits.push(r.to_dtype(DType::F32)?.reshape((b, s, ()))?);
            }
        }
        Ok((xs, router_logits))
    }

    fn run(
        &mut self,
        input_ids: &Tensor,
        offset: usize,
        last_only: bool,
        want_router: bool,
    ) -> candle::Result<Pass> {
        let (_, s) = self.check_input(input_ids, offset)?;
        let ids = input_ids.to_dtype(DType::U32)?.to_device(&self.device)?;
        // The fused CPU attention needs no mask: positions imply it.
        let mask = match fused_attention(&self.device, self.activations) {
            true => None,
            false => causal_mask(s, offset, &self.device)?,
        };
        let xs = self
            .embed_tokens
            .forward(&ids)?
            .to_dtype(self.activations)?;
        let (mut xs, router_logits) = match self.run_layers(xs, offset, mask.as_ref(), want_router)
        {
            Ok(r) => r,
            Err(e) => {
                // A failed pass may have filled some layers' caches only: start over cleanly.
                self.clear_kv_cache();
                return Err(e);
            }
        };
        self.cached += s;
        if last_only {
            xs = xs.narrow(1, s - 1, 1)?;
        }
        let logits = self
            .lm_head
            .forward(&self.norm.forward(&xs)?)?
            .to_dtype(DType::F32)?;
        let logits = if last_only {
            logits.squeeze(1)?
        } else {
            logits
        };
        Ok(Pass {
            logits,
            router_logits,
        })
    }

    /// Empties every layer's KV cache; the next call starts at `seqlen_offset = 0`.
    pub fn clear_kv_cache(&mut self) {
        self.cached = 0;
        for layer in self.layers.iter_mut() {
            layer.clear_kv_cache();
        }
    }

    /// Tokens held in the KV cache (the next call's `seqlen_offset`).
    pub fn cached_len(&self) -> usize {
        self.cached
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
        self.layers
            .iter()
            .map(DecoderLayer::weight_bytes_per_token)
            .sum::<usize>()
            + self.norm.weight_bytes()
            + self.lm_head.weight_bytes()
            + embedding_row
    }

    /// Bytes the KV caches of all layers hold allocated.
    pub fn kv_cache_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| l.attention().kv_cache_bytes())
            .sum()
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
