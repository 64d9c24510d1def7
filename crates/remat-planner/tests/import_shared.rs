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
