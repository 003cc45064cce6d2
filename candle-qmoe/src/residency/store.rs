//! [`ExpertStore`]: one layer's bounded expert cache and its publication protocol.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::device::MemoryBackend;
use super::policy::{EvictionPolicy, PolicyKind};
use super::stats::ResidencyStats;
use super::NOT_RESIDENT;
use crate::pack::{ExpertLayout, LayerPack};
use crate::QmoeError;

/// A fixed ring of pinned staging buffers shared by the stores of a model; a buffer is reused
/// only after the copy that last read it has completed.
pub struct StagingRing<B: MemoryBackend> {
    buffers: Vec<(B::Staging, Option<B::Event>)>,
    next: usize,
    buffer_bytes: usize,
}

impl<B: MemoryBackend> StagingRing<B> {
    /// `count` buffers of `buffer_bytes` each.
    pub fn new(backend: &B, count: usize, buffer_bytes: usize) -> candle::Result<Self> {
        if count == 0 {
            return Err(
                QmoeError::Residency("the staging ring needs at least one buffer".into()).into(),
            );
        }
        let buffers = (0..count)
            .map(|_| Ok((backend.alloc_staging(buffer_bytes)?, None)))
            .collect::<candle::Result<_>>()?;
        Ok(Self {
            buffers,
            next: 0,
            buffer_bytes,
        })
    }

    /// Bytes of one buffer.
    pub fn buffer_bytes(&self) -> usize {
        self.buffer_bytes
    }

    /// Number of buffers.
    pub fn len(&self) -> usize {
        self.buffers.len()
    }

    /// Always false: a ring has at least one buffer.
    pub fn is_empty(&self) -> bool {
        self.buffers.is_empty()
    }

    /// Copies `bytes` into the next buffer once its previous copy completed, then enqueues
    /// `copy(buffer)` and remembers the event it returns.
    fn stage(
        &mut self,
        backend: &B,
        bytes: &[u8],
        copy: impl FnOnce(&B::Staging) -> candle::Result<B::Event>,
    ) -> candle::Result<B::Event> {
        let i = self.next;
        self.next = (i + 1) % self.buffers.len();
        let (buf, pending) = &mut self.buffers[i];
        if let Some(ev) = pending.take() {
            backend.wait(&ev)?;
        }
        backend.staging_mut(buf)?[..bytes.len()].copy_from_slice(bytes);
        let ev = copy(buf)?;
        *pending = Some(ev.clone());
        Ok(ev)
    }
}

/// One layer's expert cache (docs/architecture.md §4): the immutable host source, `capacity`
/// device slots, the published expert → slot table, and the counters.
///
/// [`ExpertStore::ensure`] makes a set of experts resident: each miss is staged through the
/// shared ring and copied into a free slot or a victim's slot that no kernel of this step reads,
/// after the kernels that last read that slot ([`ExpertStore::retire`]); the new table is
/// published in one step after all copies. If anything fails before publication, the previous
/// table stays published minus the slots a copy may have overwritten, and the error is returned.
pub struct ExpertStore<B: MemoryBackend> {
    // Fields drop in order: the backend first, so that the last store to go lets a backend that
    // copies asynchronously (CUDA) finish its copies before the arena and the staging ring,
    // which those copies write and read, are freed.
    backend: Arc<B>,
    source: LayerPack,
    arena: B::Arena,
    ring: Arc<Mutex<StagingRing<B>>>,
    table: Vec<u32>,
    owner: Vec<Option<usize>>,
    readers: Vec<Option<B::Event>>,
    policy: Box<dyn EvictionPolicy>,
    tick: u64,
    prefetched: Vec<bool>,
    /// Experts already counted as a hit or a miss in the current step.
    counted: Vec<bool>,
    unpublished: Vec<B::Event>,
    stats: ResidencyStats,
}

impl<B: MemoryBackend> std::fmt::Debug for ExpertStore<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertStore")
            .field("capacity", &self.capacity())
            .field("num_experts", &self.num_experts())
            .field("policy", &self.policy)
            .field("stats", &self.stats)
            .finish()
    }
}

impl<B: MemoryBackend> ExpertStore<B> {
    /// Admits a cache of `capacity` slots for `source` (checking `top_k ≤ capacity ≤ experts`
    /// and that a staging buffer holds one expert), allocates it, fills it with experts
    /// `0..capacity` and publishes that table.
    pub fn new(
        backend: Arc<B>,
        source: LayerPack,
        capacity: usize,
        top_k: usize,
        ring: Arc<Mutex<StagingRing<B>>>,
        policy: PolicyKind,
    ) -> candle::Result<Self> {
        let (e, slab) = (source.num_experts(), source.layout().slab_bytes());
        if capacity < top_k || capacity > e {
            return Err(QmoeError::Residency(format!(
                "a cache of {capacity} experts per layer must hold at least top-k = {top_k} and at \
                 most the layer's {e} experts"
            ))
            .into());
        }
        let staging = ring
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .buffer_bytes();
        if staging < slab {
            return Err(QmoeError::Residency(format!(
                "staging buffers of {staging} bytes cannot hold one expert of {slab} bytes"
            ))
            .into());
        }
        let arena = backend.alloc_arena(source.layout(), capacity, e)?;
        let mut store = Self {
            backend,
            source,
            arena,
            ring,
            table: vec![NOT_RESIDENT; e],
            owner: vec![None; capacity],
            readers: vec![None; capacity],
            policy: policy.build(e),
            tick: 0,
            prefetched: vec![false; e],
            counted: vec![false; e],
            unpublished: Vec::new(),
            stats: ResidencyStats::default(),
        };
        let initial: Vec<usize> = (0..capacity).collect();
        store.copy_in(&initial, Copy::Preload)?;
        Ok(store)
    }

    /// Slots in the cache.
    pub fn capacity(&self) -> usize {
        self.owner.len()
    }
    /// Experts in the layer.
    pub fn num_experts(&self) -> usize {
        self.table.len()
    }
    /// The slab layout.
    pub fn layout(&self) -> ExpertLayout {
        self.source.layout()
    }
    /// The immutable host source.
    pub fn source(&self) -> &LayerPack {
        &self.source
    }
    /// The device arena (slots and published table).
    pub fn arena(&self) -> &B::Arena {
        &self.arena
    }
    /// The expert → slot table of the last step (a prefetch's additions included; kernels see
    /// them once the next step publishes it).
    pub fn table(&self) -> &[u32] {
        &self.table
    }
    /// Whether `expert` is resident in the published table.
    pub fn is_resident(&self, expert: usize) -> bool {
        self.table[expert] != NOT_RESIDENT
    }
    /// The counters so far.
    pub fn stats(&self) -> &ResidencyStats {
        &self.stats
    }
    /// The memory backend.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }
    /// Starts a step routed to `routed` (distinct experts): settles the prefetch counters
    /// (prefetched experts used now, or wasted) and, when `misses_on_cpu`, marks the routed
    /// experts that are not resident to be computed from the host source (counted as misses
    /// and hybrid computations). Returns that mark per expert.
    pub fn begin_step(&mut self, routed: &[usize], misses_on_cpu: bool) -> Vec<bool> {
        self.counted.fill(false);
        for &e in routed {
            if std::mem::take(&mut self.prefetched[e]) {
                self.stats.prefetch_used += 1;
            }
        }
        for p in self.prefetched.iter_mut().filter(|p| **p) {
            *p = false;
            self.stats.prefetch_wasted += 1;
        }
        let mut on_cpu = vec![false; self.num_experts()];
        if misses_on_cpu {
            for &e in routed {
                if !self.is_resident(e) {
                    on_cpu[e] = true;
                    self.stats.misses += 1;
                    self.stats.hybrid_cpu_experts += 1;
                }
            }
        }
        on_cpu
    }

    /// Makes `experts` (distinct, at most `capacity`) resident and publishes the table kernels
    /// read from now on; counts misses (copies) and, once per step (since
    /// [`ExpertStore::begin_step`]), hits, so a step served in several calls (chunks of tokens)
    /// counts an expert that stays resident between them once.
    pub fn ensure(&mut self, experts: &[usize]) -> candle::Result<()> {
        self.copy_in(experts, Copy::Miss)
    }

    /// Starts copying the experts of `expert_ids` (a guess at the next step's routing, best
    /// first; duplicates and out-of-range ids are skipped, at most `capacity` are taken) that
    /// are not resident, evicting only experts outside the guess; counted as prefetches, not
    /// misses.
    pub fn prefetch(&mut self, expert_ids: &[u32]) -> candle::Result<()> {
        let mut seen = vec![false; self.num_experts()];
        let guess: Vec<usize> = expert_ids
            .iter()
            .map(|&e| e as usize)
            .filter(|&e| e < seen.len() && !std::mem::replace(&mut seen[e], true))
            .take(self.capacity())
            .collect();
        self.copy_in(&guess, Copy::Prefetch)
    }

    /// Records that the kernels enqueued so far read the slots of `experts`: their slots are
    /// reused only after those kernels finish.
    pub fn retire(&mut self, experts: &[usize]) -> candle::Result<()> {
        let ev = self.backend.record_readers()?;
        for &e in experts {
            let slot = self.table[e];
            if slot != NOT_RESIDENT {
                self.readers[slot as usize] = Some(ev.clone());
            }
        }
        Ok(())
    }

    fn copy_in(&mut self, experts: &[usize], kind: Copy) -> candle::Result<()> {
        if experts.len() > self.capacity() {
            return Err(QmoeError::Residency(format!(
                "{} experts requested at once from a cache of {} slots",
                experts.len(),
                self.capacity()
            ))
            .into());
        }
        let start = Instant::now();
        let mut wanted = vec![false; self.num_experts()];
        for &e in experts {
            wanted[e] = true;
        }
        let mut pending = self.table.clone();
        let mut owner = self.owner.clone();
        let mut targets = Vec::new();
        let mut copies = Vec::new();
        let mut outcome = Ok(());
        for &e in experts {
            self.tick += 1;
            if pending[e] != NOT_RESIDENT {
                if kind == Copy::Miss {
                    if !std::mem::replace(&mut self.counted[e], true) {
                        self.stats.hits += 1;
                    }
                    self.policy.on_access(e, self.tick);
                }
                continue;
            }
            let slot = match owner.iter().position(Option::is_none) {
                Some(free) => free,
                None => {
                    let candidates: Vec<usize> = owner
                        .iter()
                        .flatten()
                        .copied()
                        .filter(|&c| !wanted[c])
                        .collect();
                    let victim = self.policy.victim(&candidates, self.tick);
                    self.policy.on_evict(victim);
                    self.prefetched[victim] = false;
                    self.stats.evictions += u64::from(kind != Copy::Preload);
                    let slot = pending[victim] as usize;
                    pending[victim] = NOT_RESIDENT;
                    slot
                }
            };
            targets.push(slot);
            owner[slot] = Some(e);
            pending[e] = slot as u32;
            self.policy.on_access(e, self.tick);
            match self.copy_expert(e, slot) {
                Ok(ev) => copies.push(ev),
                Err(err) => {
                    outcome = Err(err);
                    break;
                }
            }
            let bytes = self.layout().slab_bytes() as u64;
            match kind {
                Copy::Preload => self.stats.preload_bytes += bytes,
                Copy::Miss => {
                    self.counted[e] = true;
                    self.stats.misses += 1;
                    self.stats.h2d_bytes += bytes;
                }
                Copy::Prefetch => {
                    self.stats.prefetch_issued += 1;
                    self.stats.h2d_bytes += bytes;
                    self.prefetched[e] = true;
                }
            }
        }
        // A prefetch's copies overlap the current layer's compute: their table is published
        // with this layer's next step, so the compute stream does not wait for them now.
        self.unpublished.extend(copies);
        let publish_now =
            kind != Copy::Prefetch && (!targets.is_empty() || !self.unpublished.is_empty());
        if outcome.is_ok() && publish_now {
            outcome = self
                .backend
                .publish(&mut self.arena, &pending, &self.unpublished);
        }
        if kind != Copy::Preload {
            self.stats.stall_s += start.elapsed().as_secs_f64();
        }
        match outcome {
            Ok(()) => {
                if !targets.is_empty() {
                    self.table = pending;
                    self.owner = owner;
                }
                if publish_now {
                    self.unpublished.clear();
                    self.stats.generations += 1;
                }
                Ok(())
            }
            Err(err) => {
                self.abandon(&targets);
                Err(err)
            }
        }
    }

    /// After a failed step: keeps the last table minus the experts whose slots a copy may have
    /// overwritten, and publishes that (after any deferred prefetch copies).
    fn abandon(&mut self, targets: &[usize]) {
        for &slot in targets {
            if let Some(old) = self.owner[slot].take() {
                self.table[old] = NOT_RESIDENT;
                self.policy.on_evict(old);
            }
        }
        for (e, p) in self.prefetched.iter_mut().enumerate() {
            *p &= self.table[e] != NOT_RESIDENT;
        }
        if (!targets.is_empty() || !self.unpublished.is_empty())
            && self
                .backend
                .publish(&mut self.arena, &self.table, &self.unpublished)
                .is_ok()
        {
            self.unpublished.clear();
            self.stats.generations += 1;
        }
    }

    /// Stages expert `e`'s slab (verified against its checksum the first time it is read) and
    /// enqueues its copy into `slot`.
    fn copy_expert(&mut self, e: usize, slot: usize) -> candle::Result<B::Event> {
        let bytes = self.source.verified_slab(e)?.bytes;
        let (backend, arena) = (&self.backend, &mut self.arena);
        let after = self.readers[slot].take();
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        ring.stage(backend, bytes, |buf| {
            backend.copy_to_slot(buf, bytes.len(), arena, slot, after.as_ref())
        })
    }
}

/// Why experts are copied in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Copy {
    /// The initial fill at start-up.
    Preload,
    /// Experts a step needs.
    Miss,
    /// A guess at the next step's experts.
    Prefetch,
}
