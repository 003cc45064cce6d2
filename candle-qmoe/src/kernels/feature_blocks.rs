//! The output of a projection computed by parallel tasks, each owning a block of output features
//! of every token's row: written in place, with no `[n, m]` buffer to transpose afterwards. Its
//! own module, so that only [`par_feature_blocks`] can make a [`FeatureBlock`] (whose writes rely
//! on the blocks being disjoint).

use rayon::prelude::*;

/// `y [m, n]` (one row per token) computed by parallel tasks, each owning a block of `block`
/// output features (columns of `y`) of every token: `f(r0, &mut out)` fills features `r0 ..
/// r0 + out.features()` through `out`, so no task's output needs a transpose afterwards.
pub(crate) fn par_feature_blocks(
    m: usize,
    n: usize,
    block: usize,
    f: impl Fn(usize, &mut FeatureBlock) + Sync,
) -> Vec<f32> {
    assert!(block > 0, "blocks of no features");
    let mut y = vec![0f32; m * n];
    let base = SharedOut(y.as_mut_ptr());
    (0..n.div_ceil(block)).into_par_iter().for_each(|b| {
        let r0 = b * block;
        let mut out = FeatureBlock {
            y: &base,
            m,
            n,
            r0,
            features: block.min(n - r0),
        };
        f(r0, &mut out);
    });
    y
}

/// The output of [`par_feature_blocks`], shared by its tasks.
struct SharedOut(*mut f32);

// SAFETY: the tasks of `par_feature_blocks` write through it only via `FeatureBlock::set`, each
// to its own features, while the vector it points into outlives them untouched otherwise.
unsafe impl Sync for SharedOut {}

/// One task's features `r0 .. r0 + features` of every token of a [`par_feature_blocks`] output.
pub(crate) struct FeatureBlock<'a> {
    /// The whole output `y [m, n]`.
    y: &'a SharedOut,
    /// Tokens (rows of `y`).
    m: usize,
    /// Features per token (columns of `y`).
    n: usize,
    /// The block's first feature.
    r0: usize,
    /// How many features the block owns.
    features: usize,
}

impl FeatureBlock<'_> {
    /// How many output features this block owns.
    pub(crate) fn features(&self) -> usize {
        self.features
    }

    /// `y[t, r0 + r] = v`.
    ///
    /// # Panics
    /// When `t ≥ m` or `r` is not one of this block's features.
    #[inline]
    pub(crate) fn set(&mut self, t: usize, r: usize, v: f32) {
        assert!(
            t < self.m && r < self.features,
            "output ({t}, {r}) out of block"
        );
        // SAFETY: in bounds of `y [m, n]` (checked), and feature `r0 + r` belongs to this block
        // alone, so no other task writes or reads the element.
        unsafe { *self.y.0.add(t * self.n + self.r0 + r) = v }
    }
}
