//! KV cache groups: how a model's layers share the pages of one block pool when some of them
//! attend over a sliding window (vLLM's hybrid allocator).
//!
//! A layer with a sliding window of `w` positions never reads a position more than `w - 1`
//! behind its query, so its K/V blocks can go back to the pool once the window has passed them;
//! a full-attention layer keeps every position. Blocks that held all layers together could not
//! be freed while one full-attention layer still needed them, so the layers are split into
//! groups of equal size, each group of one kind (one window, or none), and every sequence has
//! one block table per group. All groups draw pages from the one pool, and a page holds
//! `slots` layers' K/V for `block_size` positions whichever group it serves, so memory freed
//! by a window group is memory any group can use.
//!
//! Gemma 3 270M (15 sliding-window layers, 3 global ones) gives 6 groups of 3 layers: 5 window
//! groups whose tables keep only the blocks of the last 512 positions, and 1 full group. A model
//! without windows is one group of all its layers, the layout the cache always had.

/// The grouping of a model's layers; see the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvGroups {
    /// Per group: the sliding window of its layers, `None` for full attention.
    pub windows: Vec<Option<usize>>,
    /// Per layer: its group and its slot (index among the group's layers, in layer order).
    pub layer_slot: Vec<(usize, usize)>,
    /// Layers per group: the slots of a page.
    pub slots: usize,
}

impl KvGroups {
    /// Groups layers whose windows are `windows` (one entry per layer, `None` for full
    /// attention): the layers of each kind in order, in groups of the greatest common divisor
    /// of the kinds' layer counts.
    pub fn for_layers(windows: &[Option<usize>]) -> KvGroups {
        assert!(!windows.is_empty(), "a model has layers");
        let mut kinds: Vec<Option<usize>> = Vec::new();
        for w in windows {
            if !kinds.contains(w) {
                kinds.push(*w);
            }
        }
        let count = |k: &Option<usize>| windows.iter().filter(|w| *w == k).count();
        let slots = kinds.iter().map(count).fold(0, gcd);
        let mut groups = KvGroups { windows: Vec::new(), layer_slot: vec![(0, 0); windows.len()], slots };
        for kind in &kinds {
            let layers: Vec<usize> = (0..windows.len()).filter(|&l| windows[l] == *kind).collect();
            for chunk in layers.chunks(slots) {
                let g = groups.windows.len();
                groups.windows.push(*kind);
                for (slot, &l) in chunk.iter().enumerate() {
                    groups.layer_slot[l] = (g, slot);
                }
            }
        }
        groups
    }

    /// One group of `layers` full-attention layers.
    pub fn full(layers: usize) -> KvGroups {
        KvGroups::for_layers(&vec![None; layers])
    }

    pub fn len(&self) -> usize {
        self.windows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma3_pattern_gives_equal_groups_of_one_kind() {
        // Five sliding-window layers then a global one, three times (Gemma 3 270M).
        let windows: Vec<Option<usize>> = (0..18).map(|l| if l % 6 == 5 { None } else { Some(512) }).collect();
        let g = KvGroups::for_layers(&windows);
        assert_eq!(g.slots, 3);
        assert_eq!(g.windows, vec![Some(512), Some(512), Some(512), Some(512), Some(512), None]);
        // Every (group, slot) pair is used by exactly one layer of the group's kind.
        let mut seen = std::collections::HashSet::new();
        for (l, &(grp, slot)) in g.layer_slot.iter().enumerate() {
            assert!(slot < g.slots && seen.insert((grp, slot)), "layer {l}");
            assert_eq!(g.windows[grp], windows[l], "layer {l} is in a group of its kind");
        }
        assert_eq!(g.layer_slot[5], (5, 0));
        assert_eq!(g.layer_slot[17], (5, 2));
    }

    #[test]
    fn a_model_without_windows_is_one_group() {
        let g = KvGroups::full(30);
        assert_eq!((g.len(), g.slots), (1, 30));
        assert!(g.layer_slot.iter().enumerate().all(|(l, &s)| s == (0, l)));
        // Layer counts with no common divisor above 1: groups of one layer.
        let g = KvGroups::for_layers(&[Some(4), None, Some(4)]);
        assert_eq!((g.len(), g.slots), (3, 1));
    }
}
