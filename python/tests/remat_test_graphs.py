"""Small graphs for the package's tests (not a test module): a training step of an n-layer
chain in remat's graph JSON, built here so that no test depends on files elsewhere."""

from __future__ import annotations

import json


def chain_graph(layers: int = 8, activation_bytes: int = 1 << 20, name: str = "chain") -> dict:
    """Forward f0..f{n-1}, a loss, backward b{n-1}..b0; each backward reads the gradient
    from above and its forward input, so store-all keeps every activation."""
    nodes = []
    for i in range(layers):
        nodes.append(
            {
                "name": f"f{i}",
                "phase": "forward",
                "compute_time": 10.0 + i,
                "output_bytes": activation_bytes,
                "inputs": [i - 1] if i else [],
            }
        )
    nodes.append(
        {"name": "loss", "phase": "backward", "compute_time": 1.0, "output_bytes": 8,
         "inputs": [layers - 1]}
    )
    grad = layers
    for i in reversed(range(layers)):
        inputs = [grad] + ([i - 1] if i else [])
        nodes.append(
            {
                "name": f"b{i}",
                "phase": "backward",
                "compute_time": 20.0,
                "output_bytes": activation_bytes,
                "inputs": inputs,
            }
        )
        grad = len(nodes) - 1
    return {
        "format": "remat-graph",
        "version": 1,
        "name": name,
        "time_unit_s": 1e-6,
        "static_bytes": 4096,
        "nodes": nodes,
    }


def write_chain(path, **kwargs) -> str:
    """Writes :func:`chain_graph` to ``path`` and returns the path as a string."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chain_graph(**kwargs), f)
    return str(path)
