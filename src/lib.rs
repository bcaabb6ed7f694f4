//! megainfer: batch-1 Llama-family inference.

pub mod cli;
pub mod fetch;
pub mod generate;
pub mod gpu;
pub mod interrupt;
pub mod model;
pub mod reference;
pub mod sampling;
pub mod tokenizer;
