//! rayon's global pool, where every CPU kernel of ours and Candle's CPU matmul run: how a model
//! is driven on it, and its workers kept awake through a model step.
//!
//! A decode step on the CPU is a chain of short parallel ops (projections, attention, the
//! experts' two phases, per layer) with short serial ops between them (norms, rotary embedding,
//! routing). An idle rayon worker spins a few dozen `sched_yield` rounds and then sleeps on a
//! futex, so most parallel ops of a step first wake the other workers, and every wake-up costs
//! a system call and the time the woken core takes to start. [`with_workers_awake`] keeps the
//! workers polling for work for the length of one step instead, as llama.cpp's thread pool
//! does during a graph; `QMOE_POOL_SPIN=0` turns that off where other processes need the cores
//! in between.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Runs `f` on a thread of rayon's global pool (the pool every kernel of ours and Candle's CPU
/// matmul use) while the calling thread sleeps until it returns. A model driven from outside
/// the pool has one thread more than the cores: every parallel op wakes the caller when it ends,
/// and idle workers spin beside its serial ops. Driven from a worker, the serial ops run where
/// the parallel ones start (decode on 2 cores: 17 of 22 alternating runs faster, by 4% on
/// average; docs/architecture.md §3).
pub fn on_rayon_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| f())
}

/// Whether [`with_workers_awake`] keeps the workers awake: yes unless the environment variable
/// `QMOE_POOL_SPIN` is `0` or `off` (read once), for a machine whose cores other processes
/// need between the parallel ops of a step.
pub fn workers_stay_awake() -> bool {
    static AWAKE: OnceLock<bool> = OnceLock::new();
    *AWAKE.get_or_init(|| {
        !matches!(
            std::env::var("QMOE_POOL_SPIN").as_deref(),
            Ok("0") | Ok("off")
        )
    })
}

/// Set while some [`with_workers_awake`] holds the workers: a nested or concurrent call runs
/// its `f` plainly (a second poller on a worker already inside `f`'s work could wait for
/// itself).
static HELD: AtomicBool = AtomicBool::new(false);

/// Stores a value in a flag when dropped, also when `f` panics: clears [`HELD`], raises the
/// pollers' stop signal.
struct StoreOnDrop<'a>(&'a AtomicBool, bool);

impl Drop for StoreOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(self.1, Ordering::Release);
    }
}

/// One round of polling: runs a pending job of the pool if there is one, else yields the core
/// to whoever else wants it and comes straight back (a bare spin, `pause`, halved decode beside
/// a busy process and gained nothing alone).
fn run_a_job_or_yield() {
    if rayon::yield_now() != Some(rayon::Yield::Executed) {
        std::thread::yield_now();
    }
}

/// Runs `f` on a thread of rayon's pool (as [`on_rayon_pool`]) while every other worker polls
/// for work — runs whatever the pool has, else yields its core and asks again — until `f`
/// returns, instead of falling asleep between `f`'s parallel ops. The model's forward passes
/// on the CPU run through it. Decode of the OLMoE-1B-7B shape on 2 cores: 1.02–1.07× tokens/s
/// against letting the workers sleep, 0.94–1.02× beside another busy process
/// (docs/architecture.md §3). Just `on_rayon_pool(f)` when [`workers_stay_awake`] says no, in a
/// pool of one thread, and while another call of this function holds the workers (nested, or
/// from another thread).
pub fn with_workers_awake<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if !workers_stay_awake()
        || rayon::current_num_threads() < 2
        || HELD.swap(true, Ordering::AcqRel)
    {
        return on_rayon_pool(f);
    }
    let _held = StoreOnDrop(&HELD, false);
    let stop = AtomicBool::new(false);
    let polling = AtomicUsize::new(0);
    let pollers = rayon::current_num_threads() - 1;
    rayon::scope(|s| {
        let caller = rayon::current_thread_index();
        let (stop, polling) = (&stop, &polling);
        s.spawn_broadcast(move |_, ctx| {
            // The caller's own copy runs when it waits for jobs (or at the scope's end): it
            // must return at once, or the caller would wait inside it for itself.
            if Some(ctx.index()) == caller {
                return;
            }
            polling.fetch_add(1, Ordering::AcqRel);
            while !stop.load(Ordering::Acquire) {
                run_a_job_or_yield();
            }
        });
        let _stop = StoreOnDrop(stop, true);
        // `f` starts once every poller runs. A worker that stole a piece of `f`'s work before
        // taking its poller job would take it while waiting inside that piece and poll there
        // until `f` ends, while `f` waits for the piece: a deadlock (seen in a `parity` run,
        // reproduced by `tests/pool.rs`). A worker busy elsewhere starts its poller when it
        // next waits for work. The wait costs a sleeping worker's wake-up once per pass:
        // OLMoE decode on 2 cores 21.57 against 21.65 tok/s (medians of 6 alternating runs).
        while polling.load(Ordering::Acquire) < pollers {
            run_a_job_or_yield();
        }
        f()
    })
}
