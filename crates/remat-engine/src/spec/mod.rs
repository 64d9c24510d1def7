//! Declarative recompute specs: a block declares its activation slots; remat compiles and runs a per-layer recompute plan.
