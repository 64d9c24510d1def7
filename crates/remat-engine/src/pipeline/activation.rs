//! What the checkpoint manager stores: anything that knows its exact size and shape and can
//! make a deep copy of itself.

use std::convert::Infallible;

/// A boxed error from an activation's own copy routine (a memory pool refusing the copy, say).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// An activation the checkpoint manager can account for.
///
/// The manager never looks inside: it needs the exact bytes (for its memory estimate and the
/// memory-based strategy) and the shape (for the per-entry metadata).
pub trait Activation {
    /// Exact bytes held, computed from the element type and the shape.
    fn byte_size(&self) -> usize;

    /// The shape, outermost dimension first.
    fn shape(&self) -> Vec<usize>;
}

/// An activation that can be deep-copied, so that [`store`](super::CheckpointManager::store)
/// can keep a copy isolated from later changes to the caller's value. Activations that cannot
/// (a recorded graph) are handed over by value with
/// [`store_owned`](super::CheckpointManager::store_owned) instead.
pub trait DeepCopy: Activation + Sized {
    /// Why a deep copy can fail (for engine tensors: the stage's memory pool is full).
    type CopyError: std::error::Error + Send + Sync + 'static;

    /// A copy sharing no storage with `self`.
    fn deep_copy(&self) -> Result<Self, Self::CopyError>;
}

/// The element types a [`HostTensor`] can hold, with their exact width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    I64,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::I64 => 8,
        }
    }
}

/// A tensor in plain host memory, owned by no pool: what crosses a stage boundary (each stage
/// allocates from its own pool, so a value leaving a stage must leave that pool's accounting)
/// and what the manager's tests store.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: HostData,
}

/// The elements of a [`HostTensor`], row-major.
#[derive(Clone, Debug, PartialEq)]
pub enum HostData {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

/// A [`HostTensor`] whose element count does not match its shape.
#[derive(Debug, thiserror::Error)]
#[error("host tensor of shape {shape:?} needs {expected} elements but was given {actual}")]
pub struct HostShapeError {
    pub shape: Vec<usize>,
    pub expected: usize,
    pub actual: usize,
}

impl HostTensor {
    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Result<Self, HostShapeError> {
        Self::checked(shape, HostData::F32(data))
    }

    pub fn i64(shape: Vec<usize>, data: Vec<i64>) -> Result<Self, HostShapeError> {
        Self::checked(shape, HostData::I64(data))
    }

    fn checked(shape: Vec<usize>, data: HostData) -> Result<Self, HostShapeError> {
        let expected = shape.iter().product::<usize>();
        let actual = data.len();
        if expected != actual {
            return Err(HostShapeError {
                shape,
                expected,
                actual,
            });
        }
        Ok(Self { shape, data })
    }

    pub fn dtype(&self) -> DType {
        match self.data {
            HostData::F32(_) => DType::F32,
            HostData::I64(_) => DType::I64,
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The f32 elements, if that is what this tensor holds.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            HostData::F32(v) => Some(v),
            HostData::I64(_) => None,
        }
    }

    /// The i64 elements, if that is what this tensor holds.
    pub fn as_i64(&self) -> Option<&[i64]> {
        match &self.data {
            HostData::I64(v) => Some(v),
            HostData::F32(_) => None,
        }
    }
}

impl HostData {
    fn len(&self) -> usize {
        match self {
            HostData::F32(v) => v.len(),
            HostData::I64(v) => v.len(),
        }
    }
}

impl Activation for HostTensor {
    fn byte_size(&self) -> usize {
        self.numel() * self.dtype().size_bytes()
    }

    fn shape(&self) -> Vec<usize> {
        self.shape.clone()
    }
}

impl DeepCopy for HostTensor {
    type CopyError = Infallible;

    fn deep_copy(&self) -> Result<Self, Infallible> {
        Ok(self.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_size_comes_from_dtype_and_shape() {
        let f = HostTensor::f32(vec![2, 3, 5], vec![0.0; 30]).unwrap();
        assert_eq!(f.byte_size(), 120);
        let i = HostTensor::i64(vec![4, 7], vec![0; 28]).unwrap();
        assert_eq!(i.byte_size(), 224);
        let scalar = HostTensor::f32(vec![], vec![1.0]).unwrap();
        assert_eq!(scalar.byte_size(), 4);
        let empty = HostTensor::f32(vec![0, 9], vec![]).unwrap();
        assert_eq!(empty.byte_size(), 0);
    }

    #[test]
    fn mismatched_element_count_is_an_error_naming_the_shape() {
        let err = HostTensor::f32(vec![2, 2], vec![0.0; 3]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "host tensor of shape [2, 2] needs 4 elements but was given 3"
        );
    }
}
