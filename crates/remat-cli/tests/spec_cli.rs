//! `remat spec inspect` end to end: shipped blocks, files, overrides and errors.

use std::process::Command;

fn remat(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_remat"))
        .args(args)
        .output()
        .expect("run remat");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn inspect_prints_steps_slots_and_bytes_per_layer() {
    let (ok, out, err) = remat(&["spec", "inspect", "qwen3", "--mode", "lora"]);
    assert!(ok, "{err}");
    assert!(out.contains("mode lora, 4 layers"), "{out}");
    assert!(out.contains("qkv_proj") && out.contains("q,k,v"), "{out}");
    assert!(out.contains("prefetch from host: @input:x, h"), "{out}");
    assert!(out.contains("layers 1..=3: same plan as layer 0"), "{out}");
    assert!(
        out.contains("saved (device)") && out.contains("total"),
        "{out}"
    );
}

#[test]
fn inspect_reads_files_and_overrides() {
    let dir = tempfile::tempdir().unwrap();
    let spec = concat!(env!("CARGO_MANIFEST_DIR"), "/../../specs/qwen3-moe.toml");
    let config = dir.path().join("config.json");
    std::fs::write(
        &config,
        r#"{"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 24, "batch": 1, "seq_len": 8}"#,
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let (ok, out, err) = remat(&[
        "spec",
        "inspect",
        spec,
        "--config",
        config,
        "--mode",
        "lora",
        "--set",
        "shared_expert_intermediate_size=16",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("shared_act") && out.contains("moe_gate_up"),
        "{out}"
    );
    let (ok, _, err) = remat(&[
        "spec",
        "inspect",
        spec,
        "--config",
        config,
        "--set",
        "use_qk_norm=3",
    ]);
    assert!(!ok);
    assert!(err.contains("bad condition `use_qk_norm`"), "{err}");
    let (ok, _, err) = remat(&["spec", "inspect", spec]);
    assert!(!ok && err.contains("no --config"), "{err}");
}

#[test]
fn derive_writes_a_spec_that_inspect_compiles() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("derived.toml");
    let out_s = out.to_str().unwrap();
    let (ok, stdout, err) = remat(&["spec", "derive", "--block", "qwen3-moe", "--out", out_s]);
    assert!(ok, "{err}");
    assert!(stdout.contains("wrote"), "{stdout}");
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../specs/qwen3-moe.config.toml"
    );
    let (ok, stdout, err) = remat(&["spec", "inspect", out_s, "--config", config]);
    assert!(ok, "{err}");
    // Everything but the block input is rebuilt by replaying the forward ops.
    assert!(
        stdout.contains("replay") && stdout.contains("topk_weights"),
        "{stdout}"
    );
}

#[test]
fn train_runs_a_spec_driven_block() {
    let (ok, out, err) = remat(&[
        "train",
        "--block",
        "qwen3",
        "--mode",
        "lora",
        "--steps",
        "2",
        "--batch",
        "2",
        "--digits",
        "3",
        "--block-set",
        "num_hidden_layers=2",
        "--block-set",
        "hidden_size=32",
        "--block-set",
        "intermediate_size=48",
        "--block-set",
        "head_dim=8",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("lora mode") && out.contains("last loss"),
        "{out}"
    );
}

/// Small-model flags shared by the training tests below.
const SMALL: [&str; 8] = [
    "--steps",
    "2",
    "--batch",
    "2",
    "--digits",
    "3",
    "--log-every",
    "1",
];

fn train(extra: &[&str]) -> (bool, String, String) {
    let mut args = vec!["train"];
    args.extend(SMALL);
    args.extend(extra);
    remat(&args)
}

#[test]
fn train_infers_the_block_from_the_spec_and_refuses_a_mismatch() {
    let moe = concat!(env!("CARGO_MANIFEST_DIR"), "/../../specs/qwen3-moe.toml");
    let (ok, out, err) = train(&["--spec", moe, "--block-set", "num_hidden_layers=2"]);
    assert!(ok, "{err}");
    assert!(out.contains("qwen3-moe block"), "{out}");
    let start = std::time::Instant::now();
    let (ok, _, err) = train(&["--block", "qwen3", "--spec", moe]);
    assert!(!ok);
    assert!(
        err.contains("--block qwen3") && err.contains("`qwen3-moe`"),
        "{err}"
    );
    // Refused before any model is built.
    assert!(start.elapsed().as_secs() < 10);
    let (ok, _, err) = train(&["--block", "qwen3-mo"]);
    assert!(!ok && err.contains("unknown --block `qwen3-mo`"), "{err}");
}

#[test]
fn train_block_refuses_flags_it_would_ignore() {
    for flags in [
        &["--policy", "every:2"][..],
        &["--policy", "auto:checkmate"][..],
        &["--stages", "2"][..],
    ] {
        let mut args = vec!["--block", "qwen3"];
        args.extend(flags);
        let (ok, _, err) = train(&args);
        assert!(!ok, "{flags:?} accepted");
        assert!(
            err.contains(flags[0]) && err.contains("does not apply with --block"),
            "{flags:?}: {err}"
        );
    }
}

#[test]
fn train_block_honours_the_memory_budget() {
    let small = [
        "--block-set",
        "num_hidden_layers=2",
        "--block-set",
        "hidden_size=32",
    ];
    let mut args = vec!["--block", "qwen3", "--block-set", "head_dim=8"];
    args.extend(small);
    let (ok, out, err) = train(&args);
    assert!(ok, "{err}");
    assert!(out.contains("pool peak"), "{out}");
    args.extend(["--memory-budget", "64KiB"]);
    let (ok, _, err) = train(&args);
    assert!(!ok);
    assert!(
        err.contains("out of memory") || err.contains("budget"),
        "{err}"
    );
}

/// `--dump-grads` writes Hugging Face names with the step's batch; the dump loads back with
/// `--init` (the step record is skipped); a file of another block is refused by name;
/// LoRA has no full gradients to dump.
#[test]
fn train_block_dumps_gradients_and_loads_hugging_face_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    for block in ["qwen3", "qwen3-moe"] {
        let dump = dir.join(format!("{block}.safetensors"));
        let dump_s = dump.to_str().unwrap();
        let (ok, out, err) = train(&["--block", block, "--dump-grads", dump_s]);
        assert!(ok, "{err}");
        assert!(out.contains("wrote the first step's gradients"), "{out}");
        // Loss lines reach a pipe too (SMALL logs every step).
        assert!(out.contains("step     1  loss"), "{out}");
        let bytes = std::fs::read(&dump).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let names = st.names();
        assert!(
            names
                .iter()
                .any(|n| *n == "model.layers.0.self_attn.q_norm.weight")
        );
        assert!(names.iter().any(|n| *n == "remat.labels"));
        if block == "qwen3-moe" {
            assert!(
                names
                    .iter()
                    .any(|n| *n == "model.layers.0.mlp.experts.0.up_proj.weight")
            );
            assert!(names.iter().any(|n| *n == "model.layers.0.mlp.gate.weight"));
        }
        let (ok, out, err) = train(&["--block", block, "--init", dump_s]);
        assert!(ok, "{err}");
        assert!(out.contains("loaded parameters"), "{out}");
    }
    let dense = dir.join("qwen3.safetensors");
    let (ok, _, err) = train(&["--block", "qwen3-moe", "--init", dense.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        err.contains("--init") && err.contains("model.layers.0.mlp.experts.0"),
        "{err}"
    );
    let lora = dir.join("lora.safetensors");
    let (ok, _, err) = train(&[
        "--block",
        "qwen3",
        "--mode",
        "lora",
        "--dump-grads",
        lora.to_str().unwrap(),
    ]);
    assert!(
        !ok && err.contains("--dump-grads needs --mode full"),
        "{err}"
    );
    assert!(!lora.exists());
}

/// Small Mamba sizes for the tests below.
const SMALL_MAMBA: [&str; 10] = [
    "--block",
    "mamba",
    "--block-set",
    "num_hidden_layers=2",
    "--block-set",
    "hidden_size=16",
    "--block-set",
    "intermediate_size=32",
    "--block-set",
    "scan_chunk=4",
];

/// The Mamba block trains from its spec in both modes, dumps its gradients under Hugging
/// Face `MambaForCausalLM` names and loads them back; an inconsistent config is refused
/// naming the keys.
#[test]
fn train_runs_mamba_and_round_trips_hugging_face_names() {
    let tmp = tempfile::tempdir().unwrap();
    let dump = tmp.path().join("mamba.safetensors");
    let dump_s = dump.to_str().unwrap();
    let mut args = SMALL_MAMBA.to_vec();
    args.extend(["--dump-grads", dump_s]);
    let (ok, out, err) = train(&args);
    assert!(ok, "{err}");
    assert!(
        out.contains("mamba block") && out.contains("full mode"),
        "{out}"
    );
    let bytes = std::fs::read(&dump).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    for name in [
        "backbone.embeddings.weight",
        "backbone.layers.1.mixer.A_log",
        "backbone.layers.0.mixer.conv1d.weight",
        "backbone.norm_f.weight",
    ] {
        assert!(st.names().iter().any(|n| *n == name), "{name} missing");
    }
    let mut args = SMALL_MAMBA.to_vec();
    args.extend(["--init", dump_s, "--mode", "lora"]);
    let (ok, out, err) = train(&args);
    assert!(ok, "{err}");
    assert!(
        out.contains("loaded parameters") && out.contains("lora mode"),
        "{out}"
    );
    let mut args = SMALL_MAMBA.to_vec();
    args.extend(["--block-set", "expand=3"]);
    let (ok, _, err) = train(&args);
    assert!(
        !ok && err.contains("intermediate_size") && err.contains("expand"),
        "{err}"
    );
}

/// A hybrid (a block type per layer) trains in both modes; an unknown block in
/// `layer_types`, a key no block reads and `--dump-grads` are refused naming the field.
#[test]
fn train_runs_a_hybrid_model() {
    let small = [
        "--block",
        "hybrid",
        "--block-set",
        "layer_types=mamba qwen3",
        "--block-set",
        "hidden_size=16",
        "--block-set",
        "mamba.intermediate_size=32",
        "--block-set",
        "qwen3.head_dim=4",
        "--block-set",
        "qwen3.intermediate_size=24",
    ];
    for mode in ["full", "lora"] {
        let mut args = small.to_vec();
        args.extend(["--mode", mode]);
        let (ok, out, err) = train(&args);
        assert!(ok, "{mode}: {err}");
        assert!(
            out.contains("hybrid block") && out.contains("2 layers"),
            "{out}"
        );
    }
    let mut args = small.to_vec();
    args.extend(["--block-set", "layer_types=mamba,attn"]);
    let (ok, _, err) = train(&args);
    assert!(
        !ok && err.contains("layer_types") && err.contains("`attn`"),
        "{err}"
    );
    let mut args = small.to_vec();
    args.extend(["--block-set", "mamba.num_experts=2"]);
    let (ok, _, err) = train(&args);
    assert!(!ok && err.contains("mamba.num_experts"), "{err}");
    let tmp = tempfile::tempdir().unwrap();
    let dump = tmp.path().join("g.safetensors");
    let mut args = small.to_vec();
    args.extend(["--dump-grads", dump.to_str().unwrap()]);
    let (ok, _, err) = train(&args);
    assert!(
        !ok && err.contains("--dump-grads does not apply to --block hybrid"),
        "{err}"
    );
}

/// The floor a below-floor error names, in bytes.
fn floor_of(err: &str) -> u64 {
    let tail = err
        .split("raise --memory-budget to at least ")
        .nth(1)
        .unwrap_or_else(|| panic!("no floor in {err}"));
    // Exact, as --memory-budget reads it (`1537`, `150KiB`).
    remat_units::parse_size(tail.trim(), "the floor").unwrap_or_else(|_| panic!("{err}"))
}

/// `--policy auto` chooses a mix per layer and slot that fits the budget (the pool enforces
/// it: a step over it would fail), prints it, and refuses a budget below the floor naming
/// the floor and the flag; without a budget it says what it needs.
#[test]
fn train_block_policy_auto_fits_the_budget_or_names_the_floor() {
    let mut args = vec![
        "--block",
        "qwen3",
        "--block-set",
        "num_hidden_layers=3",
        "--block-set",
        "hidden_size=32",
        "--block-set",
        "head_dim=8",
        "--block-set",
        "intermediate_size=64",
        "--policy",
        "auto",
    ];
    let (ok, _, err) = train(&args);
    assert!(!ok && err.contains("needs --memory-budget"), "{err}");
    // Above the parameters (112 KiB), below them plus the optimizer state and the step.
    args.extend(["--memory-budget", "150KiB"]);
    let (ok, _, err) = train(&args);
    assert!(!ok);
    assert!(
        err.contains("--memory-budget") && err.contains("below the floor"),
        "{err}"
    );
    let floor = floor_of(&err);
    let at_floor = floor.to_string();
    let len = args.len();
    args[len - 1] = &at_floor;
    let (ok, out, err) = train(&args);
    assert!(ok, "{err}");
    assert!(
        out.contains("recomputed")
            && out.contains("kept on device")
            && out.contains("predicted: peak"),
        "{out}"
    );
    assert!(out.contains("last loss"), "{out}");
    // Above the floor the exact mixes of a budget ladder run off; the fastest is chosen.
    let roomy = (2 * floor).to_string();
    args[len - 1] = &roomy;
    let (ok, out, err) = train(&args);
    assert!(ok, "{err}");
    assert!(
        out.contains("run-off") && out.contains("chosen") && out.contains("measured step"),
        "{out}"
    );
    let below = (floor - 1).to_string();
    args[len - 1] = &below;
    let (ok, _, err) = train(&args);
    assert!(!ok && floor_of(&err) == floor, "{err}");
}

#[test]
fn inspect_prints_the_mix_for_a_budget() {
    let base = [
        "spec",
        "inspect",
        "mamba",
        "--set",
        "num_hidden_layers=2",
        "--set",
        "seq_len=16",
        "--memory-budget",
    ];
    let mut args = base.to_vec();
    args.push("1KiB");
    let (ok, _, err) = remat(&args);
    assert!(!ok && err.contains("below the floor"), "{err}");
    let floor = floor_of(&err).to_string();
    let mut args = base.to_vec();
    args.push(&floor);
    let (ok, out, err) = remat(&args);
    assert!(ok, "{err}");
    assert!(
        out.contains("mix for --memory-budget") && out.contains("added time"),
        "{out}"
    );
    // Two layer rows, each naming the block.
    assert_eq!(out.matches("  mamba  ").count(), 2, "{out}");
}

/// A fraction `--memory-budget` is of the predicted peak with no budget (the fastest allowed
/// mix, parameters and optimizer state included): 1.0 is that peak, which then fits.
#[test]
fn inspect_takes_a_fraction_of_the_peak_with_no_budget() {
    let base = [
        "spec",
        "inspect",
        "mamba",
        "--set",
        "num_hidden_layers=2",
        "--set",
        "seq_len=16",
        "--memory-budget",
    ];
    let (ok, out, err) = remat(&[&base[..], &["1.0"]].concat());
    assert!(ok, "{err}");
    let prefix = "--memory-budget 1.0: 1.0 of the predicted peak with no budget (";
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no fraction line in {out}"));
    // `REFERENCE) is BYTES (N bytes)`: all of the reference.
    let (reference, rest) = line.split_once(") is ").expect("the reference");
    let (bytes, n) = rest.split_once(" (").expect("the bytes");
    assert_eq!(reference, bytes, "{line}");
    let n: u64 = n
        .strip_suffix(" bytes)")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert_eq!(remat_units::human_bytes(n), bytes, "{line}");
    assert!(out.contains("mix for --memory-budget"), "{out}");
    let (ok, _, err) = remat(&[&base[..], &["0.0000000001"]].concat());
    assert!(
        !ok && err.contains("of the predicted peak with no budget")
            && err.contains("less than one byte"),
        "{err}"
    );
    let (ok, _, err) = remat(&[&base[..], &["1.5"]].concat());
    assert!(!ok && err.contains("a fraction must be in (0, 1]"), "{err}");
}
