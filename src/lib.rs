//! megainfer: batch-1 Llama-family inference.

pub mod model;
pub mod reference;
pub mod tokenizer;
