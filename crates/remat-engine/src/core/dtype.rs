//! Element types. Storage carries a dtype tag so bf16/f16 can be added without touching the
//! graph; kernels are generic over [`Element`] and run in f32 (training) and f64 (gradient
//! checks).

use std::fmt;
use std::ops::{Add, AddAssign, Div, Mul, Neg, Sub};

/// The element type of a tensor's storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    F32,
    F64,
    BF16,
    F16,
}

impl DType {
    /// Bytes per element: the pool counts `numel * size_bytes()` exactly.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::BF16 | DType::F16 => 2,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        };
        f.write_str(s)
    }
}

/// A float type the kernels compute in.
pub trait Element:
    Copy
    + Send
    + Sync
    + Default
    + PartialOrd
    + fmt::Debug
    + 'static
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
{
    const DTYPE: DType;
    const ZERO: Self;
    const ONE: Self;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn tanh(self) -> Self;
    fn sqrt(self) -> Self;
    fn max(self, other: Self) -> Self;
}

macro_rules! impl_element {
    ($t:ty, $dt:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dt;
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            #[inline]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline]
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
        }
    };
}
impl_element!(f32, DType::F32);
impl_element!(f64, DType::F64);

/// Runs `$body` with `$T` bound to the Rust type of a float dtype (f32 or f64); any other
/// dtype is an [`crate::EngineError::UnsupportedDType`] naming `$what`.
#[macro_export]
macro_rules! float_dispatch {
    ($dtype:expr, $what:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            other => Err($crate::EngineError::UnsupportedDType {
                what: ($what).to_string(),
                dtype: other,
            }),
        }
    };
}
