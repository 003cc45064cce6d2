//! The building blocks every port shares: RMSNorm, rotary embedding, attention with a KV cache,
//! the causal mask and the pre-norm decoder layer.
//!
//! The arithmetic follows transformers' Llama-family code that `OlmoeAttention`,
//! `Qwen2MoeAttention`, `Qwen3MoeAttention` and `MixtralAttention` derive from: RMSNorm in F32 and cast back before the weight, RoPE tables
//! computed in F32 (rotate-half convention), scores in the model dtype and softmax in F32.
//!
//! Activations are in [`activation_dtype`] of the weights: on the CPU, BF16 weights compute
//! with F32 activations, and F32 attention runs the fused CPU kernel over an in-place KV cache
//! ([`crate::kernels::attention`]); elsewhere attention is Candle tensor code.

use std::sync::Arc;

use candle::{DType, Device, Module, Tensor, D};
use candle_nn::VarBuilder;

use super::config::{FfnSpec, ModelSpec, QkNorm};
use super::experts::{ExpertDims, ExpertsLoader};
use crate::kernels::attention::{attend, KvCache, KvDtype};
use crate::linear::{activation_dtype, DenseLinear};
use crate::mlp::GatedMlp;
use crate::moe::SharedExpert;
use crate::profile::{self, Part};
use crate::SparseMoe;

/// RMSNorm as transformers computes it: `weight · to_dtype(x / sqrt(mean(x²) + eps))`, the
/// normalisation in F32.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    weight: Tensor,
    /// F32 ones `[size]` on the weight's device: Candle's fused kernel normalises BF16/F16
    /// activations in F32 with this as its weight, and `weight` is applied after the cast back
    /// (4 kernels instead of 9 on a GPU, where each launch costs host time).
    unit: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// Loads `weight [size]` from `vb`, in the activations' dtype ([`activation_dtype`]).
    pub fn new(size: usize, eps: f64, vb: VarBuilder) -> candle::Result<Self> {
        let dtype = activation_dtype(vb.dtype(), vb.device());
        Ok(Self {
            weight: vb.get(size, "weight")?.to_dtype(dtype)?,
            unit: Tensor::ones(size, DType::F32, vb.device())?,
            eps,
        })
    }

    /// Bytes of the weight.
    pub fn weight_bytes(&self) -> usize {
        self.weight.elem_count() * self.weight.dtype().size_in_bytes()
    }
}

impl Module for RmsNorm {
    fn forward(&self, xs: &Tensor) -> candle::Result<Tensor> {
        let eps = self.eps as f32;
        if xs.dtype() == DType::F32 && xs.is_contiguous() {
            // Same result as the path below when nothing needs casting; one fused kernel.
            return candle_nn::ops::rms_norm(xs, &self.weight, eps);
        }
        let dtype = xs.dtype();
        let x = xs.to_dtype(DType::F32)?.contiguous()?;
        let normed = candle_nn::ops::rms_norm(&x, &self.unit, eps)?;
        normed.to_dtype(dtype)?.broadcast_mul(&self.weight)
    }
}

/// Rotary embedding tables (HF rotate-half convention), computed in F32 and stored in the model
/// dtype for the positions used so far: [`ROTARY_INITIAL_POSITIONS`] at first, doubled (up to
/// `max_position_embeddings`) when a call reaches past them. Each position's row is computed on
/// its own, so the tables' length never changes a value; a model with a 262k-token maximum
/// running 4k-token contexts keeps 4k rows, not 262k.
#[derive(Debug)]
pub struct RotaryEmbedding {
    inv_freq: Vec<f32>,
    max_positions: usize,
    dtype: DType,
    device: Device,
    /// `cos`, `sin [positions, head_dim / 2]`.
    tables: std::sync::RwLock<(Tensor, Tensor)>,
}

/// Rows [`RotaryEmbedding`] builds at first.
pub const ROTARY_INITIAL_POSITIONS: usize = 4096;

impl RotaryEmbedding {
    /// Tables with `inv_freq_i = theta^(-2i / head_dim)` for positions up to `max_positions`,
    /// the first `min(max_positions, ROTARY_INITIAL_POSITIONS)` built now.
    pub fn new(
        theta: f64,
        head_dim: usize,
        max_positions: usize,
        dtype: DType,
        device: &Device,
    ) -> candle::Result<Self> {
        let half = head_dim / 2;
        // As transformers: inv_freq = 1 / base ** (arange(0, dim, 2) / dim), all in float32.
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let tables = Self::build(
            &inv_freq,
            max_positions.min(ROTARY_INITIAL_POSITIONS),
            dtype,
            device,
        )?;
        Ok(Self {
            inv_freq,
            max_positions,
            dtype,
            device: device.clone(),
            tables: std::sync::RwLock::new(tables),
        })
    }

    /// `cos`/`sin` for positions `0..positions`.
    fn build(
        inv_freq: &[f32],
        positions: usize,
        dtype: DType,
        device: &Device,
    ) -> candle::Result<(Tensor, Tensor)> {
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for f in inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let table = |v: Vec<f32>| Tensor::from_vec(v, (positions, half), device)?.to_dtype(dtype);
        Ok((table(cos)?, table(sin)?))
    }

    /// Positions the tables hold now.
    pub fn positions(&self) -> usize {
        let tables = self.tables.read().unwrap_or_else(|e| e.into_inner());
        tables.0.dim(0).unwrap_or(0)
    }

    /// `cos`/`sin` rows `offset..offset + len`, growing the tables first when they are shorter;
    /// an error past `max_position_embeddings`.
    fn rows(&self, offset: usize, len: usize) -> candle::Result<(Tensor, Tensor)> {
        let end = offset + len;
        if end > self.max_positions {
            candle::bail!(
                "position {} is beyond the model's max_position_embeddings = {}",
                end - 1,
                self.max_positions
            );
        }
        let narrow = |(cos, sin): &(Tensor, Tensor)| {
            Ok((cos.narrow(0, offset, len)?, sin.narrow(0, offset, len)?))
        };
        {
            let tables = self.tables.read().unwrap_or_else(|e| e.into_inner());
            if end <= tables.0.dim(0)? {
                return narrow(&tables);
            }
        }
        let mut tables = self.tables.write().unwrap_or_else(|e| e.into_inner());
        // Another caller may have grown them between the two locks.
        let have = tables.0.dim(0)?;
        if end > have {
            let positions = end.max(2 * have).min(self.max_positions);
            *tables = Self::build(&self.inv_freq, positions, self.dtype, &self.device)?;
        }
        narrow(&tables)
    }

    /// Rotates `xs [B, heads, S, head_dim]` whose first token sits at position `offset`.
    pub fn apply(&self, xs: &Tensor, offset: usize) -> candle::Result<Tensor> {
        let (cos, sin) = self.rows(offset, xs.dim(2)?)?;
        candle_nn::rotary_emb::rope(&xs.contiguous()?, &cos, &sin)
    }

    /// Rotates token-major `xs [B, S, heads, head_dim]` whose first token sits at `offset`.
    pub fn apply_token_major(&self, xs: &Tensor, offset: usize) -> candle::Result<Tensor> {
        let (cos, sin) = self.rows(offset, xs.dim(1)?)?;
        candle_nn::rotary_emb::rope_thd(&xs.contiguous()?, &cos, &sin)
    }
}

/// Whether attention over activations of `dtype` on `device` runs the fused CPU kernel
/// ([`crate::kernels::attention`], F32 on the CPU: the causal mask is implied by positions) or
/// Candle tensor code with an explicit mask.
pub fn fused_attention(device: &Device, dtype: DType) -> bool {
    device.is_cpu() && dtype == DType::F32
}

/// The additive causal mask `[S, offset + S]` (F32, `-inf` above the shifted diagonal), or `None`
/// for a single token, which may attend to everything cached.
pub fn causal_mask(
    seq_len: usize,
    offset: usize,
    device: &Device,
) -> candle::Result<Option<Tensor>> {
    if seq_len <= 1 {
        return Ok(None);
    }
    let total = offset + seq_len;
    let mask: Vec<f32> = (0..seq_len)
        .flat_map(|i| {
            (0..total).map(move |j| {
                if j > i + offset {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
        })
        .collect();
    Ok(Some(Tensor::from_vec(mask, (seq_len, total), device)?))
}

/// Repeats each of the `kv` heads of `xs [B, kv, S, D]` `n_rep` times (head `h` reads kv head
/// `h / n_rep`, as `torch.repeat_interleave`).
pub fn repeat_kv(xs: Tensor, n_rep: usize) -> candle::Result<Tensor> {
    if n_rep == 1 {
        return Ok(xs);
    }
    let (b, kv, s, d) = xs.dims4()?;
    xs.unsqueeze(2)?
        .expand((b, kv, n_rep, s, d))?
        .reshape((b, kv * n_rep, s, d))
}

/// The keys and values one attention layer holds for one sequence (or for a batch of rows of
/// equal length): a layer's part of a [`super::SequenceCache`].
#[derive(Clone, Debug, Default)]
pub(crate) enum KvStore {
    /// Nothing cached yet.
    #[default]
    Empty,
    /// `[B, kv_heads, S, head_dim]` tensors, concatenated per call (GPU, non-F32 activations).
    Tensors(Tensor, Tensor),
    /// The CPU cache the fused kernel attends over (F32 activations on the CPU).
    Host(KvCache),
}

impl KvStore {
    /// Positions held.
    pub(crate) fn len(&self) -> usize {
        match self {
            Self::Empty => 0,
            Self::Tensors(k, _) => k.dim(2).unwrap_or(0),
            Self::Host(c) => c.len(),
        }
    }

    /// Bytes held allocated (keys and values).
    pub(crate) fn allocated_bytes(&self) -> usize {
        match self {
            Self::Empty => 0,
            Self::Tensors(k, v) => (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes(),
            Self::Host(c) => c.allocated_bytes(),
        }
    }

    /// Bytes of keys and values per position: what attending over one position reads (0 while
    /// empty).
    pub(crate) fn bytes_per_position(&self) -> usize {
        match self {
            Self::Empty => 0,
            Self::Tensors(k, v) => {
                let (b, heads, _, d) = k.dims4().unwrap_or_default();
                b * heads * d * (k.dtype().size_in_bytes() + v.dtype().size_in_bytes())
            }
            Self::Host(c) => c.bytes_per_position(),
        }
    }

    /// Keeps the first `len` positions (undoes the appends of a failed step); empty when `len`
    /// is 0, unchanged when it holds no more than `len`.
    pub(crate) fn truncate(&mut self, len: usize) -> candle::Result<()> {
        if len >= self.len() {
            return Ok(());
        }
        if len == 0 {
            *self = Self::Empty;
            return Ok(());
        }
        match self {
            Self::Empty => {}
            Self::Tensors(k, v) => {
                *self = Self::Tensors(k.narrow(2, 0, len)?, v.narrow(2, 0, len)?)
            }
            Self::Host(c) => c.truncate(len),
        }
        Ok(())
    }
}

/// One sequence's part of a step: positions `start..start + len` along dim 1 of the step's
/// activations `[B, N, ·]`, at positions `offset..` of the sequence, attending over `kv`.
pub(crate) struct SeqSpan<'a> {
    /// The sequence's keys and values in this layer (`offset` positions before the step).
    pub(crate) kv: &'a mut KvStore,
    /// First position of the part in the step.
    pub(crate) start: usize,
    /// Tokens of the part.
    pub(crate) len: usize,
    /// The sequence's position of the part's first token.
    pub(crate) offset: usize,
    /// The causal mask of the tensor path ([`causal_mask`] of `len`, `offset`).
    pub(crate) mask: Option<&'a Tensor>,
}

/// The q, k and v projections of [`Attention`]: three projections as loaded, or one INT8
/// projection over their stacked rows (one activation quantization and one pass of the thread
/// pool per call instead of three; the same bits).
#[derive(Clone, Debug)]
enum QkvProjection {
    Separate([DenseLinear; 3]),
    Stacked {
        qkv: DenseLinear,
        /// The output sizes of q, k and v.
        dims: [usize; 3],
    },
}

impl QkvProjection {
    /// `[q, k, v]` of `xs [..., H]`.
    fn forward(&self, xs: &Tensor) -> candle::Result<[Tensor; 3]> {
        match self {
            Self::Separate([q, k, v]) => Ok([q.forward(xs)?, k.forward(xs)?, v.forward(xs)?]),
            Self::Stacked { qkv, dims } => {
                let y = qkv.forward(xs)?;
                let part = |start: usize, len: usize| y.narrow(D::Minus1, start, len)?.contiguous();
                Ok([
                    part(0, dims[0])?,
                    part(dims[0], dims[1])?,
                    part(dims[0] + dims[1], dims[2])?,
                ])
            }
        }
    }

    /// The projections in INT8, stacked.
    fn to_int8(&self) -> candle::Result<Self> {
        match self {
            Self::Separate(parts) => Ok(Self::Stacked {
                qkv: DenseLinear::stack_int8(&[&parts[0], &parts[1], &parts[2]])?,
                dims: [parts[0].dims().0, parts[1].dims().0, parts[2].dims().0],
            }),
            Self::Stacked { .. } => Ok(self.clone()),
        }
    }

    /// Bytes of the weights and biases.
    fn weight_bytes(&self) -> usize {
        match self {
            Self::Separate(parts) => parts.iter().map(DenseLinear::weight_bytes).sum(),
            Self::Stacked { qkv, .. } => qkv.weight_bytes(),
        }
    }
}

/// Multi-head attention with GQA, optional q/k/v bias, q/k norm (over the projection or per
/// head) and `clip_qkv`, over KV caches held outside the layer (in a [`super::SequenceCache`]).
#[derive(Clone, Debug)]
pub struct Attention {
    qkv: QkvProjection,
    o_proj: DenseLinear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    /// The q/k norms apply to each head ([`QkNorm::PerHead`]), not the whole projection.
    per_head_norm: bool,
    clip_qkv: Option<f64>,
    /// The factor of the scores `q·k` ([`super::AttentionSpec::scale_for`]).
    scale: f64,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    rotary: Arc<RotaryEmbedding>,
    /// How the fused CPU path stores keys and values (`KvDtype::for_weights` of the loaded
    /// weights, the rule the planner counts with).
    kv_dtype: KvDtype,
}

impl Attention {
    /// Loads `{q,k,v,o}_proj` (and `{q,k}_norm` when the spec asks) from the `self_attn`
    /// VarBuilder.
    pub fn new(
        spec: &ModelSpec,
        rotary: Arc<RotaryEmbedding>,
        vb: VarBuilder,
    ) -> candle::Result<Self> {
        let a = &spec.attention;
        let (h, hd) = (spec.hidden_size, spec.head_dim);
        let q_dim = spec.num_heads * hd;
        let kv_dim = spec.num_kv_heads * hd;
        let (q_norm, k_norm) = match spec.qk_norm_sizes() {
            Some((qs, ks)) => {
                let eps = spec.rms_norm_eps;
                (
                    Some(RmsNorm::new(qs, eps, vb.pp("q_norm"))?),
                    Some(RmsNorm::new(ks, eps, vb.pp("k_norm"))?),
                )
            }
            None => (None, None),
        };
        Ok(Self {
            qkv: QkvProjection::Separate([
                DenseLinear::load(h, q_dim, a.qkv_bias, vb.pp("q_proj"))?,
                DenseLinear::load(h, kv_dim, a.qkv_bias, vb.pp("k_proj"))?,
                DenseLinear::load(h, kv_dim, a.qkv_bias, vb.pp("v_proj"))?,
            ]),
            o_proj: DenseLinear::load(q_dim, h, a.o_bias, vb.pp("o_proj"))?,
            q_norm,
            k_norm,
            per_head_norm: a.qk_norm == QkNorm::PerHead,
            clip_qkv: a.clip_qkv,
            scale: a.scale_for(hd),
            num_heads: spec.num_heads,
            num_kv_heads: spec.num_kv_heads,
            head_dim: hd,
            rotary,
            kv_dtype: KvDtype::for_weights(vb.dtype()),
        })
    }

    /// Attends each span of `xs [B, N, H]` to its sequence's cache plus itself, appending its
    /// keys and values to that cache. The projections run once over all `N` tokens; rotary
    /// embedding and attention per span.
    pub(crate) fn forward(&self, xs: &Tensor, spans: &mut [SeqSpan]) -> candle::Result<Tensor> {
        let [q, k, v] = profile::time(Part::QkvProjection, || self.qkv.forward(xs))?;
        let out = profile::time(Part::Attention, || self.attend(q, k, v, spans))?;
        profile::time(Part::OutputProjection, || self.o_proj.forward(&out))
    }

    /// Attention of the projected `q`, `k`, `v [B, N, heads · D]` over each span's cache (q/k
    /// norm, `clip_qkv`, rotary embedding inside); returns `[B, N, heads · D]` before `o_proj`.
    fn attend(
        &self,
        mut q: Tensor,
        mut k: Tensor,
        mut v: Tensor,
        spans: &mut [SeqSpan],
    ) -> candle::Result<Tensor> {
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = self.qk_norm(qn, &q, self.num_heads)?;
            k = self.qk_norm(kn, &k, self.num_kv_heads)?;
        }
        if let Some(c) = self.clip_qkv {
            q = q.clamp(-c, c)?;
            k = k.clamp(-c, c)?;
            v = v.clamp(-c, c)?;
        }
        let fused = fused_attention(q.device(), q.dtype());
        let mut parts = spans
            .iter_mut()
            .map(|span| {
                let part = |t: &Tensor| t.narrow(1, span.start, span.len);
                let (q, k, v) = (part(&q)?, part(&k)?, part(&v)?);
                match fused {
                    true => self.attend_host(q, k, v, span.offset, span.kv),
                    false => self.attend_tensors(q, k, v, span),
                }
            })
            .collect::<candle::Result<Vec<_>>>()?;
        match parts.len() {
            1 => Ok(parts.swap_remove(0)),
            _ => Tensor::cat(&parts, 1),
        }
    }

    /// `norm` applied to `xs [B, S, heads · D]`: over each head's `D` values, or over all of
    /// them (see [`QkNorm`]).
    fn qk_norm(&self, norm: &RmsNorm, xs: &Tensor, heads: usize) -> candle::Result<Tensor> {
        if !self.per_head_norm {
            return norm.forward(xs);
        }
        let (b, s, n) = xs.dims3()?;
        norm.forward(&xs.reshape((b, s, heads, self.head_dim))?)?
            .reshape((b, s, n))
    }

    /// The fused CPU kernel over the in-place cache `kv`; `q`, `k`, `v` are `[B, S, heads · D]`
    /// with the first token at `offset`; returns `[B, S, heads · D]` (before `o_proj`).
    fn attend_host(
        &self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        offset: usize,
        kv: &mut KvStore,
    ) -> candle::Result<Tensor> {
        let (b, s, _) = q.dims3()?;
        let d = self.head_dim;
        let rope = |t: Tensor, n: usize| -> candle::Result<Vec<f32>> {
            let t = t.reshape((b, s, n, d))?;
            self.rotary
                .apply_token_major(&t, offset)?
                .flatten_all()?
                .to_vec1()
        };
        let q = rope(q, self.num_heads)?;
        let k = rope(k, self.num_kv_heads)?;
        let v = v.flatten_all()?.to_vec1::<f32>()?;
        if matches!(kv, KvStore::Empty) {
            *kv = KvStore::Host(KvCache::new(b, self.num_kv_heads, d, self.kv_dtype));
        }
        let KvStore::Host(cache) = kv else {
            candle::bail!("attention: the KV cache was filled on another device or dtype");
        };
        if cache.batch() != b {
            candle::bail!(
                "attention: batch of {b} but the KV cache holds {} sequences",
                cache.batch()
            );
        }
        cache.append(&k, &v, s);
        let out = attend(&q, cache, s, self.num_heads, self.scale as f32);
        Tensor::from_vec(out, (b, s, self.num_heads * d), &Device::Cpu)
    }

    /// Candle tensor code for one span: concatenated cache, repeated kv heads, masked softmax;
    /// returns `[B, S, heads · D]` (before `o_proj`).
    fn attend_tensors(
        &self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        span: &mut SeqSpan,
    ) -> candle::Result<Tensor> {
        let offset = span.offset;
        let (b, s, _) = q.dims3()?;
        let heads = |t: Tensor, n: usize| {
            t.reshape((b, s, n, self.head_dim))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = self.rotary.apply(&heads(q, self.num_heads)?, offset)?;
        let k = self.rotary.apply(&heads(k, self.num_kv_heads)?, offset)?;
        let v = heads(v, self.num_kv_heads)?;
        let (k, v) = match &*span.kv {
            KvStore::Tensors(pk, pv) => (Tensor::cat(&[pk, &k], 2)?, Tensor::cat(&[pv, &v], 2)?),
            KvStore::Empty => (k, v),
            KvStore::Host(_) => {
                candle::bail!("attention: the KV cache was filled on another device or dtype")
            }
        };
        *span.kv = KvStore::Tensors(k.clone(), v.clone());
        let n_rep = self.num_heads / self.num_kv_heads;
        let k = repeat_kv(k, n_rep)?;
        let v = repeat_kv(v, n_rep)?;
        let dtype = q.dtype();
        let scores = (q.matmul(&k.t()?)? * self.scale)?.to_dtype(DType::F32)?;
        let scores = match span.mask {
            Some(m) => scores.broadcast_add(m)?,
            None => scores,
        };
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_dtype(dtype)?;
        let out = probs.matmul(&v.contiguous()?)?;
        out.transpose(1, 2)?
            .reshape((b, s, self.num_heads * self.head_dim))
    }

    /// Puts q/k/v/o in INT8 ([`DenseLinear::to_int8`]), q/k/v stacked into one projection
    /// ([`DenseLinear::stack_int8`]).
    pub fn quantize_int8(&mut self) -> candle::Result<()> {
        self.qkv = self.qkv.to_int8()?;
        self.o_proj = self.o_proj.to_int8()?;
        Ok(())
    }

    /// Bytes of the projections and norms: what one token reads (the KV cache aside).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes_by_part().iter().map(|(_, b)| b).sum()
    }

    /// [`Self::weight_bytes`] by the part of the pass that reads them (the q/k norms in
    /// [`Part::Attention`]).
    pub fn weight_bytes_by_part(&self) -> [(Part, usize); 3] {
        let qk_norms = [&self.q_norm, &self.k_norm]
            .iter()
            .filter_map(|n| n.as_ref().map(RmsNorm::weight_bytes))
            .sum::<usize>();
        [
            (Part::QkvProjection, self.qkv.weight_bytes()),
            (Part::Attention, qk_norms),
            (Part::OutputProjection, self.o_proj.weight_bytes()),
        ]
    }
}

/// The feed-forward block of a decoder layer.
#[derive(Clone, Debug)]
pub enum FeedForward {
    /// A dense gated MLP.
    Dense(GatedMlp),
    /// A sparse MoE block with a swappable routed-experts backend.
    Moe(SparseMoe),
}

impl FeedForward {
    /// Builds the block the spec names for layer `layer` from the decoder layer's VarBuilder:
    /// a dense MLP from `mlp`, a MoE block from its [`super::MoeNames`]' block.
    pub fn new(
        spec: &ModelSpec,
        layer: usize,
        experts: &dyn ExpertsLoader,
        vb: VarBuilder,
    ) -> candle::Result<Self> {
        let h = spec.hidden_size;
        match &spec.layers[layer] {
            FfnSpec::Dense { intermediate_size } => Ok(Self::Dense(GatedMlp::new(
                h,
                *intermediate_size,
                vb.pp("mlp"),
            )?)),
            FfnSpec::Moe(m) => {
                let vb = vb.pp(m.names.block);
                let router = SparseMoe::load_router(h, m.num_experts, m.names.router, vb.clone())?;
                let shared = m
                    .shared_intermediate_size
                    .map(|si| SharedExpert::new(h, si, vb.clone()))
                    .transpose()?;
                let dims = ExpertDims {
                    layer,
                    hidden: h,
                    intermediate: m.intermediate_size,
                    num_experts: m.num_experts,
                    top_k: m.top_k,
                    names: m.names.experts,
                    storage: m.names.storage,
                };
                let routed = experts.load(dims, vb)?;
                Ok(Self::Moe(SparseMoe::new(
                    router,
                    routed,
                    m.top_k,
                    m.norm_topk_prob,
                    shared,
                )?))
            }
        }
    }

    /// Weight bytes one token reads: the dense MLP, or the MoE block's router, top-k experts
    /// and shared expert.
    pub fn weight_bytes_per_token(&self) -> usize {
        self.weight_bytes_by_part().iter().map(|(_, b)| b).sum()
    }

    /// [`Self::weight_bytes_per_token`] by the part of the pass that reads them.
    pub fn weight_bytes_by_part(&self) -> Vec<(Part, usize)> {
        match self {
            Self::Dense(mlp) => vec![(Part::DenseMlp, mlp.weight_bytes())],
            Self::Moe(moe) => moe.weight_bytes_by_part().to_vec(),
        }
    }

    /// The block's output and, for a MoE block, its router logits `[N, E]`.
    pub fn forward(&self, xs: &Tensor) -> candle::Result<(Tensor, Option<Tensor>)> {
        match self {
            Self::Dense(mlp) => Ok((profile::time(Part::DenseMlp, || mlp.forward(xs))?, None)),
            Self::Moe(moe) => {
                let (out, routing) = moe.forward_with_routing(xs)?;
                Ok((out, Some(routing.logits)))
            }
        }
    }
}

/// A pre-norm decoder layer: `x + r · attn(norm(x))`, then `x + r · ffn(norm(x))`, `r` the
/// spec's residual multiplier (1 but for GraniteMoE).
#[derive(Clone, Debug)]
pub struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: FeedForward,
    residual: f64,
}

/// `xs · factor`, or `xs` itself when `factor` is 1 (no extra pass, and the same bits as a
/// model without the factor).
pub fn scaled(xs: Tensor, factor: f64) -> candle::Result<Tensor> {
    if factor == 1.0 {
        Ok(xs)
    } else {
        xs.affine(factor, 0.0)
    }
}

impl DecoderLayer {
    /// Loads layer `layer` from the `model.layers.{layer}` VarBuilder.
    pub fn new(
        spec: &ModelSpec,
        layer: usize,
        rotary: Arc<RotaryEmbedding>,
        experts: &dyn ExpertsLoader,
        vb: VarBuilder,
    ) -> candle::Result<Self> {
        let (h, eps) = (spec.hidden_size, spec.rms_norm_eps);
        Ok(Self {
            input_layernorm: RmsNorm::new(h, eps, vb.pp("input_layernorm"))?,
            self_attn: Attention::new(spec, rotary, vb.pp("self_attn"))?,
            post_attention_layernorm: RmsNorm::new(h, eps, vb.pp("post_attention_layernorm"))?,
            mlp: FeedForward::new(spec, layer, experts, vb)?,
            residual: spec.multipliers.residual,
        })
    }

    /// Runs the layer on a step's `xs [B, N, H]` (attention per span, the rest over all `N`
    /// tokens at once); returns the new hidden states and the router logits of a MoE layer.
    pub(crate) fn forward(
        &self,
        xs: &Tensor,
        spans: &mut [SeqSpan],
    ) -> candle::Result<(Tensor, Option<Tensor>)> {
        let norms = Part::NormsAndResiduals;
        let normed = profile::time(norms, || self.input_layernorm.forward(xs))?;
        let attn = self.self_attn.forward(&normed, spans)?;
        let (xs, normed) = profile::time(norms, || -> candle::Result<_> {
            let xs = (xs + scaled(attn, self.residual)?)?;
            let normed = self.post_attention_layernorm.forward(&xs)?;
            Ok((xs, normed))
        })?;
        let (ffn, router_logits) = self.mlp.forward(&normed)?;
        let out = profile::time(norms, || xs + scaled(ffn, self.residual)?)?;
        Ok((out, router_logits))
    }

    /// Puts the layer's projections in INT8: attention, a dense MLP or a shared expert (routers
    /// stay as loaded).
    pub fn quantize_int8(&mut self) -> candle::Result<()> {
        self.self_attn.quantize_int8()?;
        match &mut self.mlp {
            FeedForward::Dense(mlp) => *mlp = mlp.to_int8()?,
            FeedForward::Moe(moe) => moe.quantize_shared_int8()?,
        }
        Ok(())
    }

    /// Weight bytes one token reads in this layer (norms, attention, feed-forward).
    pub fn weight_bytes_per_token(&self) -> usize {
        self.weight_bytes_by_part().iter().map(|(_, b)| b).sum()
    }

    /// [`Self::weight_bytes_per_token`] by the part of the pass that reads them.
    pub fn weight_bytes_by_part(&self) -> Vec<(Part, usize)> {
        let norms =
            self.input_layernorm.weight_bytes() + self.post_attention_layernorm.weight_bytes();
        std::iter::once((Part::NormsAndResiduals, norms))
            .chain(self.self_attn.weight_bytes_by_part())
            .chain(self.mlp.weight_bytes_by_part())
            .collect()
    }

    /// The feed-forward block.
    pub fn mlp(&self) -> &FeedForward {
        &self.mlp
    }

    /// The feed-forward block, mutably (e.g. to link prefetch).
    pub fn mlp_mut(&mut self) -> &mut FeedForward {
        &mut self.mlp
    }

    /// The attention block.
    pub fn attention(&self) -> &Attention {
        &self.self_attn
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tables grow when a position passes them (doubling, capped at the maximum), a row does
    /// not depend on how long the tables are, and a position past the maximum is an error naming
    /// it.
    #[test]
    fn rotary_tables_grow_with_the_positions_used() {
        let dev = Device::Cpu;
        let (d, at) = (64, 5000);
        let xs = Tensor::arange(0f32, (2 * d) as f32, &dev)
            .unwrap()
            .affine(0.01, -0.5)
            .unwrap()
            .reshape((1, 2, 1, d))
            .unwrap();
        let capped = RotaryEmbedding::new(1e4, d, at + 1, DType::F32, &dev).unwrap();
        let roomy = RotaryEmbedding::new(1e4, d, 1 << 20, DType::F32, &dev).unwrap();
        assert_eq!(roomy.positions(), ROTARY_INITIAL_POSITIONS);
        let a = capped.apply(&xs, at).unwrap();
        let b = roomy.apply(&xs, at).unwrap();
        assert_eq!((capped.positions(), roomy.positions()), (at + 1, 8192));
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(flat(&a), flat(&b));
        // Rotation keeps each pair's norm: the tables hold real angles, not zeros.
        let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>();
        assert!((norm(&flat(&a)) - norm(&flat(&xs))).abs() < 1e-3);
        assert_ne!(flat(&a), flat(&xs));
        let e = capped.apply(&xs, at + 1).unwrap_err().to_string();
        assert!(
            e.contains("position 5001") && e.contains("max_position_embeddings = 5001"),
            "{e}"
        );
    }
}
