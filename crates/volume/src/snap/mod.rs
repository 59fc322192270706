//! Snapshots of volumes in the blob store (design 0011).
//!
//! - `map`: which layer holds each chunk (pure): presence records, views.
//! - `catalog`: the stack of layers and the snapshots naming them (pure).
//! - `layered`: the blob as the engines see it: reads from the newest
//!   layer holding each chunk, changes to the head.

pub mod catalog;
pub mod layered;
pub mod map;
pub mod stack;
