//! Image files into pixels: PNG, JPEG, WebP and GIF (its first frame) by the `image` crate,
//! within limits on bytes and pixels checked before anything is decoded, turned upright by
//! their EXIF orientation, alpha dropped.

use super::preprocess::RgbImage;
use image::{DynamicImage, ImageDecoder, ImageFormat, ImageReader, Limits};
use std::io::Cursor;

/// The most an image may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageLimits {
    /// Bytes of the encoded file.
    pub max_bytes: usize,
    /// Width times height.
    pub max_pixels: usize,
}

impl Default for ImageLimits {
    /// 20 MiB files, 50 megapixels (a phone camera's photos, a 5K screenshot).
    fn default() -> Self {
        ImageLimits { max_bytes: 20 << 20, max_pixels: 50_000_000 }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ImageError {
    #[error("the image is {0} bytes, over the limit of {1}")]
    TooManyBytes(usize, usize),
    #[error("the image is {0}x{1} pixels, over the limit of {2} pixels")]
    TooManyPixels(u32, u32, usize),
    #[error("not an image in a supported format (PNG, JPEG, WebP, GIF)")]
    UnknownFormat,
    #[error("the image cannot be decoded: {0}")]
    Undecodable(String),
}

/// Decodes `bytes` to upright RGB pixels.
pub fn decode(bytes: &[u8], limits: ImageLimits) -> Result<RgbImage, ImageError> {
    if bytes.len() > limits.max_bytes {
        return Err(ImageError::TooManyBytes(bytes.len(), limits.max_bytes));
    }
    let bad = |e: image::ImageError| ImageError::Undecodable(e.to_string());
    let mut reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| ImageError::Undecodable(e.to_string()))?;
    match reader.format() {
        Some(ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif) => {}
        _ => return Err(ImageError::UnknownFormat),
    }
    let mut lim = Limits::default();
    lim.max_alloc = Some((limits.max_pixels as u64).saturating_mul(8));
    reader.limits(lim);
    let mut decoder = reader.into_decoder().map_err(bad)?;
    let (w, h) = decoder.dimensions();
    if w == 0 || h == 0 || (w as u64) * (h as u64) > limits.max_pixels as u64 {
        return Err(ImageError::TooManyPixels(w, h, limits.max_pixels));
    }
    let orientation = decoder.orientation().map_err(bad)?;
    let mut img = DynamicImage::from_decoder(decoder).map_err(bad)?;
    img.apply_orientation(orientation);
    let rgb = img.into_rgb8();
    Ok(RgbImage { width: rgb.width() as usize, height: rgb.height() as usize, pixels: rgb.into_raw() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{ImageEncoder, RgbImage as Buf};

    /// A 3 x 2 image whose pixels all differ.
    fn sample() -> Buf {
        Buf::from_fn(3, 2, |x, y| image::Rgb([(x * 80) as u8, (y * 200) as u8, (x * 30 + y * 100) as u8]))
    }

    fn encoded(img: &DynamicImage, format: ImageFormat) -> Vec<u8> {
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, format).unwrap();
        out.into_inner()
    }

    #[test]
    fn each_format_decodes_to_its_pixels() {
        let img = DynamicImage::ImageRgb8(sample());
        for format in [ImageFormat::Png, ImageFormat::WebP, ImageFormat::Gif, ImageFormat::Jpeg] {
            let got = decode(&encoded(&img, format), ImageLimits::default()).unwrap();
            assert_eq!((got.width, got.height), (3, 2), "{format:?}");
            // Lossless formats give the pixels back; JPEG and GIF's palette come close.
            let worst = got.pixels.iter().zip(sample().as_raw()).map(|(a, b)| a.abs_diff(*b)).max().unwrap();
            let tol = if matches!(format, ImageFormat::Png | ImageFormat::WebP) { 0 } else { 60 };
            assert!(worst <= tol, "{format:?}: {worst}");
        }
        // Alpha is dropped.
        let rgba = DynamicImage::ImageRgba8(image::RgbaImage::from_pixel(2, 2, image::Rgba([9, 8, 7, 0])));
        assert_eq!(
            decode(&encoded(&rgba, ImageFormat::Png), ImageLimits::default()).unwrap().pixels,
            [9, 8, 7].repeat(4)
        );
    }

    #[test]
    fn a_jpegs_exif_orientation_turns_it_upright() {
        // A TIFF header (little-endian) with one IFD entry: orientation 6, "rotate 90° clockwise".
        let exif = [
            b"II*\0".as_slice(),
            &8u32.to_le_bytes(),
            &1u16.to_le_bytes(),
            &[0x12, 0x01, 3, 0],
            &1u32.to_le_bytes(),
            &[6, 0, 0, 0],
            &0u32.to_le_bytes(),
        ]
        .concat();
        let mut out = Vec::new();
        let mut enc = image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 100);
        enc.set_exif_metadata(exif).unwrap();
        enc.write_image(sample().as_raw(), 3, 2, image::ExtendedColorType::Rgb8).unwrap();
        let got = decode(&out, ImageLimits::default()).unwrap();
        assert_eq!((got.width, got.height), (2, 3));
        // Rotated clockwise: the top row is the original's first column, bottom to top.
        let px = |img: &RgbImage, x: usize, y: usize| img.pixels[(y * img.width + x) * 3 + 1];
        assert!(px(&got, 0, 0) > 150 && px(&got, 1, 0) < 50, "{:?}", got.pixels);
    }

    #[test]
    fn what_is_not_an_image_or_too_large_is_refused_by_name() {
        let png = encoded(&DynamicImage::ImageRgb8(sample()), ImageFormat::Png);
        let small = ImageLimits { max_bytes: 1 << 20, max_pixels: 5 };
        assert_eq!(decode(&png, small), Err(ImageError::TooManyPixels(3, 2, 5)));
        assert_eq!(
            decode(&png, ImageLimits { max_bytes: 10, max_pixels: 100 }),
            Err(ImageError::TooManyBytes(png.len(), 10))
        );
        assert_eq!(decode(b"hello, not an image", ImageLimits::default()), Err(ImageError::UnknownFormat));
        assert_eq!(decode(b"BM\x3a\0\0\0\0\0\0\0\x36\0\0\0", ImageLimits::default()), Err(ImageError::UnknownFormat));
        assert!(matches!(decode(&png[..png.len() / 2], ImageLimits::default()), Err(ImageError::Undecodable(_))));
        assert_eq!(decode(&[], ImageLimits::default()), Err(ImageError::UnknownFormat));
    }
}
