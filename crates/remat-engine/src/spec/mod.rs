//! Declarative recompute specs: a block declares its activation slots; remat compiles and
//! runs a per-layer recompute plan.
//!
//! A spec ([`BlockSpec`], TOML, JSON or built in Rust) lists a block's inputs, parameters,
//! globals and activation slots. Each slot says whether backward needs it (`save`), whether
//! it may be rebuilt (`recompute`, from `recompute_from` with `recompute_op`, by default a
//! replay of the forward op), when (`recompute_policy`: `always`; `lora_only`, saved under
//! full fine-tuning; `never`), whether it goes to the host store (`offload`), and when it
//! exists at all (`when`, a condition on the model config and `layer`).
//!
//! [`compile()`] turns a spec and a [`ModelConfig`] into a [`Plan`]: per layer, each slot's
//! [`Disposition`], the ordered recompute [`Step`]s and the saved / recomputed / offloaded
//! bytes.
//!
//! The folder reads in the order a spec goes: [`types`], [`config`] and [`expr`] (what a
//! spec says), [`compile`](mod@compile) (the per-layer plan), [`run`] (the runtime that executes a plan:
//! slots, recompute, offload, the pool meter), [`models`] (the spec-driven models on that
//! runtime: Qwen3, Mamba, hybrid), [`mix`] (a per-layer mix of plans for a budget).

pub mod compile;
pub mod config;
pub mod derive;
pub mod error;
pub mod expr;
pub mod mix;
pub mod models;
pub mod ops;
pub mod run;
pub mod shipped;
pub mod types;

pub use compile::{
    Disposition, InputPlan, LayerBytes, LayerChoice, LayerPlan, Mode, Operand, Plan, Prefetch,
    Resolved, SharedBuffer, SlotPlan, Step, compile,
};
pub use config::ModelConfig;
pub use error::{Result, SpecError};
pub use types::{
    BlockSpec, Dtype, GlobalSpec, InputSpec, ParamSpec, RecomputePolicy, SlotSpec, Value,
};
