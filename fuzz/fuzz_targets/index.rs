//! The remat index parser must return an error, never panic, on any bytes; when it
//! accepts an index, every chunk must refer to a listed file.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use remat_reshard::index::parse_index;

fuzz_target!(|data: &[u8]| {
    if let Ok(index) = parse_index(Path::new("remat.index.json"), data) {
        for t in &index.tensors {
            for c in &t.chunks {
                assert!(c.file < index.files.len());
            }
        }
    }
});
