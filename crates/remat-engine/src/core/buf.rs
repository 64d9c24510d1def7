//! The typed element buffer a tensor's storage owns ([`Buf`]): one `Vec` per dtype. Its own
//! module so that the pool, which keeps freed buffers for reuse, and the tensor, which
//! draws its storage from the pool, share it without importing each other.

use crate::core::dtype::{DType, Element};
use crate::core::error::{EngineError, Result};

/// The typed element buffer of a storage.
#[derive(Debug)]
pub enum Buf {
    F32(Vec<f32>),
    F64(Vec<f64>),
    BF16(Vec<half::bf16>),
    F16(Vec<half::f16>),
}

impl Buf {
    pub(crate) fn zeros(dtype: DType, n: usize) -> Buf {
        match dtype {
            DType::F32 => Buf::F32(vec![0.0; n]),
            DType::F64 => Buf::F64(vec![0.0; n]),
            DType::BF16 => Buf::BF16(vec![half::bf16::ZERO; n]),
            DType::F16 => Buf::F16(vec![half::f16::ZERO; n]),
        }
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        match self {
            Buf::F32(v) => v.len(),
            Buf::F64(v) => v.len(),
            Buf::BF16(v) => v.len(),
            Buf::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the allocation is exactly the elements (what the pool charged for).
    pub(crate) fn is_exact(&self) -> bool {
        match self {
            Buf::F32(v) => v.capacity() == v.len(),
            Buf::F64(v) => v.capacity() == v.len(),
            Buf::BF16(v) => v.capacity() == v.len(),
            Buf::F16(v) => v.capacity() == v.len(),
        }
    }

    pub(crate) fn fill_nan(&mut self) {
        match self {
            Buf::F32(v) => v.fill(f32::NAN),
            Buf::F64(v) => v.fill(f64::NAN),
            Buf::BF16(v) => v.fill(half::bf16::NAN),
            Buf::F16(v) => v.fill(half::f16::NAN),
        }
    }

    pub(crate) fn fill_zero(&mut self) {
        match self {
            Buf::F32(v) => v.fill(0.0),
            Buf::F64(v) => v.fill(0.0),
            Buf::BF16(v) => v.fill(half::bf16::ZERO),
            Buf::F16(v) => v.fill(half::f16::ZERO),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Buf::F32(_) => DType::F32,
            Buf::F64(_) => DType::F64,
            Buf::BF16(_) => DType::BF16,
            Buf::F16(_) => DType::F16,
        }
    }

    /// The elements as `T`, or a dtype mismatch error naming `what`.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        let found = self.dtype();
        let any: &dyn std::any::Any = match self {
            Buf::F32(v) => v,
            Buf::F64(v) => v,
            Buf::BF16(v) => v,
            Buf::F16(v) => v,
        };
        any.downcast_ref::<Vec<T>>()
            .map(Vec::as_slice)
            .ok_or(EngineError::DTypeMismatch {
                what: "tensor read".into(),
                expected: T::DTYPE,
                found,
            })
    }

    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        let found = self.dtype();
        let any: &mut dyn std::any::Any = match self {
            Buf::F32(v) => v,
            Buf::F64(v) => v,
            Buf::BF16(v) => v,
            Buf::F16(v) => v,
        };
        any.downcast_mut::<Vec<T>>()
            .map(Vec::as_mut_slice)
            .ok_or(EngineError::DTypeMismatch {
                what: "tensor write".into(),
                expected: T::DTYPE,
                found,
            })
    }
}
