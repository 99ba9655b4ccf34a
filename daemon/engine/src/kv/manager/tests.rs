//! Block accounting of the KV cache manager: no leak, sharing, copy-on-write, prefix hits.

use super::*;

fn toks(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| i * 7 + salt).collect()
}

#[test]
fn append_allocates_blocks_and_free_returns_them() {
    let mut m = KvCacheManager::new(8, 4);
    let s = m.create();
    assert!(m.append(s, &toks(9, 0)).unwrap().is_empty());
    assert_eq!(m.blocks_used(s), 3);
    assert_eq!(m.stats().free, 5);
    m.append(s, &[1, 2, 3]).unwrap();
    assert_eq!(m.blocks_used(s), 3, "the partial block fills before a new one is taken");
    m.free(s);
    assert_eq!(m.stats().free, 8);
}

#[test]
fn out_of_blocks_changes_nothing() {
    let mut m = KvCacheManager::new(2, 4);
    let s = m.create();
    m.append(s, &toks(5, 0)).unwrap();
    let err = m.append(s, &toks(8, 1)).unwrap_err();
    assert_eq!(err, OutOfBlocks { needed: 2, free: 0, states: false });
    assert_eq!(m.len(s), 5);
    assert_eq!(m.blocks_used(s), 2);
}

#[test]
fn fork_shares_blocks_and_copies_on_write() {
    let mut m = KvCacheManager::new(10, 4);
    let a = m.create();
    m.append(a, &toks(6, 0)).unwrap();
    m.commit(a, 6);
    let b = m.fork(a);
    assert_eq!(m.stats().free, 8, "a fork takes no block");
    assert_eq!(m.block_table(a), m.block_table(b));
    // Writing into the shared partial block copies it, for the writer only.
    let copies = m.append(b, &[99]).unwrap();
    assert_eq!(copies.len(), 1);
    assert_eq!(copies[0].src, m.block_table(a)[1]);
    assert_eq!(copies[0].dst, m.block_table(b)[1]);
    assert_eq!(m.block_table(a)[0], m.block_table(b)[0], "full prefix block stays shared");
    // The other sequence now owns its block alone: no copy.
    assert!(m.append(a, &[5]).unwrap().is_empty());
    m.free(a);
    m.free(b);
    assert_eq!(m.stats().free, 10);
}

#[test]
fn truncate_releases_whole_blocks() {
    let mut m = KvCacheManager::new(10, 4);
    let s = m.create();
    m.append(s, &toks(12, 0)).unwrap();
    m.commit(s, 12);
    m.truncate(s, 5).unwrap();
    assert_eq!(m.len(s), 5);
    assert_eq!(m.blocks_used(s), 2);
    assert_eq!(m.computed(s), 5);
    assert_eq!(m.stats().free, 8);
    // Rewriting position 5.. must not corrupt a cached block that others may hit.
    m.append(s, &[1000, 1001, 1002]).unwrap();
    m.commit(s, 8);
    let t = m.create();
    let mut prompt = toks(5, 0);
    prompt.extend([1000, 1001, 1002, 7]);
    assert_eq!(m.match_prefix(t, &prompt), 8);
}

#[test]
fn prefix_cache_hits_full_blocks_only_and_survives_free() {
    let mut m = KvCacheManager::new(16, 4);
    let prompt = toks(10, 3);
    let a = m.create();
    assert_eq!(m.match_prefix(a, &prompt), 0);
    m.append(a, &prompt).unwrap();
    m.commit(a, 10);
    m.free(a);
    assert_eq!(m.stats().cached, 2);
    let b = m.create();
    assert_eq!(m.match_prefix(b, &prompt), 8);
    assert_eq!(m.len(b), 8);
    m.append(b, &prompt[8..]).unwrap();
    // A prompt that is exactly cached still leaves its last block to compute.
    let c = m.create();
    assert_eq!(m.match_prefix(c, &prompt[..8]), 4);
    // A different first block misses everything after it (the hash chains).
    let d = m.create();
    let mut other = prompt.clone();
    other[0] += 1;
    assert_eq!(m.match_prefix(d, &other), 0);
    for s in [b, c, d] {
        m.free(s);
    }
    assert_eq!(m.stats().free, 16);
}

#[test]
fn cached_blocks_are_evicted_when_needed() {
    let mut m = KvCacheManager::new(4, 4);
    let a = m.create();
    m.append(a, &toks(8, 0)).unwrap();
    m.commit(a, 8);
    m.free(a);
    assert_eq!(m.stats().cached, 2);
    let b = m.create();
    m.append(b, &toks(16, 100)).unwrap();
    assert_eq!(m.stats().free, 0);
    assert_eq!(m.stats().cached, 0, "all cached blocks evicted for new contents");
}

#[test]
fn blocks_needed_for_a_step_is_exactly_what_its_appends_take() {
    // Three holders of one partial block (a and two forks) and one fresh sequence; every
    // combination of writers and span lengths: the count made before must equal the blocks
    // the appends then take, copy-on-write included (the last holder to write keeps it). With
    // one full group, and with a window group beside it (forks share blocks in both tables,
    // and copy-on-write happens in each).
    for groups in [vec![None], vec![Some(6), None]] {
        for writers in 1..=3usize {
            for span in [1usize, 2, 3, 6] {
                let mut m = KvCacheManager::with_groups(64, 4, groups.clone());
                let a = m.create();
                m.append(a, &toks(6, 0)).unwrap();
                m.commit(a, 6);
                let holders = [a, m.fork(a), m.fork(a)];
                let c = m.create();
                let mut items: Vec<(SeqId, usize)> = holders[..writers].iter().map(|&s| (s, span)).collect();
                items.push((c, 5));
                let counted = m.blocks_needed_for_step(&items);
                let before = m.stats().free;
                for &(s, n) in &items {
                    m.append(s, &toks(n, 9)).unwrap();
                }
                assert_eq!(counted, before - m.stats().free, "{groups:?}: {writers} writers of {span} tokens");
            }
        }
    }
}

/// Window blocks one group of a sequence holds after `slide`, at most: the window and the
/// rollback margin, plus a partial block at each end.
fn window_bound(window: usize, bs: usize) -> usize {
    (window + ROLLBACK).div_ceil(bs) + 2
}

#[test]
fn window_groups_release_what_their_window_passed_and_the_pool_reuses_it() {
    // One window group (8 positions) and one full group, blocks of 4: a sequence of 200
    // tokens needs 50 full blocks; without releases the window group would need 50 more,
    // which a pool of 70 does not have.
    let (bs, window) = (4, 8);
    let mut m = KvCacheManager::with_groups(70, bs, vec![Some(window), None]);
    let s = m.create();
    m.append(s, &toks(1, 0)).unwrap();
    m.commit(s, 1);
    for i in 1..200u32 {
        m.append(s, &[i]).unwrap();
        m.commit(s, i as usize + 1);
        m.slide(s);
        let held = m.block_tables(s)[0].iter().filter(|&&b| b != NO_BLOCK).count();
        assert!(held <= window_bound(window, bs), "step {i}: {held} window blocks held");
        // Released entries are exactly a prefix of the table, and what the next query reads
        // is there.
        let t = &m.block_tables(s)[0];
        let first = (i as usize + 2).saturating_sub(window) / bs;
        assert!(t[first..].iter().all(|&b| b != NO_BLOCK), "step {i}");
    }
    assert_eq!(m.block_tables(s)[1].len(), 50);
    assert!(m.block_tables(s)[1].iter().all(|&b| b != NO_BLOCK), "the full group keeps everything");
    assert_eq!(m.stats().free, 70 - m.blocks_used(s));
    m.free(s);
    assert_eq!(m.stats().free, 70, "nothing leaked");
}

#[test]
fn rollback_within_the_margin_works_and_below_it_changes_nothing() {
    let (bs, window) = (4, 8);
    let mut m = KvCacheManager::with_groups(200, bs, vec![Some(window), None]);
    let s = m.create();
    m.append(s, &toks(100, 0)).unwrap();
    m.commit(s, 100);
    m.slide(s);
    let (tables, used) = (m.block_tables(s).to_vec(), m.blocks_used(s));
    let err = m.truncate(s, 20).unwrap_err();
    assert_eq!(err, RollbackError::WindowReleased { len: 20, kept: err_kept(&err) });
    assert_eq!((m.len(s), m.block_tables(s), m.blocks_used(s)), (100, &tables[..], used), "refused: unchanged");
    m.truncate(s, 100 - ROLLBACK).unwrap();
    assert_eq!(m.len(s), 100 - ROLLBACK);
    m.free(s);
    assert_eq!(m.stats().free, 200);
}

#[test]
fn a_prefix_hit_on_a_windowed_model_takes_only_the_window_blocks() {
    let (bs, window) = (4, 8);
    let mut m = KvCacheManager::with_groups(200, bs, vec![Some(window), None]);
    let prompt = toks(100, 5);
    let a = m.create();
    m.append(a, &prompt).unwrap();
    m.commit(a, 100);
    m.slide(a);
    m.free(a);
    // The full group's blocks and the window group's last ones stayed cached.
    let b = m.create();
    let mut longer = prompt.clone();
    longer.push(1);
    assert_eq!(m.match_prefix(b, &longer), 100);
    let t = m.block_tables(b);
    let first = (100 + 1 - window) / bs;
    assert!(t[0][..first].iter().all(|&b| b == NO_BLOCK) && t[0][first..].iter().all(|&b| b != NO_BLOCK));
    assert!(t[1].iter().all(|&b| b != NO_BLOCK));
    assert_eq!(m.blocks_used(b), 25 + (25 - first));
    m.free(b);
    assert_eq!(m.stats().free, 200);
}

#[test]
fn prefix_cache_partitions_match_only_their_own_blocks() {
    let mut m = KvCacheManager::new(16, 4);
    let prompt = toks(10, 3);
    let fill = |m: &mut KvCacheManager, partition: Option<u64>| {
        let s = m.create_in(partition);
        let hit = m.match_prefix(s, &prompt);
        m.append(s, &prompt[hit..]).unwrap();
        m.commit(s, 10);
        m.free(s);
        hit
    };
    assert_eq!(fill(&mut m, Some(1000)), 0, "user 1000 prefills");
    assert_eq!(fill(&mut m, Some(1000)), 8, "and finds it cached again");
    assert_eq!(fill(&mut m, Some(1001)), 0, "user 1001 finds nothing of user 1000's");
    assert_eq!(fill(&mut m, None), 0, "nor does the shared part");
    assert_eq!(fill(&mut m, None), 8, "which caches its own");
    // Forks stay in their sequence's partition: a fork's blocks committed later are found by
    // the same partition only.
    let a = m.create_in(Some(7));
    m.append(a, &prompt[..2]).unwrap();
    let b = m.fork(a);
    m.append(b, &prompt[2..]).unwrap();
    m.commit(b, 10);
    m.free(a);
    m.free(b);
    let (p7, p8) = (m.create_in(Some(7)), m.create_in(Some(8)));
    assert_eq!((m.match_prefix(p7, &prompt), m.match_prefix(p8, &prompt)), (8, 0));
}

fn err_kept(e: &RollbackError) -> usize {
    match e {
        RollbackError::WindowReleased { kept, .. } => *kept,
        RollbackError::Recurrent { kept, .. } => *kept,
    }
}

#[test]
fn a_recurrent_state_is_taken_on_first_append_shared_by_forks_and_copied_by_the_first_writer() {
    let mut m = KvCacheManager::new(64, 4).with_states(3);
    assert!(m.recurrent());
    let a = m.create();
    assert_eq!(m.state(a), None, "no state before the first append");
    assert_eq!(m.match_prefix(a, &toks(20, 0)), 0, "nothing cached yet");
    assert_eq!(m.states_needed_for_step(&[(a, 5)]), 1);
    m.append(a, &toks(5, 0)).unwrap();
    m.commit(a, 5);
    let sa = m.state(a).unwrap();
    assert_eq!(m.state_slots(), (3, 2));
    // Forks share it; the first to write copies it away, the last holder writes in place.
    let (b, c) = (m.fork(a), m.fork(a));
    assert_eq!((m.state(b), m.state(c)), (Some(sa), Some(sa)));
    assert_eq!(m.states_needed_for_step(&[(a, 1), (b, 1), (c, 1)]), 2, "three writers of one state: two copies");
    assert_eq!(m.states_needed_for_step(&[(b, 1)]), 1);
    m.append(b, &[7]).unwrap();
    let sb = m.state(b).unwrap();
    assert_ne!(sb, sa);
    assert_eq!(m.take_state_copies(), vec![(sa, sb)]);
    assert!(m.take_state_copies().is_empty(), "taken once");
    // Every slot in use: a fourth sequence's first append is refused, changing nothing.
    m.append(c, &[8]).unwrap();
    assert_eq!(m.take_state_copies(), vec![(sa, m.state(c).unwrap())]);
    let d = m.create();
    let err = m.append(d, &[1]).unwrap_err();
    assert_eq!(err, OutOfBlocks { needed: 1, free: 0, states: true });
    assert_eq!((m.len(d), m.state(d)), (0, None));
    // The last holder of the original writes in place.
    assert_eq!(m.states_needed_for_step(&[(a, 1)]), 0);
    m.append(a, &[9]).unwrap();
    assert_eq!(m.state(a), Some(sa));
    assert!(m.take_state_copies().is_empty(), "written in place");
    // A state goes back up to ROLLBACK positions behind the furthest it has run, and no
    // further, however it came and went since; uncomputed tokens (appended, not run) can go.
    m.truncate(a, 5).unwrap();
    m.append(a, &toks(40, 1)).unwrap();
    m.commit(a, 45);
    let kept = 45 - ROLLBACK;
    assert_eq!(m.truncate(a, kept - 1), Err(RollbackError::Recurrent { len: kept - 1, kept }));
    assert_eq!((m.len(a), m.computed(a)), (45, 45), "refused: unchanged");
    m.truncate(a, kept + 4).unwrap();
    m.append(a, &toks(2, 2)).unwrap();
    m.commit(a, kept + 6);
    assert_eq!(m.truncate(a, kept - 1), Err(RollbackError::Recurrent { len: kept - 1, kept }), "still from 45");
    m.truncate(a, kept).unwrap();
    assert_eq!((m.len(a), m.computed(a), m.state(a)), (kept, kept, Some(sa)), "the same state, gone back");
    // Freeing releases the slots.
    for s in [a, b, c, d] {
        m.free(s);
    }
    assert_eq!(m.state_slots(), (3, 3));
    assert_eq!(m.stats().free, 64);
}

/// Runs a recurrent sequence's whole prompt in one step (after its cached prefix) and commits
/// it, keeping its checkpoint; returns the prompt tokens that came from the cache.
fn run_prompt(m: &mut KvCacheManager, s: SeqId, prompt: &[u32]) -> usize {
    let cached = m.match_prefix(s, prompt);
    m.append(s, &prompt[cached..]).unwrap();
    m.plan_checkpoints(&[(s, prompt.len() - cached)]);
    m.commit(s, prompt.len());
    cached
}

#[test]
fn a_shared_system_prompt_keeps_its_recurrent_state_where_the_conversation_turns() {
    // Token 1 ends a turn. A system prompt of 13 tokens, a question of 6, an answer's header
    // of 3: the state is kept at 12, the block boundary at the system prompt's end, so another
    // question after the same system prompt starts there.
    let bs = 4;
    let mut m = KvCacheManager::new(64, bs).with_states(8).with_turn_ends(&[1]);
    let turn = |body: Vec<u32>| body.into_iter().chain([1]).collect::<Vec<u32>>();
    let system = turn(toks(12, 100));
    let chat = |q: u32| [system.clone(), turn(toks(5, q)), vec![50, 51, 52]].concat();
    let a = m.create();
    assert_eq!(run_prompt(&mut m, a, &chat(200)), 0);
    let b = m.create();
    assert_eq!(run_prompt(&mut m, b, &chat(300)), 12, "another question, from the system prompt's state");
    // A follow-up repeats the first exchange and its answer: it starts from the system
    // prompt's state and keeps its own at its answer's end (28), where the next follow-up
    // starts.
    let answer = |salt: u32| turn(toks(7, salt));
    let follow_up = [chat(200), answer(400), turn(toks(3, 500)), vec![50, 51, 52]].concat();
    let c = m.create();
    assert_eq!(run_prompt(&mut m, c, &follow_up), 12);
    let third = [follow_up, answer(600), turn(toks(3, 700)), vec![50, 51, 52]].concat();
    let c2 = m.create();
    assert_eq!(run_prompt(&mut m, c2, &third), 28);
    for s in [a, b, c, c2] {
        m.free(s);
    }
    // Without turns (completions), the second of two prompts that share a prefix keeps the
    // state where they part, for the third.
    let mut m = KvCacheManager::new(64, bs).with_states(8).with_turn_ends(&[1]);
    let shared = toks(14, 600);
    let raw = |salt: u32| [shared.clone(), toks(8, salt)].concat();
    let (d, e, f) = (m.create(), m.create(), m.create());
    assert_eq!(run_prompt(&mut m, d, &raw(700)), 0);
    assert_eq!(run_prompt(&mut m, e, &raw(800)), 0, "no state where they part yet");
    assert_eq!(run_prompt(&mut m, f, &raw(900)), 12, "the second kept it");
    for s in [d, e, f] {
        m.free(s);
    }
}

#[test]
fn a_recurrent_prompt_starts_from_the_checkpoint_at_its_cached_prefix() {
    let bs = 4;
    let mut m = KvCacheManager::new(64, bs).with_states(4);
    let prompt = toks(22, 3);
    // Cold: nothing cached; the state is to be kept at 20, the last block boundary that leaves
    // a token to compute.
    let a = m.create();
    assert_eq!(m.match_prefix(a, &prompt), 0);
    m.append(a, &prompt[..10]).unwrap();
    m.plan_checkpoints(&[(a, 10)]);
    assert_eq!(m.checkpoint(a, 0, 10), None, "not reached yet");
    m.commit(a, 10);
    m.append(a, &prompt[10..]).unwrap();
    m.plan_checkpoints(&[(a, 12)]);
    let (at, slot) = m.checkpoint(a, 10, 22).unwrap();
    assert_eq!(at, 20);
    assert_ne!(Some(slot), m.state(a));
    m.commit(a, 22);
    assert_eq!(m.checkpoints(), 1);
    assert_eq!(m.checkpoint(a, 22, 23), None, "kept once");
    // The same prompt again: its 5 blocks and the state at 20; shared until it writes.
    let b = m.create();
    assert_eq!(m.match_prefix(b, &prompt), 20);
    assert_eq!(m.state(b), Some(slot));
    assert_eq!(m.states_needed_for_step(&[(b, 2)]), 1, "a copy before it writes");
    m.append(b, &prompt[20..]).unwrap();
    assert_eq!(m.take_state_copies(), vec![(slot, m.state(b).unwrap())]);
    // It goes back no further than where its checkpoint put it.
    m.commit(b, 22);
    assert_eq!(m.truncate(b, 19), Err(RollbackError::Recurrent { len: 19, kept: 20 }));
    m.truncate(b, 20).unwrap();
    m.append(b, &prompt[20..]).unwrap();
    // A prompt that leaves the cached blocks before 20 has no checkpoint to start from.
    let c = m.create();
    let mut other = prompt.clone();
    other[18] = 999;
    assert_eq!(m.match_prefix(c, &other), 0);
    // Slots run out: the checkpoint no sequence holds is evicted for a sequence's state.
    m.free(a);
    m.free(b);
    let (d, e) = (m.create(), m.create());
    for s in [c, d, e] {
        m.append(s, &[1]).unwrap();
    }
    assert_eq!((m.checkpoints(), m.state_slots()), (1, (4, 1)));
    let f = m.create();
    m.append(f, &[1]).unwrap();
    assert_eq!((m.checkpoints(), m.state_slots()), (0, (4, 0)), "evicted for f");
    for s in [c, d, e, f] {
        m.free(s);
    }
    assert_eq!(m.state_slots(), (4, 4));
}
