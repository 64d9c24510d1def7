//! Tensors as copy-engine buffers: the swap workers read and write a tensor's storage
//! through its lock, byte for byte, whatever its dtype.

use crate::core::dtype::{DType, Element};
use crate::core::swap::{CopyBuf, SwapError};
use crate::core::tensor::{Buf, Tensor, TensorWrite};

/// The raw bytes of a typed buffer.
fn bytes_of(buf: &Buf) -> &[u8] {
    match buf {
        Buf::F32(v) => bytemuck::cast_slice(v),
        Buf::F64(v) => bytemuck::cast_slice(v),
        // SAFETY: bf16 and f16 are `repr(transparent)` over u16: 2 initialized bytes each,
        // no padding, and every byte pattern is a valid value to read back.
        Buf::BF16(v) => unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len() * 2) },
        Buf::F16(v) => unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len() * 2) },
    }
}

impl CopyBuf for Tensor {
    fn byte_len(&self) -> usize {
        self.bytes() as usize
    }

    fn read_bytes(
        &self,
        f: &mut dyn FnMut(&[u8]) -> Result<(), SwapError>,
    ) -> Result<(), SwapError> {
        let guard = self.read();
        f(bytes_of(guard.buf()))
    }

    fn write_bytes(
        &mut self,
        f: &mut dyn FnMut(&mut [u8]) -> Result<(), SwapError>,
    ) -> Result<(), SwapError> {
        // Writable access goes through the typed slice: the half-precision dtypes have no
        // ops yet, so no tensor of theirs can be swapped back in.
        // The dtype is read (through the storage lock) before the write lock is taken.
        let dtype = self.dtype();
        let mut guard = self.write();
        match dtype {
            DType::F32 => f(bytemuck::cast_slice_mut(slice_mut::<f32>(&mut guard)?)),
            DType::F64 => f(bytemuck::cast_slice_mut(slice_mut::<f64>(&mut guard)?)),
            other => Err(SwapError::Unsupported {
                what: format!("swapping a {other} tensor back in"),
            }),
        }
    }
}

fn slice_mut<'a, T: Element>(guard: &'a mut TensorWrite<'_>) -> Result<&'a mut [T], SwapError> {
    guard
        .as_mut_slice::<T>()
        .map_err(|e| SwapError::Unsupported {
            what: e.to_string(),
        })
}
