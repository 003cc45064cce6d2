//! [`SparseMoe`]: the replacement MoE block shared by every model port.
//!
//! Router ([`DenseLinear`]) → softmax in F32 → top-k → optional renormalisation (`norm_topk_prob`) →
//! [`RoutedExperts`] → plus an optional sigmoid-gated shared expert (Qwen2-MoE). This is the
//! arithmetic of transformers' `OlmoeSparseMoeBlock` and `Qwen2MoeSparseMoeBlock`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use candle::{DType, Module, Tensor, D};
use candle_nn::VarBuilder;

use crate::mlp::GatedMlp;
use crate::pack::{DenseExpert, ExpertNames};
use crate::profile::{self, Part};
use crate::{DenseLinear, QmoeError, RoutedExperts};

/// The routing decision for a batch of tokens.
#[derive(Clone, Debug)]
pub struct Routing {
    /// Router logits `[N, E]` in the model dtype.
    pub logits: Tensor,
    /// Chosen experts `[N, k]` (`u32`), highest probability first.
    pub expert_ids: Tensor,
    /// Their weights `[N, k]` (`f32`), renormalised when `norm_topk_prob`.
    pub weights: Tensor,
}

/// The shared expert of Qwen2-MoE: a gated MLP scaled by `sigmoid(shared_expert_gate(x))`.
#[derive(Clone, Debug)]
pub struct SharedExpert {
    mlp: GatedMlp,
    gate: DenseLinear,
}

impl SharedExpert {
    /// Loads `shared_expert.{gate,up,down}_proj` and `shared_expert_gate` from the MoE block's
    /// VarBuilder.
    pub fn new(hidden: usize, intermediate: usize, vb: VarBuilder) -> candle::Result<Self> {
        Ok(Self {
            mlp: GatedMlp::new(hidden, intermediate, vb.pp("shared_expert"))?,
            gate: DenseLinear::load_no_bias(hidden, 1, vb.pp("shared_expert_gate"))?,
        })
    }
}

impl SharedExpert {
    /// The hidden size it was loaded for (its gate is `[1, hidden]`).
    pub fn hidden_size(&self) -> usize {
        self.gate.dims().1
    }

    /// Bytes of the MLP and its gate: what one token reads.
    pub fn weight_bytes(&self) -> usize {
        self.mlp.weight_bytes() + self.gate.weight_bytes()
    }
}

impl Module for SharedExpert {
    fn forward(&self, xs: &Tensor) -> candle::Result<Tensor> {
        let g = candle_nn::ops::sigmoid(&self.gate.forward(xs)?)?;
        self.mlp.forward(xs)?.broadcast_mul(&g)
    }
}

/// Counters of the routed experts' work (cumulative; [`SparseMoe::traffic`] for one block,
/// `MoeForCausalLm::expert_traffic` for all of a model's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ExpertTraffic {
    /// MoE block calls.
    pub calls: u64,
    /// Tokens routed (summed over calls).
    pub tokens: u64,
    /// Distinct experts computed, summed over calls.
    pub experts_read: u64,
    /// Their weight bytes: each distinct expert's weights ([`RoutedExperts::bytes_per_expert`])
    /// once per call.
    pub bytes_read: u64,
}

impl std::ops::Add for ExpertTraffic {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        Self {
            calls: self.calls + o.calls,
            tokens: self.tokens + o.tokens,
            experts_read: self.experts_read + o.experts_read,
            bytes_read: self.bytes_read + o.bytes_read,
        }
    }
}

impl std::iter::Sum for ExpertTraffic {
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::default(), |a, b| a + b)
    }
}

/// A block's [`ExpertTraffic`] counters, shared by its clones.
#[derive(Debug, Default)]
struct TrafficCounters {
    calls: AtomicU64,
    tokens: AtomicU64,
    experts: AtomicU64,
    /// Off the CPU: the distinct experts counted on the device (a U32 scalar), added up there
    /// so that counting never waits for the device; folded into `experts` when read.
    on_device: Mutex<Option<Tensor>>,
}

impl TrafficCounters {
    /// Counts one call routed as `expert_ids [N, k]` among `num_experts`.
    fn record(&self, expert_ids: &Tensor, num_experts: usize) -> candle::Result<()> {
        let tokens = expert_ids.dim(0)? as u64;
        if expert_ids.device().is_cpu() {
            let ids = expert_ids.flatten_all()?.to_vec1::<u32>()?;
            let mut seen = vec![false; num_experts];
            let distinct = ids
                .iter()
                .filter(|&&e| !std::mem::replace(&mut seen[e as usize % num_experts], true))
                .count();
            self.experts.fetch_add(distinct as u64, Ordering::Relaxed);
        } else if !crate::kernels::stream_is_capturing(expert_ids.device())? {
            // Not while a CUDA graph is being captured: replacing the running sum would free,
            // inside the capture, a tensor allocated before it. A captured call counts its call
            // and tokens once, and its experts not at all.
            let distinct = distinct_experts(expert_ids, num_experts)?;
            let mut acc = self.on_device.lock().unwrap_or_else(|e| e.into_inner());
            *acc = Some(match acc.take() {
                Some(sum) => (sum + distinct)?,
                None => distinct,
            });
        }
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.tokens.fetch_add(tokens, Ordering::Relaxed);
        Ok(())
    }

    /// The totals, with `bytes_per_expert` bytes per expert read (waits for the device when
    /// counts are pending there; a count the device cannot return stays pending).
    fn read(&self, bytes_per_expert: usize) -> ExpertTraffic {
        let mut acc = self.on_device.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(Ok(n)) = acc.as_ref().map(Tensor::to_scalar::<u32>) {
            self.experts.fetch_add(u64::from(n), Ordering::Relaxed);
            *acc = None;
        }
        let experts_read = self.experts.load(Ordering::Relaxed);
        ExpertTraffic {
            calls: self.calls.load(Ordering::Relaxed),
            tokens: self.tokens.load(Ordering::Relaxed),
            experts_read,
            bytes_read: experts_read * bytes_per_expert as u64,
        }
    }
}

/// How many distinct experts `expert_ids [N, k]` (U32, ids below `num_experts`) name, as a U32
/// scalar computed on the ids' device (no host synchronisation).
pub fn distinct_experts(expert_ids: &Tensor, num_experts: usize) -> candle::Result<Tensor> {
    let ids = expert_ids.flatten_all()?;
    let device = ids.device();
    let ones = Tensor::ones(ids.elem_count(), DType::F32, device)?;
    Tensor::zeros(num_experts, DType::F32, device)?
        .index_add(&ids, &ones, 0)?
        .gt(0.0)?
        .to_dtype(DType::U32)?
        .sum_all()
}

/// The next MoE layer's router and experts, for prefetching its likely experts.
#[derive(Clone)]
struct PrefetchTarget {
    router: DenseLinear,
    top_k: usize,
    experts: Arc<dyn RoutedExperts>,
}

/// Most tokens of a call for which the next layer's experts are prefetched: beyond a few tokens
/// a call routes to most experts anyway.
pub const PREFETCH_MAX_TOKENS: usize = 4;

/// A sparse MoE block with a swappable routed-experts backend.
#[derive(Clone)]
pub struct SparseMoe {
    router: DenseLinear,
    experts: Arc<dyn RoutedExperts>,
    top_k: usize,
    norm_topk_prob: bool,
    shared: Option<SharedExpert>,
    /// Boxed: rarely set, and it holds a whole router.
    prefetch: Option<Box<PrefetchTarget>>,
    traffic: Arc<TrafficCounters>,
}

impl std::fmt::Debug for SparseMoe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SparseMoe")
            .field("num_experts", &self.experts.num_experts())
            .field("top_k", &self.top_k)
            .field("norm_topk_prob", &self.norm_topk_prob)
            .field("shared_expert", &self.shared.is_some())
            .field("prefetch_next", &self.prefetch.is_some())
            .finish()
    }
}

impl SparseMoe {
    /// Builds the block, checking `1 ≤ top_k ≤ experts`, the router's shape and the shared
    /// expert's hidden size against the experts'.
    pub fn new(
        router: impl Into<DenseLinear>,
        experts: Arc<dyn RoutedExperts>,
        top_k: usize,
        norm_topk_prob: bool,
        shared: Option<SharedExpert>,
    ) -> candle::Result<Self> {
        let router = router.into();
        let e = experts.num_experts();
        if top_k == 0 || top_k > e {
            return Err(QmoeError::InvalidArgument {
                argument: "top_k".into(),
                reason: format!("top-k = {top_k} with {e} experts"),
            }
            .into());
        }
        let want = (e, experts.hidden_size());
        if router.dims() != want {
            // A Candle `Linear` whose weight is not 2-D has no `dims`: name its real shape.
            let got = router.weight().map_or_else(
                || vec![router.dims().0, router.dims().1],
                |w| w.dims().to_vec(),
            );
            return Err(QmoeError::ShapeMismatch {
                tensor: "router (gate.weight)".into(),
                got,
                expected: vec![want.0, want.1],
            }
            .into());
        }
        if let Some(shared) = shared.as_ref().filter(|s| s.hidden_size() != want.1) {
            return Err(QmoeError::ShapeMismatch {
                tensor: "shared expert (shared_expert_gate.weight)".into(),
                got: vec![1, shared.hidden_size()],
                expected: vec![1, want.1],
            }
            .into());
        }
        Ok(Self {
            router,
            experts,
            top_k,
            norm_topk_prob,
            shared,
            prefetch: None,
            traffic: Arc::default(),
        })
    }

    /// From now on, before computing its experts, this block applies `next`'s router to its
    /// own input (a cheap guess at `next`'s routing) and asks `next`'s experts to prefetch the
    /// guess, so the copies overlap this block's compute. Does nothing when `next`'s backend
    /// cannot prefetch; returns whether it was linked.
    pub fn prefetch_for(&mut self, next: &SparseMoe) -> bool {
        let linked = next.experts.supports_prefetch();
        self.prefetch = linked.then(|| {
            Box::new(PrefetchTarget {
                router: next.router.clone(),
                top_k: next.top_k,
                experts: next.experts.clone(),
            })
        });
        linked
    }

    /// Issues the prefetch of the next layer's guessed experts for `xs [N, H]`.
    fn prefetch_next(&self, xs: &Tensor) -> candle::Result<()> {
        let Some(next) = &self.prefetch else {
            return Ok(());
        };
        if xs.dim(0)? > PREFETCH_MAX_TOKENS {
            return Ok(());
        }
        let ids = next
            .router
            .forward(xs)?
            .arg_sort_last_dim(false)?
            .narrow(D::Minus1, 0, next.top_k)?
            .flatten_all()?
            .to_vec1::<u32>()?;
        next.experts.prefetch(&ids)
    }

    /// Loads the router `{name}.weight` `[E, H]` from the MoE block's VarBuilder (`name` is
    /// `gate` in most families, [`crate::models::MoeNames::router`]).
    pub fn load_router(
        hidden: usize,
        num_experts: usize,
        name: &str,
        vb: VarBuilder,
    ) -> candle::Result<DenseLinear> {
        DenseLinear::load_no_bias(hidden, num_experts, vb.pp(name))
    }

    /// Loads the dense weights of the experts `experts.{e}.{gate,up,down}.weight` (with the
    /// projections' `names`) from the MoE block's VarBuilder.
    pub fn load_dense_experts(
        hidden: usize,
        intermediate: usize,
        num_experts: usize,
        names: ExpertNames,
        vb: VarBuilder,
    ) -> candle::Result<Vec<DenseExpert>> {
        (0..num_experts)
            .map(|e| Self::load_dense_expert(hidden, intermediate, e, names, vb.clone()))
            .collect()
    }

    /// Loads the dense weights of expert `e` (`experts.{e}.{gate,up,down}.weight`, with the
    /// projections' `names`) from the MoE block's VarBuilder.
    pub fn load_dense_expert(
        hidden: usize,
        intermediate: usize,
        e: usize,
        names: ExpertNames,
        vb: VarBuilder,
    ) -> candle::Result<DenseExpert> {
        let vb = vb.pp("experts").pp(e);
        let get = |proj: &str, shape: (usize, usize)| vb.pp(proj).get(shape, "weight");
        Ok(DenseExpert {
            gate: get(names.gate, (intermediate, hidden))?,
            up: get(names.up, (intermediate, hidden))?,
            down: get(names.down, (hidden, intermediate))?,
        })
    }

    /// Puts the shared expert's projections in INT8 ([`DenseLinear::to_int8`]); the router
    /// and the shared expert's gate, a few KiB that decide the routing, stay as loaded.
    pub fn quantize_shared_int8(&mut self) -> candle::Result<()> {
        if let Some(shared) = &mut self.shared {
            shared.mlp = shared.mlp.to_int8()?;
        }
        Ok(())
    }

    /// Weight bytes one token reads in this block: the router, its top-k experts and the
    /// shared expert.
    pub fn weight_bytes_per_token(&self) -> usize {
        self.weight_bytes_by_part().iter().map(|(_, b)| b).sum()
    }

    /// [`Self::weight_bytes_per_token`] by the part of the pass that reads them.
    pub fn weight_bytes_by_part(&self) -> [(Part, usize); 3] {
        [
            (Part::Router, self.router.weight_bytes()),
            (
                Part::RoutedExperts,
                self.top_k * self.experts.bytes_per_expert(),
            ),
            (
                Part::SharedExpert,
                self.shared.as_ref().map_or(0, SharedExpert::weight_bytes),
            ),
        ]
    }

    /// The routed experts' work since the block was built (shared with its clones): every
    /// call of [`Self::forward_with_routing`] counts its tokens and distinct experts.
    pub fn traffic(&self) -> ExpertTraffic {
        self.traffic.read(self.experts.bytes_per_expert())
    }

    /// The routed-experts backend.
    pub fn experts(&self) -> &Arc<dyn RoutedExperts> {
        &self.experts
    }

    /// Router logits, top-k experts and their weights for `xs [N, H]`.
    pub fn route(&self, xs: &Tensor) -> candle::Result<Routing> {
        let logits = self.router.forward(xs)?;
        let probs = candle_nn::ops::softmax_last_dim(&logits.to_dtype(DType::F32)?)?;
        let expert_ids = probs
            .arg_sort_last_dim(false)?
            .narrow(D::Minus1, 0, self.top_k)?
            .contiguous()?;
        let mut weights = probs.gather(&expert_ids, D::Minus1)?;
        if self.norm_topk_prob {
            weights = weights.broadcast_div(&weights.sum_keepdim(D::Minus1)?)?;
        }
        Ok(Routing {
            logits,
            expert_ids,
            weights,
        })
    }

    /// The block's output for `xs [..., H]` together with its routing.
    pub fn forward_with_routing(&self, xs: &Tensor) -> candle::Result<(Tensor, Routing)> {
        let dims = xs.dims().to_vec();
        let flat = xs.flatten_to(dims.len().saturating_sub(2))?;
        let flat = if dims.len() == 1 {
            flat.unsqueeze(0)?
        } else {
            flat
        };
        let routing = profile::time(Part::Router, || self.route(&flat))?;
        self.traffic
            .record(&routing.expert_ids, self.experts.num_experts())?;
        self.prefetch_next(&flat)?;
        let mut out = profile::time(Part::RoutedExperts, || {
            self.experts
                .forward(&flat, &routing.expert_ids, &routing.weights)
        })?;
        if let Some(shared) = &self.shared {
            out = profile::time(Part::SharedExpert, || out + shared.forward(&flat)?)?;
        }
        Ok((out.reshape(dims)?, routing))
    }
}

impl Module for SparseMoe {
    fn forward(&self, xs: &Tensor) -> candle::Result<Tensor> {
        Ok(self.forward_with_routing(xs)?.0)
    }
}
