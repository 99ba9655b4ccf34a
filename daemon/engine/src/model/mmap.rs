//! Read-only memory maps of model files: the one place the daemon maps files into memory.
//!
//! Weights are used straight from the page cache (no copy at load; several processes or engines
//! loading one file share its pages). And the allocator's mapping policy, so that what an
//! unloaded model allocated goes back to the kernel ([`map_large_allocations`]).

#![allow(unsafe_code)] // the one memory map and the allocator's policy; see the SAFETY comments

use std::fs::File;
use std::ops::Deref;
use std::path::Path;
use std::sync::Arc;

/// Makes every heap allocation of 128 KiB or more a mapping of its own, at the size glibc starts
/// with (`M_MMAP_THRESHOLD`): its default raises the threshold to the largest block ever freed,
/// after which an unloaded model's tokenizer tables and scratch buffers land in the heap and stay
/// resident after they are freed (a daemon that loaded and unloaded a model 40 times grew from
/// 38 to 157 MiB; with the fixed threshold it returns to about 40). Does nothing elsewhere than
/// on glibc.
pub fn map_large_allocations() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_MMAP_THRESHOLD: i32 = -3;
        // SAFETY: mallopt changes only glibc's choice between heap and mapping for later
        // allocations (blocks already allocated are freed by whichever way made them); the
        // argument is a valid parameter and size.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 128 * 1024);
        }
    }
}

/// Hands the free pages of every malloc arena back to the kernel (glibc's `malloc_trim`): what
/// an unloaded model's many small allocations (a large vocabulary's strings and tables) left
/// free in the arenas of the threads that loaded and ran it, which glibc would otherwise keep
/// (Gemma 3's 262k-token vocabulary left about 90 MiB per unload). Does nothing elsewhere than
/// on glibc.
pub fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> i32;
        }
        // SAFETY: malloc_trim only returns free memory of the allocator's own arenas to the
        // kernel (under the arenas' locks); no live allocation is touched.
        unsafe {
            malloc_trim(0);
        }
    }
}

/// Hands the whole pages inside `buf` back to the kernel (`madvise(MADV_DONTNEED)`): they stop
/// counting as resident and read as zeros (+0.0) when next touched; the partial pages at either
/// end are left alone. For buffers from the global allocator (anonymous private memory, where a
/// dropped page comes back zero-filled), such as the CPU backend's KV pool. Does nothing
/// elsewhere than on Linux.
pub fn release_pages(buf: &mut [half::f16]) {
    #[cfg(target_os = "linux")]
    {
        extern "C" {
            fn madvise(addr: *mut std::ffi::c_void, len: usize, advice: i32) -> i32;
        }
        const MADV_DONTNEED: i32 = 4;
        const PAGE: usize = 4096;
        let start = buf.as_mut_ptr() as usize;
        let end = start + std::mem::size_of_val(buf);
        let (first, last) = (start.next_multiple_of(PAGE), end / PAGE * PAGE);
        if last > first {
            // SAFETY: [first, last) lies inside `buf`, which this call borrows exclusively (no
            // other reference reads or writes it meanwhile), and is page-aligned as madvise
            // wants. The memory is anonymous and private (the global allocator's), so the
            // dropped pages come back as zeros: all-zero bytes are a valid f16 (+0.0), and the
            // slice stays valid and initialized. The pages stay mapped; only residency changes.
            unsafe {
                madvise(first as *mut std::ffi::c_void, last - first, MADV_DONTNEED);
            }
        }
    }
}

/// Bytes a tensor lives in: a mapped file, or an owned buffer (models built in memory, tests,
/// weights a backend rearranged at load).
#[derive(Clone)]
pub enum Blob {
    Map(Arc<memmap2::Mmap>),
    Owned(Arc<dyn Deref<Target = [u8]> + Send + Sync>),
}

impl std::fmt::Debug for Blob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Blob({} bytes)", self.bytes().len())
    }
}

impl Blob {
    /// Maps `path` read-only.
    pub fn map(path: &Path) -> std::io::Result<Blob> {
        let file = File::open(path)?;
        // SAFETY: the map is read-only (and shared: no write of ours could reach the file). Another process truncating or rewriting the
        // file while it is mapped could change or fault the bytes under us; model files are
        // installed as whole files (package manager, fetch script renames into place), and every
        // length and offset read from them is checked before use, so the worst case is wrong
        // numbers or SIGBUS, the same contract every mmap-based loader (llama.cpp) has.
        let map = unsafe { memmap2::MmapOptions::new().map(&file)? };
        Ok(Blob::Map(Arc::new(map)))
    }

    pub fn from_vec(v: Vec<u8>) -> Blob {
        Blob::Owned(Arc::new(v))
    }

    /// Bytes of any owner.
    pub fn from_bytes(v: impl Deref<Target = [u8]> + Send + Sync + 'static) -> Blob {
        Blob::Owned(Arc::new(v))
    }

    pub fn bytes(&self) -> &[u8] {
        match self {
            Blob::Map(m) => m,
            Blob::Owned(v) => v,
        }
    }

    /// Says the whole pages of `bytes()[offset..offset + len]` of a mapped file will not be
    /// read for a while (a backend copied them into a layout of its own): they stop counting
    /// as this process's resident memory and are read from the page cache or the file again
    /// if touched. Does nothing to an owned buffer, or elsewhere than on Linux.
    pub fn release(&self, offset: usize, len: usize) {
        #[cfg(target_os = "linux")]
        if let Blob::Map(m) = self {
            const PAGE: usize = 4096;
            let start = m.as_ptr() as usize;
            let end = offset.saturating_add(len).min(m.len());
            let (first, last) = ((start + offset).next_multiple_of(PAGE) - start, (start + end) / PAGE * PAGE - start);
            if last > first {
                // SAFETY: the range lies inside the map (clamped to its length) and is
                // page-aligned. The map is a read-only view of a file that this process never
                // writes, so a dropped page reads back as the same bytes from the page cache
                // or the file: no reference into the map sees a change. Only residency
                // changes; the advice failing changes nothing.
                let _ = unsafe { m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, first, last - first) };
            }
        }
    }
}
