use super::*;

#[test]
fn dcp_names_give_shard_numbers() {
    assert_eq!(
        parse_dcp_name("shard-00001-model-00001-of-00001.safetensors"),
        Some(1)
    );
    assert_eq!(
        parse_dcp_name("shard-00012-model-00002-of-00003.safetensors"),
        Some(12)
    );
    assert_eq!(
        parse_dcp_name("shard-00000-model-00001-of-00001.safetensors"),
        Some(0)
    );
    assert_eq!(
        parse_dcp_name("shard-x-model-00001-of-00001.safetensors"),
        None
    );
    assert_eq!(parse_dcp_name("model.safetensors"), None);
}
