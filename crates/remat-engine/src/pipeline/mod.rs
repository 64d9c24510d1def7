//! Pipeline stages with a per-micro-batch activation checkpoint manager.
