//! The order in which backward runs the nodes whose inputs are all in: a priority queue, as
//! PyTorch's `ReadyQueue`.
//!
//! Note [Ready order]: among the ready entries, a leaf (PyTorch's `AccumulateGrad`) runs
//! first, so that its `.grad` and post-accumulate hooks see the gradient as soon as nothing
//! more can reach it; then the node recorded last (the highest sequence number) runs, which
//! replays the forward pass backwards; entries of equal priority run in the order they became
//! ready. The order depends only on the graph and on the order in which ops were recorded,
//! never on addresses, so every run of one program (and every rank of a data-parallel job)
//! produces gradients in the same order. DDP's bucketing relies on it.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// The priority of a leaf: above every node.
pub(super) const LEAF_PRIORITY: u64 = u64::MAX;

/// Keys of ready entries, highest priority first, first-come first among equals.
#[derive(Default)]
pub(super) struct ReadyQueue {
    heap: BinaryHeap<(u64, Reverse<u64>, usize)>,
    pushed: u64,
}

impl ReadyQueue {
    pub(super) fn push(&mut self, priority: u64, key: usize) {
        self.heap.push((priority, Reverse(self.pushed), key));
        self.pushed += 1;
    }

    pub(super) fn pop(&mut self) -> Option<usize> {
        self.heap.pop().map(|(_, _, key)| key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaves_first_then_latest_node_then_arrival() {
        let mut q = ReadyQueue::default();
        q.push(3, 30);
        q.push(LEAF_PRIORITY, 1);
        q.push(7, 70);
        q.push(LEAF_PRIORITY, 2);
        q.push(3, 31);
        let order: Vec<usize> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(order, [1, 2, 70, 30, 31]);
    }
}
