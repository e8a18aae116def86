//! `Lru`: a set of small integer ids (KV blocks, SSM snapshot entries) ordered by when each was
//! last touched, so the prefix cache can evict the least recently used one.
//!
//! Invariants:
//! - An id is in the set at most once; touching it again moves it to the most recent end.
//! - The clock only moves forward, so the order is total and deterministic: two runs that touch
//!   the same ids in the same order evict the same ids.

use std::collections::BTreeMap;

/// See the module header.
#[derive(Debug, Clone, Default)]
pub(crate) struct Lru {
    clock: u64,
    /// Ids by the time they were last touched, oldest first.
    order: BTreeMap<u64, u32>,
    /// When each id was last touched, while it is in the set (indexed by id).
    stamp: Vec<Option<u64>>,
}

impl Lru {
    /// An empty set for ids `0..ids`.
    pub fn new(ids: usize) -> Lru {
        Lru {
            clock: 0,
            order: BTreeMap::new(),
            stamp: vec![None; ids],
        }
    }

    /// Put `id` in the set as the most recently used, or move it there. Ids past the range
    /// given to `new` are ignored.
    pub fn touch(&mut self, id: u32) {
        let Some(stamp) = self.stamp.get_mut(id as usize) else {
            return;
        };
        if let Some(old) = stamp.take() {
            self.order.remove(&old);
        }
        self.clock += 1;
        *stamp = Some(self.clock);
        self.order.insert(self.clock, id);
    }

    /// Take `id` out of the set; returns whether it was in it.
    pub fn remove(&mut self, id: u32) -> bool {
        match self.stamp.get_mut(id as usize).and_then(Option::take) {
            Some(old) => {
                self.order.remove(&old);
                true
            }
            None => false,
        }
    }

    /// Take out and return the least recently used id.
    pub fn pop_oldest(&mut self) -> Option<u32> {
        let (_, id) = self.order.pop_first()?;
        if let Some(s) = self.stamp.get_mut(id as usize) {
            *s = None;
        }
        Some(id)
    }

    /// Ids in the set.
    pub fn len(&self) -> usize {
        self.order.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_touched_id_goes_first() {
        let mut l = Lru::new(5);
        for id in [3, 1, 4] {
            l.touch(id);
        }
        l.touch(3);
        assert!(l.remove(1));
        assert!(!l.remove(1), "already out");
        l.touch(0);
        assert_eq!(l.len(), 3);
        let order: Vec<u32> = std::iter::from_fn(|| l.pop_oldest()).collect();
        assert_eq!(order, [4, 3, 0]);
        l.touch(9);
        assert_eq!(l.len(), 0, "an id out of range is ignored");
    }
}
