//! Safetensors element types. Resharding copies bytes, so a dtype only tells us its width.

use std::fmt;

/// Every dtype the safetensors format defines (0.8: PyTorch's `float8_e4m3fnuz` and
/// `float8_e5m2fnuz` are written as `F8_E4M3FNUZ` and `F8_E5M2FNUZ`, DCP's Hugging Face
/// writer included). Sub-byte types (F4, F6) are packed; a split of them must fall on byte
/// boundaries, checked when planning.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    Bool,
    F4,
    F6E2M3,
    F6E3M2,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    F8E8M0,
    F8E4M3Fnuz,
    F8E5M2Fnuz,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    C64,
    F64,
    I64,
    U64,
}

const NAMES: [(Dtype, &str, u64); 22] = [
    (Dtype::Bool, "BOOL", 8),
    (Dtype::F4, "F4", 4),
    (Dtype::F6E2M3, "F6_E2M3", 6),
    (Dtype::F6E3M2, "F6_E3M2", 6),
    (Dtype::U8, "U8", 8),
    (Dtype::I8, "I8", 8),
    (Dtype::F8E5M2, "F8_E5M2", 8),
    (Dtype::F8E4M3, "F8_E4M3", 8),
    (Dtype::F8E8M0, "F8_E8M0", 8),
    (Dtype::F8E4M3Fnuz, "F8_E4M3FNUZ", 8),
    (Dtype::F8E5M2Fnuz, "F8_E5M2FNUZ", 8),
    (Dtype::I16, "I16", 16),
    (Dtype::U16, "U16", 16),
    (Dtype::F16, "F16", 16),
    (Dtype::BF16, "BF16", 16),
    (Dtype::I32, "I32", 32),
    (Dtype::U32, "U32", 32),
    (Dtype::F32, "F32", 32),
    (Dtype::C64, "C64", 64),
    (Dtype::F64, "F64", 64),
    (Dtype::I64, "I64", 64),
    (Dtype::U64, "U64", 64),
];

impl Dtype {
    /// All dtypes, in the order of the safetensors specification.
    pub fn all() -> impl Iterator<Item = Dtype> {
        NAMES.iter().map(|(d, _, _)| *d)
    }

    /// Parses the safetensors spelling (`"BF16"`, `"F8_E4M3"`, ...).
    pub fn from_name(name: &str) -> Option<Dtype> {
        NAMES
            .iter()
            .find(|(_, n, _)| *n == name)
            .map(|(d, _, _)| *d)
    }

    /// The safetensors spelling.
    pub fn name(self) -> &'static str {
        NAMES[self as usize].1
    }

    /// Width of one element in bits.
    pub fn bits(self) -> u64 {
        NAMES[self as usize].2
    }

    /// Bytes taken by `elements` elements, `None` on overflow or when the count of a
    /// sub-byte type does not end on a byte boundary.
    pub fn bytes_for(self, elements: u64) -> Option<u64> {
        let bits = elements.checked_mul(self.bits())?;
        (bits % 8 == 0).then_some(bits / 8)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_table_is_in_enum_order() {
        for (i, d) in Dtype::all().enumerate() {
            assert_eq!(d as usize, i);
            assert_eq!(Dtype::from_name(d.name()), Some(d));
        }
        assert_eq!(Dtype::from_name("bf16"), None);
    }

    #[test]
    fn sub_byte_sizes_need_byte_boundaries() {
        assert_eq!(Dtype::F4.bytes_for(6), Some(3));
        assert_eq!(Dtype::F4.bytes_for(5), None);
        assert_eq!(Dtype::F6E2M3.bytes_for(4), Some(3));
        assert_eq!(Dtype::BF16.bytes_for(3), Some(6));
        assert_eq!(Dtype::F64.bytes_for(u64::MAX / 4), None);
    }
}
