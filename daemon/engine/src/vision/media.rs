//! Images as tokens of a sequence: each image of a prompt takes `n` positions whose token ids
//! are media ids (at or above [`MEDIA_BASE`], outside any vocabulary), derived from a hash of
//! its decoded pixels. Everything that keys on tokens then keys on image content: the prefix
//! cache reuses an image's K/V blocks when the same pixels come again (a chat app sends the
//! same screenshot every turn), forks and recomputed prompts carry their images along, and a
//! different image can never match.
//!
//! The [`MediaTable`] maps each media id to its image and row while some request holds it
//! (entries are counted), and keeps the embeddings of the last images encoded, so an image
//! whose blocks left the cache but whose embeddings did not is not encoded again.

use super::preprocess::RgbImage;
use std::collections::hash_map::DefaultHasher;
use std::collections::{HashMap, VecDeque};
use std::hash::Hasher;
use std::sync::Arc;

/// The first media id: token ids from here on are image positions (vocabularies stay far
/// below 2³¹).
pub const MEDIA_BASE: u32 = 1 << 31;

/// Encoded images whose embeddings are kept after their last request ends.
const KEPT_EMBEDDINGS: usize = 8;

/// A 128-bit hash of an image's size and pixels.
pub fn pixel_hash(img: &RgbImage) -> u128 {
    let half = |salt: u64| {
        let mut h = DefaultHasher::new();
        h.write_u64(salt);
        h.write_usize(img.width);
        h.write_usize(img.height);
        h.write(&img.pixels);
        h.finish()
    };
    (u128::from(half(0x5eed_0001)) << 64) | u128::from(half(0x5eed_0002))
}

/// An image of a prompt: its first position and its pixels, and once the engine has
/// registered it, its media (whose ids fill its positions).
#[derive(Clone, Debug)]
pub struct PromptImage {
    pub at: usize,
    pub image: Arc<RgbImage>,
    pub media: Option<Arc<Media>>,
}

/// One registered image.
#[derive(Debug)]
pub struct Media {
    pub hash: u128,
    pub image: Arc<RgbImage>,
    /// Its image tokens' columns and rows.
    pub grid: (usize, usize),
    /// Its token ids, one per position it takes, in order (row-major over `grid`).
    pub ids: Vec<u32>,
}

/// The media ids of live requests, and the embeddings of recent images.
#[derive(Debug, Default)]
pub struct MediaTable {
    /// Each media id's image and row.
    by_id: HashMap<u32, (Arc<Media>, usize)>,
    /// Registered images by pixel hash, with how many registrations hold each.
    by_hash: HashMap<u128, (Arc<Media>, usize)>,
    /// Embeddings by pixel hash, most recent last; those of held images and the last
    /// [`KEPT_EMBEDDINGS`] others.
    embeddings: VecDeque<(u128, Arc<[f32]>)>,
}

/// Id `i` of an image with hash `hash`, under `salt` (0 unless an id was taken).
fn media_id(hash: u128, salt: u64, i: usize) -> u32 {
    // splitmix64's finalizer over the hash's halves, the salt and the row.
    let mut z = (hash as u64) ^ ((hash >> 64) as u64).rotate_left(17) ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z ^= (i as u64).wrapping_mul(0xd6e8_feb8_6659_fd93);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    MEDIA_BASE | (z as u32 & !MEDIA_BASE)
}

impl MediaTable {
    /// Registers `image` as a grid of `(columns, rows)` image tokens, one position each, and
    /// returns its ids; the same pixels registered again
    /// get the same ids (and count one more holder). Ids are a function of the pixels unless
    /// one is taken by another image, when the image takes a salted set (its prefix-cache
    /// entries then are its own).
    pub fn register(&mut self, image: Arc<RgbImage>, grid: (usize, usize)) -> Arc<Media> {
        let n = grid.0 * grid.1;
        let hash = pixel_hash(&image);
        if let Some((m, holders)) = self.by_hash.get_mut(&hash) {
            if m.grid == grid {
                *holders += 1;
                return Arc::clone(m);
            }
        }
        let mut salt = 0;
        let ids = loop {
            let ids: Vec<u32> = (0..n).map(|i| media_id(hash, salt, i)).collect();
            let distinct = ids.iter().collect::<std::collections::HashSet<_>>().len() == n;
            if distinct && ids.iter().all(|id| !self.by_id.contains_key(id)) {
                break ids;
            }
            salt += 1;
        };
        let m = Arc::new(Media { hash, image, grid, ids });
        for (row, &id) in m.ids.iter().enumerate() {
            self.by_id.insert(id, (Arc::clone(&m), row));
        }
        self.by_hash.insert(hash, (Arc::clone(&m), 1));
        m
    }

    /// One holder of `m` is done with it; its ids are forgotten with the last.
    pub fn release(&mut self, m: &Media) {
        let Some((_, holders)) = self.by_hash.get_mut(&m.hash) else { return };
        *holders -= 1;
        if *holders == 0 {
            self.by_hash.remove(&m.hash);
            for id in &m.ids {
                self.by_id.remove(id);
            }
            self.trim();
        }
    }

    /// The image and row of media id `id`, while registered.
    pub fn lookup(&self, id: u32) -> Option<(&Arc<Media>, usize)> {
        self.by_id.get(&id).map(|(m, row)| (m, *row))
    }

    /// Whether some request holds the image with hash `hash`.
    pub fn holds(&self, hash: u128) -> bool {
        self.by_hash.contains_key(&hash)
    }

    /// Images registered now.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// The embeddings of the image with hash `hash`, where kept.
    pub fn embeddings(&mut self, hash: u128) -> Option<Arc<[f32]>> {
        let i = self.embeddings.iter().position(|(h, _)| *h == hash)?;
        let e = self.embeddings.remove(i)?;
        let rows = Arc::clone(&e.1);
        self.embeddings.push_back(e);
        Some(rows)
    }

    /// Keeps the embeddings of the image with hash `hash`.
    pub fn keep(&mut self, hash: u128, rows: Arc<[f32]>) {
        self.embeddings.retain(|(h, _)| *h != hash);
        self.embeddings.push_back((hash, rows));
        self.trim();
    }

    /// Drops the oldest embeddings of images nobody holds past [`KEPT_EMBEDDINGS`].
    fn trim(&mut self) {
        let mut free = self.embeddings.iter().filter(|(h, _)| !self.by_hash.contains_key(h)).count();
        let mut i = 0;
        while free > KEPT_EMBEDDINGS && i < self.embeddings.len() {
            if self.by_hash.contains_key(&self.embeddings[i].0) {
                i += 1;
            } else {
                self.embeddings.remove(i);
                free -= 1;
            }
        }
    }

    /// Embeddings kept now (for tests and status).
    pub fn kept(&self) -> usize {
        self.embeddings.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(seed: u8) -> Arc<RgbImage> {
        Arc::new(RgbImage { width: 2, height: 1, pixels: vec![seed, 1, 2, 3, 4, 5] })
    }

    #[test]
    fn the_same_pixels_get_the_same_ids_and_others_others() {
        let mut t = MediaTable::default();
        let a = t.register(image(0), (4, 4));
        let b = t.register(image(0), (4, 4));
        let c = t.register(image(9), (4, 4));
        assert_eq!(a.ids, b.ids);
        assert!(a.ids.iter().all(|&id| id >= MEDIA_BASE) && a.ids.iter().all(|id| !c.ids.contains(id)));
        assert_eq!(t.lookup(a.ids[5]).map(|(m, r)| (m.hash, r)), Some((a.hash, 5)));
        // A fresh table gives the same ids: they are a function of the pixels.
        assert_eq!(MediaTable::default().register(image(0), (4, 4)).ids, a.ids);
        t.release(&a);
        assert!(t.lookup(a.ids[0]).is_some(), "still held once");
        t.release(&b);
        assert!(t.lookup(a.ids[0]).is_none() && t.lookup(c.ids[0]).is_some());
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn a_taken_id_moves_an_image_to_a_salted_set() {
        let mut t = MediaTable::default();
        let a = t.register(image(0), (2, 2));
        // Another image whose first unsalted id is taken (planted by hand).
        let other = image(7);
        let h = pixel_hash(&other);
        let squatter = Arc::new(Media { hash: 1, image: image(1), grid: (1, 1), ids: vec![media_id(h, 0, 2)] });
        t.by_id.insert(media_id(h, 0, 2), (Arc::clone(&squatter), 0));
        let b = t.register(other, (2, 2));
        assert_eq!(b.ids, (0..4).map(|i| media_id(h, 1, i)).collect::<Vec<_>>());
        assert!(b.ids.iter().all(|id| !a.ids.contains(id)));
    }

    #[test]
    fn embeddings_of_released_images_are_kept_a_while() {
        let mut t = MediaTable::default();
        let held = t.register(image(200), (1, 1));
        t.keep(held.hash, Arc::from(vec![1.0]));
        for s in 0..KEPT_EMBEDDINGS as u8 + 3 {
            t.keep(u128::from(s), Arc::from(vec![f32::from(s)]));
        }
        assert_eq!(t.kept(), KEPT_EMBEDDINGS + 1, "the held image's and the last {KEPT_EMBEDDINGS}");
        assert!(t.embeddings(held.hash).is_some() && t.embeddings(0).is_none());
        assert_eq!(
            t.embeddings(u128::from(KEPT_EMBEDDINGS as u8 + 2)).as_deref(),
            Some(&[f32::from(KEPT_EMBEDDINGS as u8 + 2)][..])
        );
    }
}
