//! Contiguous row-major tensors whose storage is accounted in a [`MemoryPool`].
//!
//! A [`Tensor`] is a shape plus a shared storage (`Arc`): cloning is cheap and shares the
//! bytes (reshape is a zero-copy view). Storage sits behind a read/write lock so a parameter
//! can be updated in place while graphs hold it; every write bumps the storage's version
//! counter, which is how backward detects a saved tensor modified in place.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::core::dtype::{DType, Element};
use crate::core::error::{EngineError, Result};
use crate::core::pool::{Category, MemoryPool, PoolOom, Reservation};

pub use crate::core::buf::Buf;

#[derive(Debug)]
struct Storage {
    /// Fixed for the storage's life; kept outside the lock so reading it never waits on a
    /// writer (and never deadlocks against one on the same thread).
    dtype: DType,
    buf: RwLock<Buf>,
    version: AtomicU64,
    reservation: Reservation,
}

impl Drop for Storage {
    /// The buffer goes back to the pool with its bytes, for reuse (see `buffer_cache`).
    fn drop(&mut self) {
        let buf = self.buf.get_mut().unwrap_or_else(|e| e.into_inner());
        let buf = std::mem::replace(buf, Buf::F32(Vec::new()));
        self.reservation.release_with(buf);
    }
}

/// A contiguous row-major tensor. `Send + Sync`; clones share storage.
#[derive(Clone, Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Arc<Storage>,
}

/// Number of elements of a shape (1 for a scalar `[]`).
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Bytes a tensor of this shape and dtype takes in the pool.
pub fn nbytes(shape: &[usize], dtype: DType) -> u64 {
    (numel(shape) * dtype.size_bytes()) as u64
}

impl Tensor {
    fn from_buf(
        pool: &Arc<MemoryPool>,
        shape: &[usize],
        buf: Buf,
        category: Category,
        node: Option<usize>,
    ) -> Result<Tensor, PoolOom> {
        let reservation = pool.reserve(nbytes(shape, buf.dtype()), category, node)?;
        Ok(Tensor {
            shape: shape.to_vec(),
            storage: Arc::new(Storage {
                dtype: buf.dtype(),
                buf: RwLock::new(buf),
                version: AtomicU64::new(0),
                reservation,
            }),
        })
    }

    /// A zero-filled tensor. The pool is charged before the buffer is allocated.
    pub fn zeros(
        pool: &Arc<MemoryPool>,
        shape: &[usize],
        dtype: DType,
        category: Category,
        node: Option<usize>,
    ) -> Result<Tensor, PoolOom> {
        Tensor::allocate(pool, shape, dtype, category, node, true)
    }

    /// A tensor whose elements are unspecified: zeros, or the stale values of a buffer the
    /// pool reused. For kernels that write every element before anything reads one; it
    /// saves zeroing a buffer that is about to be overwritten.
    pub fn for_overwrite(
        pool: &Arc<MemoryPool>,
        shape: &[usize],
        dtype: DType,
        category: Category,
        node: Option<usize>,
    ) -> Result<Tensor, PoolOom> {
        Tensor::allocate(pool, shape, dtype, category, node, false)
    }

    fn allocate(
        pool: &Arc<MemoryPool>,
        shape: &[usize],
        dtype: DType,
        category: Category,
        node: Option<usize>,
        zeroed: bool,
    ) -> Result<Tensor, PoolOom> {
        let n = numel(shape);
        let (reservation, reused) =
            pool.reserve_buffer(nbytes(shape, dtype), category, node, Some((dtype, n)))?;
        let mut buf = match reused {
            Some(mut buf) => {
                if zeroed {
                    buf.fill_zero();
                }
                buf
            }
            None => Buf::zeros(dtype, n),
        };
        if !zeroed && pool.poisons_overwritten() {
            buf.fill_nan();
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            storage: Arc::new(Storage {
                dtype,
                buf: RwLock::new(buf),
                version: AtomicU64::new(0),
                reservation,
            }),
        })
    }

    /// Wraps `data` (its length must match the shape); `name` is used in errors.
    pub fn from_vec<T: Element>(
        pool: &Arc<MemoryPool>,
        name: &str,
        shape: &[usize],
        mut data: Vec<T>,
        category: Category,
    ) -> Result<Tensor> {
        if data.len() != numel(shape) {
            return Err(EngineError::DataLength {
                name: name.into(),
                shape: shape.to_vec(),
                numel: data.len(),
                expected: numel(shape),
            });
        }
        // The pool counts numel * size; keep the real allocation equal to it.
        data.shrink_to_fit();
        let any: Box<dyn std::any::Any> = Box::new(data);
        let buf = match T::DTYPE {
            DType::F32 => Buf::F32(*any.downcast::<Vec<f32>>().map_err(|_| bad_elem(name))?),
            DType::F64 => Buf::F64(*any.downcast::<Vec<f64>>().map_err(|_| bad_elem(name))?),
            other => {
                return Err(EngineError::UnsupportedDType {
                    what: format!("tensor {name}"),
                    dtype: other,
                });
            }
        };
        Tensor::from_buf(pool, shape, buf, category, None).map_err(|e| e.at(name))
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }

    pub fn dtype(&self) -> DType {
        self.storage.dtype
    }

    /// Bytes charged to the pool for this tensor's storage.
    pub fn bytes(&self) -> u64 {
        self.storage.reservation.bytes()
    }

    pub fn category(&self) -> Category {
        self.storage.reservation.category()
    }

    pub fn pool(&self) -> &Arc<MemoryPool> {
        self.storage.reservation.pool()
    }

    /// The storage's version: bumped by every [`Tensor::write`].
    pub fn version(&self) -> u64 {
        self.storage.version.load(Ordering::Acquire)
    }

    /// Whether two tensors share one storage.
    pub fn same_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }

    /// Number of tensors (and graph slots) sharing this storage.
    pub fn storage_refs(&self) -> usize {
        Arc::strong_count(&self.storage)
    }

    pub fn read(&self) -> TensorRead<'_> {
        TensorRead {
            buf: self.storage.buf.read().unwrap_or_else(|e| e.into_inner()),
        }
    }

    /// Write access; bumps the version counter (an in-place modification).
    pub fn write(&self) -> TensorWrite<'_> {
        self.storage.version.fetch_add(1, Ordering::AcqRel);
        TensorWrite {
            buf: self.storage.buf.write().unwrap_or_else(|e| e.into_inner()),
        }
    }

    /// A zero-copy view with another shape of the same element count.
    pub fn reshaped(&self, shape: &[usize]) -> Result<Tensor> {
        if numel(shape) != self.numel() {
            return Err(EngineError::Invalid(format!(
                "cannot reshape {:?} ({} elements) to {:?}",
                self.shape,
                self.numel(),
                shape
            )));
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            storage: Arc::clone(&self.storage),
        })
    }

    /// A copy with its own storage in `category`.
    pub fn deep_copy(&self, category: Category) -> Result<Tensor, PoolOom> {
        let src = self.read();
        let buf = match &src.buf as &Buf {
            Buf::F32(v) => Buf::F32(v.clone()),
            Buf::F64(v) => Buf::F64(v.clone()),
            Buf::BF16(v) => Buf::BF16(v.clone()),
            Buf::F16(v) => Buf::F16(v.clone()),
        };
        Tensor::from_buf(self.pool(), &self.shape, buf, category, None)
    }

    /// The elements converted to f64 (any dtype).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.read().buf as &Buf {
            Buf::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Buf::F64(v) => v.clone(),
            Buf::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            Buf::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
        }
    }

    /// The elements as a `Vec<T>` (dtype must match).
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        Ok(self.read().as_slice::<T>()?.to_vec())
    }

    /// Bitwise equality of shape, dtype and every element.
    pub fn bit_eq(&self, other: &Tensor) -> bool {
        if self.shape != other.shape {
            return false;
        }
        let (a, b) = (self.read(), other.read());
        match (&a.buf as &Buf, &b.buf as &Buf) {
            (Buf::F32(x), Buf::F32(y)) => x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
            (Buf::F64(x), Buf::F64(y)) => x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
            (Buf::BF16(x), Buf::BF16(y)) => {
                x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
            }
            (Buf::F16(x), Buf::F16(y)) => x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
            _ => false,
        }
    }
}

fn bad_elem(name: &str) -> EngineError {
    EngineError::Invalid(format!(
        "tensor {name}: element type does not match its dtype"
    ))
}

/// Read access to a tensor's elements.
pub struct TensorRead<'a> {
    buf: RwLockReadGuard<'a, Buf>,
}

impl TensorRead<'_> {
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        self.buf.as_slice()
    }
    pub fn buf(&self) -> &Buf {
        &self.buf
    }
}

/// Write access to a tensor's elements.
pub struct TensorWrite<'a> {
    buf: RwLockWriteGuard<'a, Buf>,
}

impl TensorWrite<'_> {
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        self.buf.as_mut_slice()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_is_charged_and_returned() {
        let pool = MemoryPool::unbounded();
        let t = Tensor::zeros(&pool, &[3, 5], DType::F32, Category::Activations, None).unwrap();
        assert_eq!(pool.live(), 60);
        let view = t.reshaped(&[15]).unwrap();
        assert_eq!(pool.live(), 60, "a view shares the storage");
        drop(t);
        assert_eq!(pool.live(), 60);
        drop(view);
        assert_eq!(pool.live(), 0);
    }

    #[test]
    fn a_freed_buffer_is_reused_zeroed_or_as_is() {
        let pool = MemoryPool::unbounded();
        let shape = [64, 64]; // 16 KiB of f32: large enough to be kept
        let ones = |t: &Tensor| t.write().as_mut_slice::<f32>().unwrap().fill(1.0);
        let t = Tensor::zeros(&pool, &shape, DType::F32, Category::Activations, None).unwrap();
        ones(&t);
        drop(t);
        let s = pool.stats();
        assert_eq!((s.live, s.cached, s.peak), (0, 16384, 16384));
        // Zeroed on reuse, even though the buffer held ones.
        let z = Tensor::zeros(&pool, &shape, DType::F32, Category::Temporaries, None).unwrap();
        assert!(z.to_vec::<f32>().unwrap().iter().all(|&v| v == 0.0));
        assert_eq!(
            (pool.live(), pool.cached(), pool.stats().cache_hits),
            (16384, 0, 1)
        );
        ones(&z);
        drop(z);
        // For overwrite: handed out as is (here, still the ones).
        let o =
            Tensor::for_overwrite(&pool, &shape, DType::F32, Category::Activations, None).unwrap();
        assert!(o.to_vec::<f32>().unwrap().iter().all(|&v| v == 1.0));
        drop(o);
        // Any shape with the same dtype and element count reuses it.
        let flat = Tensor::zeros(&pool, &[4096], DType::F32, Category::Activations, None);
        assert!(flat.is_ok());
        assert_eq!(pool.stats().cache_hits, 3);
        drop(flat);
        // Another size misses, and the bound evicts the cached buffer: live + cached stays
        // within the high-water mark.
        let other = Tensor::zeros(&pool, &[64, 65], DType::F32, Category::Activations, None);
        assert!(other.is_ok());
        assert_eq!((pool.live(), pool.cached()), (16640, 0));
        pool.set_poison_overwritten(true);
        drop(other);
        let p = Tensor::for_overwrite(&pool, &[65, 64], DType::F32, Category::Activations, None)
            .unwrap();
        assert!(p.to_vec::<f32>().unwrap().iter().all(|v| v.is_nan()));
    }

    #[test]
    fn dtype_is_readable_while_writing() {
        let pool = MemoryPool::unbounded();
        let t = Tensor::zeros(&pool, &[2], DType::F64, Category::Activations, None).unwrap();
        let _w = t.write();
        assert_eq!(t.dtype(), DType::F64);
    }

    #[test]
    fn write_bumps_version() {
        let pool = MemoryPool::unbounded();
        let t =
            Tensor::from_vec(&pool, "w", &[2], vec![1.0f32, 2.0], Category::Parameters).unwrap();
        assert_eq!(t.version(), 0);
        t.write().as_mut_slice::<f32>().unwrap()[0] = 3.0;
        assert_eq!(t.version(), 1);
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![3.0, 2.0]);
    }

    #[test]
    fn wrong_length_and_dtype_are_errors() {
        let pool = MemoryPool::unbounded();
        let e = Tensor::from_vec(&pool, "x", &[2, 2], vec![1.0f32], Category::Activations);
        assert!(e.unwrap_err().to_string().contains("tensor x"));
        let t = Tensor::from_vec(&pool, "y", &[1], vec![1.0f64], Category::Activations).unwrap();
        assert!(t.read().as_slice::<f32>().is_err());
    }
}
