//! Byte counts: the `[min, max]` ranges the plan predicts, and memory sizes read from and
//! written for people (`6GiB` in, `5.73 GiB` out).

use serde::Serialize;

use super::plan_err;
use crate::QmoeError;

/// Bytes in a mebibyte.
pub(super) const MIB: u64 = 1 << 20;

/// `bytes` with a binary unit, two decimals above plain bytes (`512 B`, `5.73 GiB`).
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// Parses a memory size: a whole number of bytes (`6442450944`), or a number with a decimal
/// unit `B`, `KB`, `MB`, `GB`, `TB` (powers of 1000) or a binary unit `KiB`, `MiB`, `GiB`, `TiB`
/// (powers of 1024), unit letters in any case, no space: `6GiB`, `6000MB`, `7.5GiB`.
///
/// Spaces inside (`6 GB`), signs (`-1`), words (`lots`), unknown units (`6G`), zero and sizes
/// beyond `u64` are errors ([`QmoeError::Plan`]) that say what to write instead.
pub fn parse_bytes(s: &str) -> Result<u64, QmoeError> {
    let bad = |why: &str| {
        plan_err(format!(
            "invalid memory size `{s}`: {why} (write e.g. 6GiB, 6000MB, 512MiB or a number of \
             bytes)"
        ))
    };
    let t = s.trim();
    if t.is_empty() {
        return Err(bad("it is empty"));
    }
    if t.chars().any(char::is_whitespace) {
        return Err(bad("no space is allowed inside it"));
    }
    if t.starts_with('-') {
        return Err(bad("a memory size cannot be negative"));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if int.is_empty() || (number.contains('.') && frac.is_empty()) || frac.contains('.') {
        return Err(bad("it does not start with a number"));
    }
    let scale: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => {
            return Err(bad(&format!(
                "unknown unit `{unit}`; use B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, \
                 TiB (powers of 1024)"
            )))
        }
    };
    if !frac.is_empty() && scale == 1 {
        return Err(bad("a number of bytes must be whole"));
    }
    if int.len() > 20 || frac.len() > 12 {
        return Err(bad("it is too large or too precise"));
    }
    let digits = |d: &str| d.parse::<u128>().unwrap_or(0);
    let frac_bytes = digits(frac) * scale / 10u128.pow(frac.len() as u32);
    let bytes = digits(int) * scale + frac_bytes;
    if bytes == 0 {
        return Err(bad("it must be greater than zero"));
    }
    u64::try_from(bytes).map_err(|_| bad("it is too large"))
}

/// A byte range `[min, max]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ByteRange {
    /// Lower bound in bytes.
    #[serde(rename = "min_bytes")]
    pub min: u64,
    /// Upper bound in bytes.
    #[serde(rename = "max_bytes")]
    pub max: u64,
}

impl ByteRange {
    /// `[min, max]`.
    pub const fn new(min: u64, max: u64) -> Self {
        Self { min, max }
    }

    /// A range of exactly `bytes`.
    pub const fn exact(bytes: u64) -> Self {
        Self::new(bytes, bytes)
    }

    /// The element-wise larger of two ranges.
    pub(super) fn max_of(self, other: Self) -> Self {
        Self::new(self.min.max(other.min), self.max.max(other.max))
    }
}

impl std::ops::Add for ByteRange {
    type Output = Self;

    fn add(self, rhs: Self) -> Self {
        Self::new(
            self.min.saturating_add(rhs.min),
            self.max.saturating_add(rhs.max),
        )
    }
}

impl std::iter::Sum for ByteRange {
    fn sum<I: Iterator<Item = Self>>(iter: I) -> Self {
        iter.fold(Self::default(), |a, b| a + b)
    }
}
