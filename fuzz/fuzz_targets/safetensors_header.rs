//! The safetensors header parser must return an error, never panic, on any bytes; when it
//! accepts a header, every entry must lie inside the file.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use remat_reshard::safetensors::parse_header;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = parse_header(Path::new("fuzz.safetensors"), data) {
        for e in &h.entries {
            assert!(e.start <= e.end && h.data_start + e.end <= data.len() as u64);
        }
    }
});
