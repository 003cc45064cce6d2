//! The device memory the expert cache lives in, behind [`MemoryBackend`], and its host-memory
//! implementation [`HostMemory`].
//!
//! A backend provides the slot arena (one slab-sized slot per cached expert plus the
//! expert → slot table the kernels index through), pinned staging buffers, asynchronous
//! staging → slot copies that complete as events, publication of a slot table ordered after a
//! set of copies, and events that mark the end of the kernels that read the current table.
//! [`HostMemory`] follows the same steps in ordinary memory (copies are `memcpy`, every event is
//! complete when it is returned), counts the same bytes, can be given a capacity like a GPU's,
//! and can be told to fail a copy half-way, so the whole protocol runs and is tested on a CPU.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::pack::ExpertLayout;
use crate::QmoeError;

/// Device memory for the expert cache (see the module docs).
pub trait MemoryBackend: Send + Sync + 'static {
    /// Completion of enqueued work (a copy, or the kernels of a step).
    type Event: Clone + Send + Sync + std::fmt::Debug;
    /// One layer's slot arena and its expert → slot table.
    type Arena: Send;
    /// One pinned host staging buffer.
    type Staging: Send;

    /// Allocates `slots` slots of `layout`'s slab size and a table of `num_experts` entries, all
    /// marked not resident. Fails with [`QmoeError::OutOfMemory`] when the device cannot hold
    /// them.
    fn alloc_arena(
        &self,
        layout: ExpertLayout,
        slots: usize,
        num_experts: usize,
    ) -> candle::Result<Self::Arena>;
    /// Allocates a pinned staging buffer of `bytes`.
    fn alloc_staging(&self, bytes: usize) -> candle::Result<Self::Staging>;
    /// The host-writable bytes of a staging buffer whose last copy has completed.
    fn staging_mut<'a>(&self, staging: &'a mut Self::Staging) -> candle::Result<&'a mut [u8]>;
    /// Enqueues a copy of the first `len` bytes of `src` into `slot`, ordered after `after` (the
    /// kernels that last read the slot), and returns the copy's completion event.
    fn copy_to_slot(
        &self,
        src: &Self::Staging,
        len: usize,
        arena: &mut Self::Arena,
        slot: usize,
        after: Option<&Self::Event>,
    ) -> candle::Result<Self::Event>;
    /// Makes `table` (expert → slot, [`super::NOT_RESIDENT`] for absent experts) the table that
    /// kernels enqueued from now on read, ordered after the `copies`.
    fn publish(
        &self,
        arena: &mut Self::Arena,
        table: &[u32],
        copies: &[Self::Event],
    ) -> candle::Result<()>;
    /// An event that completes when the kernels enqueued so far have finished.
    fn record_readers(&self) -> candle::Result<Self::Event>;
    /// Blocks the host until `event` has completed.
    fn wait(&self, event: &Self::Event) -> candle::Result<()>;
    /// Bytes of device memory held by arenas and staging buffers now.
    fn allocated_bytes(&self) -> usize;
    /// The most bytes ever held at once.
    fn peak_bytes(&self) -> usize;
    /// Measured host → device copy bandwidth in bytes per second.
    fn link_bytes_per_s(&self) -> f64;
}

/// Byte accounting of a backend: bytes held now and at the peak, under an optional limit.
#[derive(Debug, Default)]
pub(crate) struct Usage {
    now: AtomicUsize,
    peak: AtomicUsize,
}

impl Usage {
    /// Reserves `bytes` under `limit`, or explains why it cannot; the bytes are returned when
    /// the reservation drops.
    pub(crate) fn reserve(
        self: &Arc<Self>,
        bytes: usize,
        limit: Option<usize>,
        what: &str,
    ) -> candle::Result<Reservation> {
        let mut now = self.now.load(Ordering::Relaxed);
        loop {
            let next = now + bytes;
            if let Some(limit) = limit.filter(|&l| next > l) {
                return Err(QmoeError::OutOfMemory {
                    what: what.into(),
                    needed: bytes,
                    reason: format!(
                        "only {} of the device's {limit} bytes are free",
                        limit - now
                    ),
                }
                .into());
            }
            match self
                .now
                .compare_exchange(now, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    self.peak.fetch_max(next, Ordering::Relaxed);
                    return Ok(Reservation {
                        bytes,
                        usage: self.clone(),
                    });
                }
                Err(v) => now = v,
            }
        }
    }

    /// Bytes held now.
    pub(crate) fn now(&self) -> usize {
        self.now.load(Ordering::Relaxed)
    }

    /// The most bytes held at once.
    pub(crate) fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }
}

/// Bytes counted against a [`Usage`] until dropped.
#[derive(Debug)]
pub(crate) struct Reservation {
    bytes: usize,
    usage: Arc<Usage>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.usage.now.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// A host buffer counted against its [`HostMemory`]'s capacity until dropped.
#[derive(Debug)]
pub struct HostBuffer {
    bytes: Vec<u8>,
    _reserved: Reservation,
}

impl HostBuffer {
    /// The buffer's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// A layer's slot arena in host memory.
#[derive(Debug)]
pub struct HostArena {
    slots: HostBuffer,
    slab_bytes: usize,
    table: Vec<u32>,
}

impl HostArena {
    /// The bytes of `slot`.
    pub fn slot(&self, slot: usize) -> &[u8] {
        &self.slots.bytes()[slot * self.slab_bytes..(slot + 1) * self.slab_bytes]
    }
    /// The published expert → slot table.
    pub fn table(&self) -> &[u32] {
        &self.table
    }
}

/// Completion of host work: the host implementation finishes everything before returning, so
/// an event only carries its sequence number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostEvent(pub u64);

/// [`MemoryBackend`] in ordinary host memory (see the module docs).
#[derive(Debug)]
pub struct HostMemory {
    limit: Option<usize>,
    usage: Arc<Usage>,
    events: AtomicU64,
    /// Copies left before the injected failure (`u64::MAX`: none).
    fail_in: AtomicU64,
}

impl Default for HostMemory {
    fn default() -> Self {
        Self::new(None)
    }
}

impl HostMemory {
    /// Host "device" memory holding at most `limit` bytes (unbounded when `None`).
    pub fn new(limit: Option<usize>) -> Self {
        Self {
            limit,
            usage: Arc::default(),
            events: AtomicU64::new(0),
            fail_in: AtomicU64::new(u64::MAX),
        }
    }

    /// Fault injection: the copy after `copies` more successful ones fails half-way through,
    /// leaving garbage in half of its slot, as a failed DMA would.
    pub fn fail_copy_after(&self, copies: u64) {
        self.fail_in.store(copies, Ordering::SeqCst);
    }

    fn buffer(&self, bytes: usize, what: &str) -> candle::Result<HostBuffer> {
        let mut v = Vec::new();
        if v.try_reserve_exact(bytes).is_err() {
            return Err(QmoeError::OutOfMemory {
                what: what.into(),
                needed: bytes,
                reason: "the host cannot allocate them".into(),
            }
            .into());
        }
        let reserved = self.usage.reserve(bytes, self.limit, what)?;
        v.resize(bytes, 0);
        Ok(HostBuffer {
            bytes: v,
            _reserved: reserved,
        })
    }

    fn event(&self) -> HostEvent {
        HostEvent(self.events.fetch_add(1, Ordering::Relaxed))
    }
}

impl MemoryBackend for HostMemory {
    type Event = HostEvent;
    type Arena = HostArena;
    type Staging = HostBuffer;

    fn alloc_arena(
        &self,
        layout: ExpertLayout,
        slots: usize,
        num_experts: usize,
    ) -> candle::Result<HostArena> {
        let slab_bytes = layout.slab_bytes();
        let what = format!("an expert cache of {slots} slots × {slab_bytes} bytes");
        Ok(HostArena {
            slots: self.buffer(slots * slab_bytes, &what)?,
            slab_bytes,
            table: vec![super::NOT_RESIDENT; num_experts],
        })
    }

    fn alloc_staging(&self, bytes: usize) -> candle::Result<HostBuffer> {
        self.buffer(bytes, &format!("a staging buffer of {bytes} bytes"))
    }

    fn staging_mut<'a>(&self, staging: &'a mut HostBuffer) -> candle::Result<&'a mut [u8]> {
        Ok(&mut staging.bytes)
    }

    fn copy_to_slot(
        &self,
        src: &HostBuffer,
        len: usize,
        arena: &mut HostArena,
        slot: usize,
        _after: Option<&HostEvent>,
    ) -> candle::Result<HostEvent> {
        let n = arena.slab_bytes;
        if len > n || len > src.bytes.len() {
            candle::bail!("copy of {len} bytes into a slot of {n} bytes");
        }
        let dst = &mut arena.slots.bytes[slot * n..slot * n + len];
        let fail = self
            .fail_in
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| {
                (v != u64::MAX).then(|| v.saturating_sub(1))
            })
            .is_ok_and(|before| before == 0);
        if fail {
            self.fail_in.store(u64::MAX, Ordering::SeqCst);
            dst[..len / 2].fill(0xA5);
            return Err(QmoeError::CopyFailed {
                slot,
                bytes: len,
                reason: "injected failure".into(),
            }
            .into());
        }
        dst.copy_from_slice(&src.bytes[..len]);
        Ok(self.event())
    }

    fn publish(
        &self,
        arena: &mut HostArena,
        table: &[u32],
        _copies: &[HostEvent],
    ) -> candle::Result<()> {
        arena.table.copy_from_slice(table);
        Ok(())
    }

    fn record_readers(&self) -> candle::Result<HostEvent> {
        Ok(self.event())
    }

    fn wait(&self, _event: &HostEvent) -> candle::Result<()> {
        Ok(())
    }

    fn allocated_bytes(&self) -> usize {
        self.usage.now()
    }

    fn peak_bytes(&self) -> usize {
        self.usage.peak()
    }

    fn link_bytes_per_s(&self) -> f64 {
        host_copy_bytes_per_s()
    }
}

/// The host's `memcpy` bandwidth in bytes per second (best of three 8 MiB copies, measured
/// once per process): the link of [`HostMemory`] and a proxy of how fast the CPU kernel streams
/// a slab.
pub fn host_copy_bytes_per_s() -> f64 {
    static BW: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *BW.get_or_init(|| {
        let src = vec![1u8; 8 << 20];
        let mut dst = vec![0u8; src.len()];
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            best = best.min(t.elapsed().as_secs_f64());
        }
        std::hint::black_box(&dst);
        src.len() as f64 / best.max(1e-9)
    })
}
