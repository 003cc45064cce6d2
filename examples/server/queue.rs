//! The engine's queue: requests waiting for a slot, at most `--queue` live ones. A request whose
//! client went away gives its place up at once (such requests are dropped whenever the queue is
//! read), and closing the queue (shutdown) wakes the engine even while it waits idle.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};

use crate::engine::Request;

/// Why a request was not queued.
#[derive(Debug)]
pub enum Refused {
    /// `--queue` requests are waiting.
    Full,
    /// The server is shutting down.
    Closed,
}

#[derive(Default)]
struct State {
    waiting: VecDeque<Request>,
    closed: bool,
}

impl State {
    /// Drops the requests whose client went away.
    fn drop_abandoned(&mut self) {
        self.waiting.retain(|r| !r.events.is_closed());
    }
}

/// Requests waiting for a slot, shared by the HTTP handlers and the engine.
pub struct Queue {
    capacity: usize,
    state: Mutex<State>,
    changed: Condvar,
}

impl Queue {
    /// An open queue of `capacity` places.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            state: Mutex::default(),
            changed: Condvar::new(),
        }
    }

    /// The state, without the requests whose client went away.
    fn live(&self) -> MutexGuard<'_, State> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.drop_abandoned();
        state
    }

    /// Queues `request` unless the queue is full or closed.
    pub fn push(&self, request: Request) -> Result<(), Refused> {
        let mut state = self.live();
        if state.closed {
            return Err(Refused::Closed);
        }
        if state.waiting.len() >= self.capacity {
            return Err(Refused::Full);
        }
        state.waiting.push_back(request);
        self.changed.notify_one();
        Ok(())
    }

    /// Requests waiting whose client is still there.
    pub fn waiting(&self) -> usize {
        self.live().waiting.len()
    }

    /// The oldest waiting request; with `wait`, blocks until one comes. `None` when there is
    /// none (without `wait`) or the queue is closed.
    pub fn pop(&self, wait: bool) -> Option<Request> {
        let mut state = self.live();
        loop {
            if state.closed {
                return None;
            }
            if let Some(request) = state.waiting.pop_front() {
                return Some(request);
            }
            if !wait {
                return None;
            }
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
            state.drop_abandoned();
        }
    }

    /// Refuses new requests from now on and wakes the engine, which then fails the requests in
    /// flight and stops (shutdown).
    pub fn close(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        self.changed.notify_all();
    }

    /// Whether [`Self::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).closed
    }

    /// The requests still waiting (after [`Self::close`]: nothing comes after them).
    pub fn drain(&self) -> Vec<Request> {
        self.live().waiting.drain(..).collect()
    }
}

/// Closes the queue when dropped and drops the requests still waiting (their clients see the
/// engine gone): held by the engine's thread, so that its end, a panic included, is the
/// queue's too.
pub struct ClosesOnDrop(pub std::sync::Arc<Queue>);

impl Drop for ClosesOnDrop {
    fn drop(&mut self) {
        self.0.close();
        drop(self.0.drain());
    }
}
