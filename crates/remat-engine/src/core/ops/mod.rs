//! Graph ops, one per file, each implementing [`crate::core::op::Op`] with its forward and
//! backward side by side, plus a builder method on [`crate::Graph`].

pub mod add;
pub mod bias;
pub mod dropout;
pub mod matmul;
pub mod mse;
pub mod mul;
pub mod relu;
pub mod reshape;
pub mod scale;
pub mod slice;
pub mod transpose;

// Transformer ops (engine-gpt).
pub mod activation;
pub mod attention;
pub mod cross_entropy;
pub mod embedding;
pub mod fused;
pub mod rmsnorm;
pub mod softmax;
