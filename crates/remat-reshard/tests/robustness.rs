//! The header and index parsers never panic, whatever the bytes (the fuzz targets in
//! `fuzz/` explore further; these run in the normal suite).

use std::path::Path;

use proptest::prelude::*;
use remat_reshard::index::parse_index;
use remat_reshard::safetensors::parse_header;

fn with_len_prefix(json: &[u8], tail: &[u8]) -> Vec<u8> {
    let mut b = (json.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(json);
    b.extend_from_slice(tail);
    b
}

const VALID_INDEX: &str = r#"{"format":"remat.sharded-checkpoint","version":1,"layout":"remat","world_size":2,"checksum":{"algorithm":"xxh3-64-blocks","block_bytes":16},"files":[{"name":"a.safetensors","rank":0,"bytes":100}],"tensors":[{"name":"w","dtype":"F32","shape":[4],"placement":"shard(0)","chunks":[{"file":0,"offsets":[0],"sizes":[2],"byte_range":[8,16],"checksum":"0123456789abcdef"}]}]}"#;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn header_parser_survives_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = parse_header(Path::new("fuzz.safetensors"), &bytes);
    }

    #[test]
    fn header_parser_survives_arbitrary_json_text(json in "\\{[\"a-zA-Z0-9_:,\\[\\]{} .-]{0,120}\\}", tail in proptest::collection::vec(any::<u8>(), 0..64)) {
        let _ = parse_header(Path::new("fuzz.safetensors"), &with_len_prefix(json.as_bytes(), &tail));
    }

    #[test]
    fn header_parser_survives_wild_entries(
        dtype in "(F32|BF16|F4|F6_E2M3|U8|BOOL|C64|X)",
        shape in proptest::collection::vec(any::<u64>(), 0..4),
        start in any::<u64>(),
        end in any::<u64>(),
        tail in 0usize..64,
    ) {
        let json = format!(r#"{{"t":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{start},{end}]}}}}"#);
        let _ = parse_header(Path::new("fuzz.safetensors"), &with_len_prefix(json.as_bytes(), &vec![0u8; tail]));
    }

    #[test]
    fn index_parser_survives_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = parse_index(Path::new("remat.index.json"), &bytes);
    }

    #[test]
    fn index_parser_survives_mutations(at in 0usize..VALID_INDEX.len(), byte in any::<u8>(), numbers in proptest::collection::vec(any::<u64>(), 4)) {
        let mut b = VALID_INDEX.as_bytes().to_vec();
        b[at] = byte;
        let _ = parse_index(Path::new("remat.index.json"), &b);
        let big = VALID_INDEX
            .replace("[8,16]", &format!("[{},{}]", numbers[0], numbers[1]))
            .replace("\"shape\":[4]", &format!("\"shape\":[{}]", numbers[2]))
            .replace("\"sizes\":[2]", &format!("\"sizes\":[{}]", numbers[3]));
        let _ = parse_index(Path::new("remat.index.json"), big.as_bytes());
    }
}
