//! What a buffer is for ([`Category`]): the pool reports live and peak bytes per category,
//! and errors name the category that went over. Its own module so that the error type does
//! not import the pool.

use std::fmt;

/// What a buffer is for; the pool reports live and peak bytes per category.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Category {
    Parameters,
    Gradients,
    OptimizerState,
    Activations,
    Temporaries,
}

impl Category {
    pub const ALL: [Category; 5] = [
        Category::Parameters,
        Category::Gradients,
        Category::OptimizerState,
        Category::Activations,
        Category::Temporaries,
    ];

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Category {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Category::Parameters => "parameters",
            Category::Gradients => "gradients",
            Category::OptimizerState => "optimizer state",
            Category::Activations => "activations",
            Category::Temporaries => "temporaries",
        };
        f.write_str(s)
    }
}
