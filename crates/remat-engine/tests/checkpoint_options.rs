//! Every `CheckpointOptions` field, and each checkpointing error with its message.

use std::sync::{Arc, Mutex};

use remat_engine::{
    Category, CheckpointOptions, DType, EngineError, ExecContext, Graph, MemoryPool, NodeId,
    Policy, Tensor,
};

fn vec_tensor(pool: &Arc<MemoryPool>, name: &str, v: Vec<f32>, category: Category) -> Tensor {
    let n = v.len();
    Tensor::from_vec(pool, name, &[n], v, category).unwrap()
}

/// `w -> scale x n -> mse(., t)`; returns (graph, w node, scale nodes, loss).
fn chain(ctx: &ExecContext, w: &Tensor, n: usize) -> (Graph, NodeId, Vec<NodeId>, NodeId) {
    let pool = ctx.pool();
    let mut g = Graph::new(ctx);
    let wn = g.param("w", w);
    let t = g.input(
        "t",
        Tensor::zeros(pool, &[4], DType::F32, Category::Activations, None).unwrap(),
    );
    let mut h = wn;
    let mut nodes = Vec::new();
    for i in 0..n {
        h = g.scale(h, 1.5).unwrap();
        g.set_name(h, format!("s{i}")).unwrap();
        nodes.push(h);
    }
    let loss = g.mse(h, t).unwrap();
    (g, wn, nodes, loss)
}

fn setup() -> (ExecContext, Tensor) {
    let pool = MemoryPool::unbounded();
    let ctx = ExecContext::new(pool.clone(), 1).unwrap();
    let w = vec_tensor(&pool, "w", vec![1.0, -2.0, 3.0, 0.5], Category::Parameters);
    (ctx, w)
}

fn reference_grad(ctx: &ExecContext, w: &Tensor, n: usize) -> Tensor {
    let (mut g, wn, _, loss) = chain(ctx, w, n);
    g.forward().unwrap();
    g.backward(loss).unwrap();
    g.grad(wn).unwrap().unwrap()
}

fn opts() -> CheckpointOptions {
    CheckpointOptions::default()
}

#[test]
fn checkpointed_node_is_freed_after_forward_and_recomputed_once() {
    let (ctx, w) = setup();
    let want = reference_grad(&ctx, &w, 3);
    let (mut g, wn, s, loss) = chain(&ctx, &w, 3);
    // s2 is read by mse's backward; as a checkpoint it is dropped after the loss is computed.
    g.checkpoint(s[2], Some(opts())).unwrap();
    g.forward().unwrap();
    assert!(!g.is_resident(s[2]).unwrap());
    g.backward(loss).unwrap();
    assert_eq!(g.recompute_count(s[2]).unwrap(), 1);
    assert!(g.grad(wn).unwrap().unwrap().bit_eq(&want));
}

#[test]
fn save_inputs_keeps_inputs_so_rebuild_is_one_step() {
    let (ctx, w) = setup();
    for save_inputs in [true, false] {
        let (mut g, _, s, loss) = chain(&ctx, &w, 3);
        let o = CheckpointOptions {
            save_inputs,
            ..opts()
        };
        g.checkpoint(s[1], Some(o)).unwrap();
        g.checkpoint(s[2], Some(o)).unwrap();
        g.forward().unwrap();
        g.backward(loss).unwrap();
        // With save_inputs, s2 pins s1: only s2 is rebuilt. Without, s1 is rebuilt too.
        assert_eq!(g.recompute_count(s[2]).unwrap(), 1);
        assert_eq!(g.recompute_count(s[1]).unwrap(), u64::from(!save_inputs));
    }
}

#[test]
fn force_drops_a_value_even_when_a_consumer_saves_it() {
    let (ctx, w) = setup();
    let want = reference_grad(&ctx, &w, 3);
    for force in [false, true] {
        let (mut g, wn, s, loss) = chain(&ctx, &w, 3);
        g.checkpoint(s[1], Some(CheckpointOptions { force, ..opts() }))
            .unwrap();
        g.checkpoint(s[2], Some(opts())).unwrap();
        g.forward().unwrap();
        assert_eq!(g.is_resident(s[1]).unwrap(), !force);
        g.backward(loss).unwrap();
        assert_eq!(g.recompute_count(s[1]).unwrap(), u64::from(force));
        assert!(g.grad(wn).unwrap().unwrap().bit_eq(&want));
    }
}

#[test]
fn max_recompute_depth_bounds_the_chain_and_names_it() {
    let (ctx, w) = setup();
    let deep = CheckpointOptions {
        save_inputs: false,
        max_recompute_depth: 3,
        ..opts()
    };
    // A chain of 3 dropped nodes fits a limit of 3.
    let (mut g, _, s, loss) = chain(&ctx, &w, 3);
    for &n in &s {
        g.checkpoint(n, Some(deep)).unwrap();
    }
    g.forward().unwrap();
    g.backward(loss).unwrap();
    // Five do not: the rebuild of s4 would recompute s4, s3, s2, s1.
    let (mut g, _, s, loss) = chain(&ctx, &w, 5);
    for &n in &s {
        g.checkpoint(n, Some(deep)).unwrap();
    }
    g.forward().unwrap();
    let err = g.backward(loss).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::RecomputeDepthExceeded {
                depth: 4,
                limit: 3,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "recompute depth exceeded: rebuilding needs a chain of 4 nodes, more than \
         max_recompute_depth 3 of s4; chain: s4 <- s3 <- s2 <- s1"
    );
}

/// Runs forward and backward with every op node but the loss checkpointed
/// (`save_inputs: false`, depth limit `limit`); `build` records the ops on `w` and returns
/// them in recording order, the last one feeding the loss. Returns w's gradient.
fn run_with_depth_limit(
    limit: usize,
    build: impl FnOnce(&mut Graph, NodeId) -> Vec<NodeId>,
) -> Result<Tensor, EngineError> {
    let (ctx, w) = setup();
    let mut g = Graph::new(&ctx);
    let wn = g.param("w", &w);
    let nodes = build(&mut g, wn);
    let t = g.input(
        "t",
        Tensor::zeros(ctx.pool(), &[4], DType::F32, Category::Activations, None).unwrap(),
    );
    let loss = g.mse(*nodes.last().unwrap(), t).unwrap();
    let limited = CheckpointOptions {
        save_inputs: false,
        max_recompute_depth: limit,
        ..opts()
    };
    for &n in &nodes {
        g.checkpoint(n, Some(limited)).unwrap();
    }
    g.forward().unwrap();
    g.backward(loss)?;
    Ok(g.grad(wn).unwrap().unwrap())
}

/// `a = scale(w)`, `b = scale(a)`, `c = mul(a, b)`: rebuilding c recomputes c <- b <- a,
/// though a is also c's direct input (found first at depth 2).
fn shared_input(g: &mut Graph, w: NodeId) -> Vec<NodeId> {
    let a = g.scale(w, 1.5).unwrap();
    let b = g.scale(a, 0.5).unwrap();
    let c = g.mul(a, b).unwrap();
    for (n, name) in [(a, "a"), (b, "b"), (c, "c")] {
        g.set_name(n, name).unwrap();
    }
    vec![a, b, c]
}

/// A residual block: `x0 = scale(w)`, `h1 = scale(x0)`, `h2 = mul(h1, h1)`,
/// `x1 = add(x0, h2)`: rebuilding x1 recomputes x1 <- h2 <- h1 <- x0, though x0 is also
/// x1's direct input.
fn residual(g: &mut Graph, w: NodeId) -> Vec<NodeId> {
    let x0 = g.scale(w, 1.5).unwrap();
    let h1 = g.scale(x0, 0.5).unwrap();
    let h2 = g.mul(h1, h1).unwrap();
    let x1 = g.add(x0, h2).unwrap();
    for (n, name) in [(x0, "x0"), (h1, "h1"), (h2, "h2"), (x1, "x1")] {
        g.set_name(n, name).unwrap();
    }
    vec![x0, h1, h2, x1]
}

#[test]
fn max_recompute_depth_counts_the_longest_path_through_shared_inputs() {
    let err = run_with_depth_limit(2, shared_input).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::RecomputeDepthExceeded {
                depth: 3,
                limit: 2,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "recompute depth exceeded: rebuilding needs a chain of 3 nodes, more than \
         max_recompute_depth 2 of c; chain: c <- b <- a"
    );
    // Just within the limit: the same gradients as keeping everything.
    let (ctx, w) = setup();
    let mut g = Graph::new(&ctx);
    let wn = g.param("w", &w);
    let c = *shared_input(&mut g, wn).last().unwrap();
    let t = g.input(
        "t",
        Tensor::zeros(ctx.pool(), &[4], DType::F32, Category::Activations, None).unwrap(),
    );
    let loss = g.mse(c, t).unwrap();
    g.forward().unwrap();
    g.backward(loss).unwrap();
    let want = g.grad(wn).unwrap().unwrap();
    let got = run_with_depth_limit(3, shared_input).unwrap();
    assert!(got.bit_eq(&want));
}

#[test]
fn max_recompute_depth_counts_the_longest_path_through_a_residual() {
    let err = run_with_depth_limit(3, residual).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::RecomputeDepthExceeded {
                depth: 4,
                limit: 3,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "recompute depth exceeded: rebuilding needs a chain of 4 nodes, more than \
         max_recompute_depth 3 of x1; chain: x1 <- h2 <- h1 <- x0"
    );
    run_with_depth_limit(4, residual).unwrap();
}

#[test]
fn detach_inputs_rebuilds_only_from_held_inputs() {
    let (ctx, w) = setup();
    let detached = CheckpointOptions {
        detach_inputs: true,
        save_inputs: false,
        ..opts()
    };
    // Input held (pinned by save_inputs): fine.
    let (mut g, _, s, loss) = chain(&ctx, &w, 3);
    g.checkpoint(
        s[2],
        Some(CheckpointOptions {
            save_inputs: true,
            ..detached
        }),
    )
    .unwrap();
    g.forward().unwrap();
    g.backward(loss).unwrap();
    assert_eq!(g.recompute_count(s[2]).unwrap(), 1);
    // Input dropped too: an error naming both.
    let (mut g, _, s, loss) = chain(&ctx, &w, 3);
    g.checkpoint(
        s[1],
        Some(CheckpointOptions {
            save_inputs: false,
            ..opts()
        }),
    )
    .unwrap();
    g.checkpoint(s[2], Some(detached)).unwrap();
    g.forward().unwrap();
    let err = g.backward(loss).unwrap_err().to_string();
    assert_eq!(
        err,
        "cannot rebuild s2: s2 has detach_inputs set and its input s1 is not held; chain: s2 <- s1"
    );
}

#[test]
fn released_input_is_unrebuildable() {
    let (ctx, w) = setup();
    let pool = ctx.pool().clone();
    let mut g = Graph::new(&ctx);
    let x = g.input(
        "batch",
        vec_tensor(
            &pool,
            "batch",
            vec![1.0, 2.0, 3.0, 4.0],
            Category::Activations,
        ),
    );
    let wn = g.param("w", &w);
    let h = g.mul(x, wn).unwrap();
    let h2 = g.scale(h, 2.0).unwrap();
    let h3 = g.mul(h2, wn).unwrap();
    let t = g.input(
        "t",
        Tensor::zeros(&pool, &[4], DType::F32, Category::Activations, None).unwrap(),
    );
    let loss = g.mse(h3, t).unwrap();
    Policy::RecomputeAll.apply(&mut g).unwrap();
    g.forward().unwrap();
    g.release(x).unwrap();
    let err = g.backward(loss).unwrap_err();
    assert_eq!(
        err.to_string(),
        "cannot rebuild mul#4: batch is a graph input or parameter whose value was released; \
         chain: mul#4 <- scale#3 <- mul#2 <- batch"
    );
}

#[test]
fn parameter_updated_between_forward_and_backward_is_detected() {
    let (ctx, w) = setup();
    let (mut g, _, _, loss) = chain(&ctx, &w, 2);
    // mse reads s1, scale reads nothing: make the parameter a saved input via mul.
    let wn = g.param("w2", &w);
    let m = g.mul(wn, wn).unwrap();
    let t = g.input(
        "t2",
        Tensor::zeros(ctx.pool(), &[4], DType::F32, Category::Activations, None).unwrap(),
    );
    let loss2 = g.mse(m, t).unwrap();
    let total = g.add(loss, loss2).unwrap();
    g.forward().unwrap();
    w.write().as_mut_slice::<f32>().unwrap()[0] = 7.0; // an optimizer step, say
    let err = g.backward(total).unwrap_err();
    assert!(
        matches!(
            err,
            EngineError::ModifiedInPlace {
                saved: 0,
                current: 1,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "one of the tensors needed for gradient computation has been modified in place: \
         w2 (input 0 of node mul#6) is at version 1; expected version 0"
    );
}

#[test]
fn modified_parameter_is_detected_when_recomputing_too() {
    let (ctx, w) = setup();
    let (mut g, _, s, loss) = chain(&ctx, &w, 2);
    g.checkpoint(
        s[0],
        Some(CheckpointOptions {
            save_inputs: false,
            ..opts()
        }),
    )
    .unwrap();
    g.checkpoint(
        s[1],
        Some(CheckpointOptions {
            save_inputs: false,
            ..opts()
        }),
    )
    .unwrap();
    g.forward().unwrap();
    w.write().as_mut_slice::<f32>().unwrap()[1] = 0.0;
    let err = g.backward(loss).unwrap_err().to_string();
    assert!(
        err.contains("w (input 0 of node s0) is at version 1"),
        "{err}"
    );
}

#[test]
fn save_rng_false_refuses_to_recompute_a_random_op() {
    let (ctx, w) = setup();
    let (mut g, wn, _, _) = chain(&ctx, &w, 0);
    let d = g.dropout(wn, 0.5).unwrap();
    let m = g.mul(d, d).unwrap();
    let t = g.input(
        "t2",
        Tensor::zeros(ctx.pool(), &[4], DType::F32, Category::Activations, None).unwrap(),
    );
    let loss = g.mse(m, t).unwrap();
    g.checkpoint(
        d,
        Some(CheckpointOptions {
            save_rng: false,
            ..opts()
        }),
    )
    .unwrap();
    g.forward().unwrap();
    let err = g.backward(loss).unwrap_err().to_string();
    assert!(
        err.contains("random op dropout#3 has no recorded RNG state")
            && err.contains("save_rng = false"),
        "{err}"
    );

    // With save_rng the recompute replays the mask: gradients equal keeping it.
    let grads: Vec<Tensor> = [None, Some(opts())]
        .into_iter()
        .map(|o| {
            let (mut g, wn, _, _) = chain(&ctx, &w, 0);
            let d = g.dropout(wn, 0.5).unwrap();
            let m = g.mul(d, d).unwrap();
            let t = g.input(
                "t2",
                Tensor::zeros(ctx.pool(), &[4], DType::F32, Category::Activations, None).unwrap(),
            );
            let loss = g.mse(m, t).unwrap();
            g.checkpoint(d, o).unwrap();
            g.set_seed(11);
            g.forward().unwrap();
            g.backward(loss).unwrap();
            assert_eq!(g.recompute_count(d).unwrap(), u64::from(o.is_some()));
            g.grad(wn).unwrap().unwrap()
        })
        .collect();
    assert!(grads[0].bit_eq(&grads[1]));
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn verbose_logs_every_recompute_through_tracing() {
    let (ctx, w) = setup();
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::with_default(subscriber, || {
        let (mut g, _, s, loss) = chain(&ctx, &w, 3);
        let quiet = CheckpointOptions {
            save_inputs: false,
            ..opts()
        };
        g.checkpoint(s[1], Some(quiet)).unwrap();
        g.checkpoint(
            s[2],
            Some(CheckpointOptions {
                verbose: true,
                ..quiet
            }),
        )
        .unwrap();
        g.forward().unwrap();
        g.backward(loss).unwrap();
        assert_eq!(g.recompute_count(s[1]).unwrap(), 1);
    });
    let log = String::from_utf8(capture.0.lock().unwrap().clone()).unwrap();
    assert!(log.contains("recomputing s2"), "{log}");
    assert!(!log.contains("recomputing s1"), "s1 is not verbose: {log}");
}

#[test]
fn budget_exceeded_is_an_error_naming_the_node() {
    let pool = MemoryPool::with_budget(70);
    let ctx = ExecContext::new(pool.clone(), 1).unwrap();
    let w = vec_tensor(&pool, "w", vec![1.0; 8], Category::Parameters);
    // w (32 bytes) and scale's output (32, saved by mul) are live: mul's 32 do not fit.
    let mut g = Graph::new(&ctx);
    let wn = g.param("w", &w);
    let a = g.scale(wn, 2.0).unwrap();
    let b = g.mul(a, wn).unwrap();
    g.set_name(b, "product").unwrap();
    let err = g.forward().unwrap_err();
    assert_eq!(
        err.to_string(),
        "out of memory while running node product: requested 32 B of activations with 64 B \
         live, budget 70 B (26 B short)"
    );
    drop(g);
    assert_eq!(
        pool.live(),
        32,
        "the failed step's values are gone, only w remains"
    );
}
