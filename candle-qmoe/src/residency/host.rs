//! [`ExpertCompute`] for [`HostMemory`]: the CPU W4A16 kernel reading the cache's host slots.

use candle::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

use super::compute::{ExpertCompute, Split};
use super::device::{HostMemory, MemoryBackend};
use super::experts::{CostModel, ResidentExperts};
use crate::experts::{apply_cpu_op, routed_inputs};
use crate::kernels::cpu;
use crate::{QmoeError, RoutedExperts};

impl ExpertCompute for HostMemory {
    /// The CPU kernel continues each output sum where the previous piece stopped, so a step runs
    /// in ascending experts, copying each at most once; misses computed from the host source
    /// join the same sums in the same order, so hybrid compute changes no bit either.
    const SPLIT: Split = Split::Experts;

    /// The device is the CPU itself: copying a miss only adds work.
    fn cost_model(&self) -> CostModel {
        let link = self.link_bytes_per_s();
        CostModel {
            link,
            cpu: link,
            device: link,
        }
    }

    fn forward_resident(
        experts: &ResidentExperts<Self>,
        xs: &Tensor,
        expert_ids: &Tensor,
        weights: &Tensor,
    ) -> candle::Result<Tensor> {
        if !xs.device().is_cpu() {
            return Err(QmoeError::UnsupportedDevice {
                backend: "host-memory resident experts".into(),
                device: format!("{:?}", xs.device()),
            }
            .into());
        }
        apply_cpu_op(experts, xs, expert_ids, weights)
    }
}

impl CustomOp3 for ResidentExperts<HostMemory> {
    fn name(&self) -> &'static str {
        "qmoe-resident-int4-routed-experts"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle::Result<(CpuStorage, Shape)> {
        let (xs, w, plan) = routed_inputs((s1, l1), (s2, l2), (s3, l3), self.num_experts())?;
        let mut out = vec![0f32; xs.len()];
        let step = self.serve(&plan, |store, piece, on_cpu| {
            let (arena, source) = (store.arena(), store.source());
            let slab_of = |e: usize| match on_cpu[e] {
                true => source.slab(e).bytes,
                false => arena.slot(arena.table()[e] as usize),
            };
            let routes = piece.routes(&plan);
            cpu::routed_forward_into(
                self.isa(),
                cpu::DecodeActivations::current(),
                store.layout(),
                &slab_of,
                &routes,
                xs,
                w,
                &mut out,
            );
            Ok(())
        })?;
        // Every miss was computed within the pieces: the store can be unlocked now.
        drop(step);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}
