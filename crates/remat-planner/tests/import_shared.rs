//! Every graph of `../shared/graphs` loads, with the node counts and floors its README states.
//! Skipped, saying so, when the shared folder is absent.

mod common;

use common::graphs_dir;

use remat_planner::import::{ImportOptions, load};

/// (file, nodes, links, floor / store-all peak as the README rounds it)
const GRAPHS: [(&str, usize, usize, Option<f64>); 5] = [
    ("vgg16-b256-train.json", 45, 87, Some(0.83)),
    ("vgg19-b256-train.json", 51, 99, Some(0.77)),
    ("vgg-unet-b32-train.json", 71, 148, Some(0.40)),
    ("mobilenet-b512-train.json", 185, 367, Some(0.19)),
    ("random-layered-n100.json", 100, 236, None),
];

#[test]
fn shared_graphs_load_with_their_readme_floors() {
    let Some(dir) = graphs_dir() else { return };
    for (file, nodes, links, floor) in GRAPHS {
        let graph = load(&dir.join(file), ImportOptions::default())
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(graph.len(), nodes, "{file}");
        let edge_count: usize = graph.nodes().iter().map(|n| n.inputs.len()).sum();
        assert_eq!(edge_count, links, "{file}");
        let ratio = graph.memory_floor() as f64 / graph.store_all_peak() as f64;
        println!("{file}: floor / peak = {ratio:.4}");
        if let Some(expected) = floor {
            assert!(
                (ratio - expected).abs() < 0.005,
                "{file}: {ratio} vs {expected}"
            );
            assert!(graph.has_backward());
        }
    }
}

/// The random layered graph's file states its schedule in `graph.order` (node 1 is the
/// sink); the importer follows it, so the store-all peak is the one Moccasin's budgets are
/// fractions of (46,319 bytes for n = 100; Kahn's order by smallest id would give 50,590).
#[test]
fn the_random_layered_graph_follows_its_stated_order() {
    let Some(dir) = graphs_dir() else { return };
    let graph = load(
        &dir.join("random-layered-n100.json"),
        ImportOptions::default(),
    )
    .unwrap();
    assert_eq!(graph.store_all_peak(), 46_319);
    assert_eq!(graph.node(0).name, "0");
    assert_eq!(graph.node(graph.len() - 1).name, "1", "the sink comes last");
}

/// Moccasin's published random layered files (`data/` of haoming-codes/moccasin), read from
/// `$REMAT_MOCCASIN_DATA` when set (they are not part of this repository; skipped, saying
/// so, otherwise): each loads unchanged, and its store-all peak is the topological-order
/// peak the paper's byte budgets are 0.9 and 0.8 of (budget = ceil(fraction x peak)).
#[test]
fn moccasin_published_files_load_with_the_papers_peaks() {
    let Some(dir) = std::env::var_os("REMAT_MOCCASIN_DATA") else {
        eprintln!("skipping: REMAT_MOCCASIN_DATA is not set");
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    let files = [
        (
            "random_layered_n100_w0.27_nlv0.75_ed0.2_scd0.14.json",
            46_319,
            None,
        ),
        (
            "random_layered_n250_w0.43_nlv0.75_ed0.2_scd0.14.json",
            146_840,
            Some((132_156, 117_472)),
        ),
        (
            "random_layered_n500_w0.36_nlv0.75_ed0.2_scd0.14.json",
            284_439,
            Some((255_996, 227_552)),
        ),
        (
            "random_layered_n1000_w0.31_nlv0.75_ed0.2_scd0.14.json",
            608_619,
            Some((547_758, 486_896)),
        ),
    ];
    for (file, peak, budgets) in files {
        let graph = load(&dir.join(file), ImportOptions::default())
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        let store_all = graph.store_all_peak();
        println!(
            "{file}: {} nodes, store-all peak {store_all}, floor {}",
            graph.len(),
            graph.memory_floor()
        );
        assert_eq!(store_all, peak, "{file}");
        if let Some((b90, b80)) = budgets {
            assert_eq!((store_all as f64 * 0.9).ceil() as u64, b90, "{file}");
            assert_eq!((store_all as f64 * 0.8).ceil() as u64, b80, "{file}");
        }
    }
}
