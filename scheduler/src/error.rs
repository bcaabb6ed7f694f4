use thiserror::Error;

use crate::Buffer;

/// Why a schedule could not be built, or why a schedule is wrong. Instructions are named by
/// their index in the global order and described by their operation.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ScheduleError {
    #[error("model shape: {0}")]
    Shape(String),
    #[error("GPU shape: {0}")]
    Gpu(String),
    #[error("options: {0}")]
    Options(String),
    #[error("streams: {0}")]
    Streams(String),
    #[error(
        "possible deadlock: {instr} reads {buffer}[{element}], which {writer} writes later \
         in the global order"
    )]
    Deadlock {
        instr: String,
        buffer: Buffer,
        element: u32,
        writer: String,
    },
    #[error("{buffer}[{element}] is written twice per token: by {first} and by {second}")]
    DoubleWrite {
        buffer: Buffer,
        element: u32,
        first: String,
        second: String,
    },
    #[error("{instr} writes {buffer}, an input of the launch")]
    WriteToInput { instr: String, buffer: Buffer },
    #[error("{instr} reads {buffer}[{element}], which no instruction writes")]
    Unwritten {
        instr: String,
        buffer: Buffer,
        element: u32,
    },
    #[error("{instr} touches {buffer}[{start}..{end}], outside the buffer ({len} elements)")]
    OutOfBounds {
        instr: String,
        buffer: Buffer,
        start: u32,
        end: u32,
        len: usize,
    },
    #[error("cost model: {0}")]
    Cost(String),
}
