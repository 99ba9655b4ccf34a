//! A vision encoder alone: an image through a projector file's encoder `rounds` times on
//! `threads` threads, each round's milliseconds (the first includes loading the weights into
//! memory), for tests/bench/vision-encode.
//!
//!     cargo run --release -p inferd-engine --example encode_image -- MMPROJ IMAGE [THREADS] [ROUNDS]

use inferd_engine::vision::{decode, ImageLimits, VisionEncoder};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        return Err("usage: encode_image MMPROJ IMAGE [THREADS] [ROUNDS]".into());
    }
    let threads = args.get(3).map_or(Ok(2), |t| t.parse())?;
    let rounds = args.get(4).map_or(Ok(3), |t| t.parse())?;
    let enc = VisionEncoder::load(std::path::Path::new(&args[1]))?;
    let img = decode(&std::fs::read(&args[2])?, ImageLimits::default())?;
    let pool = inferd_kernels::pool::ThreadPool::new(threads);
    let k = inferd_kernels::Kernels::detect();
    for r in 0..rounds {
        let t = Instant::now();
        let rows = enc.encode(&pool, &k, &img);
        println!(
            "round {r}: {} image tokens of {} in {:.1} ms",
            enc.image_tokens(&img),
            rows.len() / enc.image_tokens(&img),
            t.elapsed().as_secs_f64() * 1e3
        );
    }
    Ok(())
}
