//! An image as a vision encoder takes it: decoded RGB pixels resized to the encoder's input
//! (a fixed square, or a size of the image's own aspect; aspect kept, letterboxed in black),
//! then normalized per channel into planes of floats.
//!
//! The resampling is Pillow's (a separable filter per axis, widened by the scale when
//! shrinking, fixed-point weights of 22 bits, 8-bit pixels between the passes), as the
//! reference implementations' preprocessors use it, so that the same file gives the same
//! pixels here as there; an image already of the input's size is taken as it is.

/// Decoded pixels: `width * height` RGB triples, row by row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RgbImage {
    pub width: usize,
    pub height: usize,
    pub pixels: Vec<u8>,
}

/// The resampling filters of the preprocessors (Pillow's: bicubic with `a = -0.5`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Filter {
    Bilinear,
    Bicubic,
}

impl Filter {
    fn support(self) -> f64 {
        match self {
            Filter::Bilinear => 1.0,
            Filter::Bicubic => 2.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        let x = x.abs();
        match self {
            Filter::Bilinear if x < 1.0 => 1.0 - x,
            Filter::Bicubic if x < 1.0 => (1.5 * x - 2.5) * x * x + 1.0,
            Filter::Bicubic if x < 2.0 => (((x - 5.0) * x + 8.0) * x - 4.0) * -0.5,
            _ => 0.0,
        }
    }
}

/// Bits of a fixed-point filter weight: 32 less a pixel's 8 and 2 of headroom.
const PRECISION: u32 = 22;

/// One axis's filter: for each output pixel the first input pixel it reads and its weights.
struct Taps {
    first: Vec<usize>,
    weights: Vec<Vec<i32>>,
}

impl Taps {
    fn new(filter: Filter, input: usize, output: usize) -> Taps {
        let scale = input as f64 / output as f64;
        let filterscale = scale.max(1.0);
        let support = filter.support() * filterscale;
        let (mut first, mut weights) = (Vec::with_capacity(output), Vec::with_capacity(output));
        for o in 0..output {
            let center = (o as f64 + 0.5) * scale;
            // Truncation toward zero, as the reference's integer conversion.
            let lo = ((center - support + 0.5) as i64).max(0) as usize;
            let hi = ((center + support + 0.5) as i64).min(input as i64).max(lo as i64) as usize;
            let w: Vec<f64> = (lo..hi).map(|i| filter.weight((i as f64 - center + 0.5) / filterscale)).collect();
            let sum: f64 = w.iter().sum();
            let unit = f64::from(1u32 << PRECISION);
            let fixed = w
                .iter()
                .map(|&w| {
                    let w = if sum != 0.0 { w / sum } else { w };
                    (w * unit + if w < 0.0 { -0.5 } else { 0.5 }) as i32
                })
                .collect();
            first.push(lo);
            weights.push(fixed);
        }
        Taps { first, weights }
    }

    /// Output pixel `o`'s value from the input samples `at(i)`.
    fn apply(&self, o: usize, at: impl Fn(usize) -> u8) -> u8 {
        let mut acc: i64 = 1 << (PRECISION - 1);
        for (j, &w) in self.weights[o].iter().enumerate() {
            acc += i64::from(at(self.first[o] + j)) * i64::from(w);
        }
        (acc >> PRECISION).clamp(0, 255) as u8
    }
}

impl RgbImage {
    /// This image resampled to `width x height` (aspect not kept): horizontally, then
    /// vertically, each pass only where its size changes.
    pub fn resized(&self, width: usize, height: usize, filter: Filter) -> RgbImage {
        let mut img = self.clone();
        if width != img.width {
            let taps = Taps::new(filter, img.width, width);
            let mut out = vec![0; width * img.height * 3];
            for y in 0..img.height {
                let row = &img.pixels[y * img.width * 3..][..img.width * 3];
                for x in 0..width {
                    for c in 0..3 {
                        out[(y * width + x) * 3 + c] = taps.apply(x, |i| row[i * 3 + c]);
                    }
                }
            }
            img = RgbImage { width, height: img.height, pixels: out };
        }
        if height != img.height {
            let taps = Taps::new(filter, img.height, height);
            let w3 = img.width * 3;
            let mut out = vec![0; w3 * height];
            for y in 0..height {
                for i in 0..w3 {
                    out[y * w3 + i] = taps.apply(y, |r| img.pixels[r * w3 + i]);
                }
            }
            img = RgbImage { width: img.width, height, pixels: out };
        }
        img
    }

    /// This image in a `side x side` square: scaled to fit (the longer side to `side`, the
    /// other rounded up), centred on black. An image of that size already is returned as it is.
    pub fn letterboxed(&self, side: usize, filter: Filter) -> RgbImage {
        self.fitted(side, side, filter)
    }

    /// This image in a `width x height` frame: scaled to fit (aspect kept, the scaled sides
    /// rounded up), centred on black. An image of that size already is returned as it is.
    pub fn fitted(&self, width: usize, height: usize, filter: Filter) -> RgbImage {
        if self.width == width && self.height == height {
            return self.clone();
        }
        let scale = (width as f32 / self.width as f32).min(height as f32 / self.height as f32);
        let fit = |n: usize, side: usize| ((n as f32 * scale).ceil() as usize).clamp(1, side);
        let (w, h) = (fit(self.width, width), fit(self.height, height));
        let inner = self.resized(w, h, filter);
        let (x0, y0) = ((width - w) / 2, (height - h) / 2);
        let mut out = vec![0; width * height * 3];
        for y in 0..h {
            out[((y0 + y) * width + x0) * 3..][..w * 3].copy_from_slice(&inner.pixels[y * w * 3..][..w * 3]);
        }
        RgbImage { width, height, pixels: out }
    }

    /// The pixels as three planes (R, G, B) of `(v / 255 - mean[c]) / std[c]`.
    pub fn planes(&self, mean: [f32; 3], std: [f32; 3]) -> Vec<f32> {
        let n = self.width * self.height;
        let mut out = vec![0.0; 3 * n];
        for (i, px) in self.pixels.chunks_exact(3).enumerate() {
            for c in 0..3 {
                out[c * n + i] = (f32::from(px[c]) / 255.0 - mean[c]) / std[c];
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(width: usize, height: usize) -> RgbImage {
        let pixels = (0..width * height * 3).map(|i| ((i * 37 + i / 7) % 256) as u8).collect();
        RgbImage { width, height, pixels }
    }

    #[test]
    fn each_output_pixels_weights_sum_to_one_in_fixed_point() {
        for filter in [Filter::Bilinear, Filter::Bicubic] {
            for (input, output) in [(300, 224), (170, 224), (7, 3), (3, 7), (896, 896 - 1)] {
                let taps = Taps::new(filter, input, output);
                for (o, w) in taps.weights.iter().enumerate() {
                    let sum: i64 = w.iter().map(|&w| i64::from(w)).sum();
                    assert!(
                        (sum - (1 << PRECISION)).abs() <= w.len() as i64,
                        "{filter:?} {input}->{output} #{o}: {sum}"
                    );
                    assert!(taps.first[o] + w.len() <= input);
                }
            }
        }
    }

    #[test]
    fn a_flat_image_stays_flat_and_an_image_of_the_size_is_unchanged() {
        let flat = RgbImage { width: 37, height: 23, pixels: [200, 10, 90].repeat(37 * 23) };
        for filter in [Filter::Bilinear, Filter::Bicubic] {
            let r = flat.resized(64, 11, filter);
            assert_eq!(r.pixels, [200, 10, 90].repeat(64 * 11), "{filter:?}");
        }
        let img = pattern(16, 16);
        assert_eq!(img.resized(16, 16, Filter::Bilinear), img);
        assert_eq!(img.letterboxed(16, Filter::Bilinear), img);
    }

    #[test]
    fn shrinking_widens_the_triangle_by_the_scale() {
        // Halving, the triangle reaches two input pixels out: output 0 (centre 1.0) weighs
        // inputs 0, 1, 2 by 0.75, 0.75, 0.25 (normalized by 1.75), output 1 (centre 3.0)
        // inputs 1, 2, 3 by 0.25, 0.75, 0.75.
        let img = RgbImage { width: 4, height: 1, pixels: vec![0, 0, 0, 100, 100, 100, 200, 200, 200, 50, 50, 50] };
        let r = img.resized(2, 1, Filter::Bilinear);
        let (a, b) = ((75.0f64 + 50.0) / 1.75, (25.0f64 + 150.0 + 37.5) / 1.75);
        assert_eq!(r.pixels, [[a.round() as u8; 3], [b.round() as u8; 3]].concat());
    }

    #[test]
    fn a_wide_image_is_scaled_to_fit_and_centred_on_black() {
        let img = RgbImage { width: 300, height: 150, pixels: vec![255; 300 * 150 * 3] };
        let r = img.letterboxed(224, Filter::Bilinear);
        assert_eq!((r.width, r.height), (224, 224));
        let at = |x: usize, y: usize| r.pixels[(y * 224 + x) * 3];
        // 300 x 150 scaled by 224/300 is 224 x 112, placed 56 rows down.
        assert_eq!((at(0, 55), at(0, 56), at(223, 167), at(100, 168)), (0, 255, 255, 0));
    }

    #[test]
    fn planes_normalize_each_channel() {
        let img = RgbImage { width: 2, height: 1, pixels: vec![0, 255, 51, 255, 0, 102] };
        let p = img.planes([0.5, 0.5, 0.5], [0.5, 0.25, 0.5]);
        let want = [-1.0, 1.0, 2.0, -2.0, 0.2 / 0.5 - 1.0, 0.4 / 0.5 - 1.0];
        for (a, b) in p.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{p:?}");
        }
    }
}
