//! The CPU backend's [`LayerOps`]: each operation of a layer over one forward pass's
//! activations (norms, products, RoPE, paged attention, the gates, Gated DeltaNet, the
//! experts), written once in [`super::super::layer`] for every backend and carried out here
//! with `inferd-kernels`.

use super::{activation_fn, resize, CpuBackend, Scratch};
use crate::backend::layer::{Act, GateFn, LayerOps};
use crate::backend::profile::{Laps, Phase};
use crate::backend::BackendError;
use crate::kv::KvGroups;
use crate::model::arch::{Activation, Architecture, Moe};
use crate::model::weights::{DeltaWeights, LayerWeights};
use crate::model::{LlamaConfig, Tensor};
use half::f16;
use inferd_kernels::attention::{attend_batch, PagedKv, QueryCtx};
use inferd_kernels::ops::rms_norm_each;
use inferd_kernels::ops::{rms_norm, Rope};
use inferd_kernels::pool::ThreadPool;
use inferd_kernels::Kernels;

/// One sequence's part of a pass.
pub(super) struct SeqSpan {
    /// Its first token's row in the pass, its token count, its first position.
    pub(super) t0: usize,
    pub(super) n: usize,
    pub(super) start: usize,
    /// Its recurrent state's slot, and where to copy the state to at which position.
    pub(super) state: Option<u32>,
    pub(super) checkpoint: Option<(usize, u32)>,
}

/// The CPU's [`LayerOps`] for one forward pass: the scratch buffers, the pass's positions and
/// what each token sees in each KV group, the cache.
pub(super) struct CpuOps<'a, 'p> {
    pub(super) pool: &'a ThreadPool,
    pub(super) k: &'a Kernels,
    pub(super) laps: &'a mut Laps<'p>,
    pub(super) cfg: &'a LlamaConfig,
    pub(super) arch: &'a Architecture,
    pub(super) s: &'a mut Scratch,
    pub(super) n: usize,
    pub(super) pos_of: &'a [usize],
    pub(super) ctxs: &'a [Vec<QueryCtx<'a>>],
    pub(super) ropes: &'a [Rope],
    pub(super) rope_of: &'a [usize],
    pub(super) groups: &'a KvGroups,
    pub(super) k_cache: &'a mut [Vec<f16>],
    pub(super) v_cache: &'a mut [Vec<f16>],
    pub(super) block_size: usize,
    /// Floats of a cache slot's block: `block_size` positions of the widest layer's K/V
    /// ([`Architecture::kv_width`]).
    pub(super) block_floats: usize,
    pub(super) seqs: &'a [SeqSpan],
    /// Per DeltaNet layer, every slot's recurrent state.
    pub(super) states: &'a mut [Vec<f32>],
}

impl CpuOps<'_, '_> {
    /// Buffer `a`, and the buffers `outs` taken out of the scratch to be written (put back
    /// with [`CpuOps::put`]).
    fn take(&mut self, outs: &[Act]) -> Vec<Vec<f32>> {
        outs.iter().map(|o| std::mem::take(&mut self.s.acts[o.index()])).collect()
    }

    fn put(&mut self, outs: &[Act], bufs: Vec<Vec<f32>>) {
        for (o, b) in outs.iter().zip(bufs) {
            self.s.acts[o.index()] = b;
        }
    }
}

impl LayerOps for CpuOps<'_, '_> {
    type Matrix = crate::model::Tensor;
    type Vector = Vec<f32>;

    fn norm(&mut self, from: Act, w: &Vec<f32>, to: Act) -> Result<(), BackendError> {
        let (eps, h) = (self.cfg.rms_eps, w.len());
        if from == to {
            self.pool.for_rows(&mut self.s.acts[to.index()], h, &|_, rows| rms_norm_each(rows, w, eps));
            return Ok(());
        }
        let mut bufs = self.take(&[to]);
        let x = &self.s.acts[from.index()];
        resize(&mut bufs[0], x.len());
        self.pool.for_rows(&mut bufs[0], h, &|first, ys| {
            for (x, y) in x[first * h..].chunks_exact(h).zip(ys.chunks_exact_mut(h)) {
                rms_norm(x, w, eps, y);
            }
        });
        self.put(&[to], bufs);
        Ok(())
    }

    fn project(&mut self, phase: Phase, from: Act, products: &[(&Tensor, Act)]) -> Result<(), BackendError> {
        let outs: Vec<Act> = products.iter().map(|p| p.1).collect();
        debug_assert!(!outs.contains(&from), "a product's output is its input");
        let mut bufs = self.take(&outs);
        let ws: Vec<&Tensor> = products.iter().map(|p| p.0).collect();
        let mut ys: Vec<&mut Vec<f32>> = bufs.iter_mut().collect();
        let x = &self.s.acts[from.index()];
        CpuBackend::project(self.pool, self.k, phase, self.laps, &ws, x, self.n, &mut self.s.q8, &mut ys);
        self.put(&outs, bufs);
        Ok(())
    }

    fn add_bias(&mut self, a: Act, b: &Vec<f32>) -> Result<(), BackendError> {
        self.pool
            .for_rows(&mut self.s.acts[a.index()], b.len(), &|_, rows| inferd_kernels::ops::add_bias_rows(rows, b));
        Ok(())
    }

    fn rope(&mut self, layer: usize, q: Act, k: Option<Act>) -> Result<(), BackendError> {
        let la = &self.arch.layers[layer];
        let (qd, kvd, hd) = (la.q_dim(self.cfg.n_heads), la.kv_dim(), la.head_dim);
        let (rope, angles) = (&self.ropes[self.rope_of[layer]], &self.s.angles[self.rope_of[layer]]);
        // Token t's rows of `x` (`width` each) rotated by its angles.
        let rotate = |width: usize| {
            move |first: usize, x: &mut [f32]| {
                let angles = angles.chunks_exact(rope.pairs()).skip(first);
                for (x, angles) in x.chunks_exact_mut(width).zip(angles) {
                    rope.apply_angles(x, hd, angles);
                }
            }
        };
        let n = self.n;
        self.pool.for_rows(&mut self.s.acts[q.index()][..n * qd], qd, &rotate(qd));
        if let Some(k) = k {
            self.pool.for_rows(&mut self.s.acts[k.index()][..n * kvd], kvd, &rotate(kvd));
        }
        Ok(())
    }

    fn attend(&mut self, layer: usize, qkv: [Act; 3], sinks: Option<&Vec<f32>>, to: Act) -> Result<(), BackendError> {
        let la = &self.arch.layers[layer];
        let (hd, nkv, bs, kvd) = (la.head_dim, la.kv_heads, self.block_size, la.kv_dim());
        let block_floats = self.block_floats;
        let kv_layer =
            self.arch.kv_layer(layer).ok_or_else(|| BackendError::Invalid(format!("layer {layer} keeps no K/V")))?;
        let (group, slot) = self.groups.layer_slot[kv_layer];
        let ctx = &self.ctxs[group];
        let (kc, vc) = (&mut self.k_cache[slot], &mut self.v_cache[slot]);
        let (k, v) = (&self.s.acts[qkv[1].index()], &self.s.acts[qkv[2].index()]);
        // A layer reading another's K/V writes none: its source wrote this pass's already.
        for (t, &p) in self.pos_of.iter().enumerate().filter(|_| la.kv_from.is_none()) {
            let blk = ctx[t].table[p / bs] as usize;
            for g in 0..nkv {
                let tile = blk * block_floats + PagedKv::tile(bs, nkv, hd, 0, g);
                let src = t * kvd + g * hd;
                PagedKv::store(kc, vc, (tile, bs, p % bs), &k[src..src + hd], &v[src..src + hd]);
            }
        }
        let kv = PagedKv { k: kc, v: vc, block_size: bs, n_kv_heads: nkv, head_dim: hd, block_floats };
        debug_assert_eq!(self.arch.layers[layer].window, self.groups.windows[group], "a layer's group has its window");
        let mut out = std::mem::take(&mut self.s.acts[to.index()]);
        resize(&mut out, self.n * la.q_dim(self.cfg.n_heads));
        self.laps.lap(Phase::Between, &[]);
        let q = &self.s.acts[qkv[0].index()];
        let scale = self.arch.attention_scale;
        attend_batch(self.pool, self.k, &kv, self.cfg.n_heads, scale, sinks.map(|s| &s[..]), q, ctx, &mut out);
        self.laps.lap(Phase::Attention, &[]);
        self.s.acts[to.index()] = out;
        Ok(())
    }

    fn gated(&mut self, act: Activation, gate: Act, up: Act) -> Result<(), BackendError> {
        let mut bufs = self.take(&[gate]);
        let (f, up) = (activation_fn(self.k, act), &self.s.acts[up.index()]);
        let width = bufs[0].len() / self.n.max(1);
        self.pool.for_rows(&mut bufs[0], width, &|first, g| f(g, &up[first * width..first * width + g.len()]));
        self.put(&[gate], bufs);
        Ok(())
    }

    fn add(&mut self, x: Act, y: Act) -> Result<(), BackendError> {
        let mut bufs = self.take(&[x]);
        let (y, width) = (&self.s.acts[y.index()], bufs[0].len() / self.n.max(1));
        self.pool.for_rows(&mut bufs[0], width, &|first, x| {
            x.iter_mut().zip(&y[first * width..]).for_each(|(x, y)| *x += y);
        });
        self.put(&[x], bufs);
        Ok(())
    }

    fn copy(&mut self, from: Act, to: Act) -> Result<(), BackendError> {
        let mut bufs = self.take(&[to]);
        bufs[0].clear();
        bufs[0].extend_from_slice(&self.s.acts[from.index()]);
        self.put(&[to], bufs);
        Ok(())
    }

    fn scale(&mut self, x: Act, s: &Vec<f32>) -> Result<(), BackendError> {
        let s = *s.first().ok_or_else(|| BackendError::Invalid("a scale without its value".into()))?;
        self.s.acts[x.index()].iter_mut().for_each(|v| *v *= s);
        Ok(())
    }

    fn per_layer_input(&mut self, layer: usize, to: Act) -> Result<(), BackendError> {
        let width = self.arch.per_layer.ok_or_else(|| BackendError::Invalid("no per-layer embeddings".into()))?;
        let row = self.arch.layers.len() * width;
        let mut bufs = self.take(&[to]);
        bufs[0].clear();
        for t in 0..self.n {
            let at = t * row + layer * width;
            bufs[0].extend_from_slice(&self.s.ple[at..at + width]);
        }
        self.put(&[to], bufs);
        Ok(())
    }

    fn split_heads(&mut self, from: Act, a: Act, b: Act) -> Result<(), BackendError> {
        let hd = self.cfg.head_dim;
        let mut bufs = self.take(&[a, b]);
        let x = &self.s.acts[from.index()];
        let half = x.len() / 2;
        let (pa, pb) = bufs.split_at_mut(1);
        let (pa, pb) = (&mut pa[0], &mut pb[0]);
        resize(pa, half);
        resize(pb, half);
        for ((pair, ya), yb) in x.chunks_exact(2 * hd).zip(pa.chunks_exact_mut(hd)).zip(pb.chunks_exact_mut(hd)) {
            ya.copy_from_slice(&pair[..hd]);
            yb.copy_from_slice(&pair[hd..]);
        }
        self.put(&[a, b], bufs);
        Ok(())
    }

    fn gate(&mut self, x: Act, g: Act, f: GateFn) -> Result<(), BackendError> {
        let mut bufs = self.take(&[x]);
        let gv = &self.s.acts[g.index()];
        let (xl, gl) = (bufs[0].len(), gv.len());
        if (xl, gl) != (0, 0) && (gl == 0 || xl < gl || !xl.is_multiple_of(gl)) {
            self.put(&[x], bufs);
            return Err(BackendError::Invalid(format!("{gl} gates for {xl} values")));
        }
        let sigmoid = |v: f32| 1.0 / (1.0 + (-v).exp());
        let m = |g: f32| match f {
            GateFn::Sigmoid => sigmoid(g),
            GateFn::Silu => g * sigmoid(g),
        };
        if xl == gl {
            bufs[0].iter_mut().zip(gv).for_each(|(x, &g)| *x *= m(g));
        } else {
            for (xs, &g) in bufs[0].chunks_exact_mut(xl / gl).zip(gv) {
                xs.iter_mut().for_each(|x| *x *= m(g));
            }
        }
        self.put(&[x], bufs);
        Ok(())
    }

    fn delta_net(
        &mut self,
        layer: usize,
        w: &DeltaWeights,
        [mix, beta, alpha]: [Act; 3],
        to: Act,
    ) -> Result<(), BackendError> {
        use inferd_kernels::deltanet::{conv, l2_norm_each, step, Inputs};
        let d = self.arch.delta.ok_or_else(|| BackendError::Invalid("a DeltaNet layer without its shape".into()))?;
        let di = self.arch.layers[..layer].iter().filter(|l| l.delta_net).count();
        let (ch, width, sh) = (d.channels(), d.conv, d.shape);
        let (kd, vd, heads) = (sh.k_heads * sh.dk, sh.v_heads * sh.dv, sh.v_heads);
        let (floats, conv_len) = (d.state_floats(), d.conv_rows() * ch);
        let eps = self.cfg.rms_eps;
        self.laps.lap(Phase::Between, &[]);
        let mut out = std::mem::take(&mut self.s.acts[to.index()]);
        resize(&mut out, self.n * vd);
        let [cv, q, k, v, g, wb] = &mut self.s.delta;
        let (xm, xb, xa) = (&self.s.acts[mix.index()], &self.s.acts[beta.index()], &self.s.acts[alpha.index()]);
        for sq in self.seqs {
            let slot = sq.state.ok_or_else(|| BackendError::Invalid("a sequence without a recurrent state".into()))?;
            let layer_states = &mut self.states[di];
            if sq.start == 0 {
                layer_states[slot as usize * floats..(slot as usize + 1) * floats].iter_mut().for_each(|x| *x = 0.0);
            }
            // In two parts where a checkpoint falls inside: the state after the first is
            // copied out (the parts compute what the whole would, bit for bit).
            let cut = sq.checkpoint.map_or(sq.n, |(at, _)| at - sq.start);
            for (a, b) in [(0, cut), (cut, sq.n)] {
                if a == cut {
                    if let Some((_, ck)) = sq.checkpoint {
                        let (src, dst) = (slot as usize * floats, ck as usize * floats);
                        layer_states.copy_within(src..src + floats, dst);
                    }
                }
                if a == b {
                    continue;
                }
                let st = &mut layer_states[slot as usize * floats..(slot as usize + 1) * floats];
                let (conv_state, ssm) = st.split_at_mut(conv_len);
                let (t0, n) = (sq.t0 + a, b - a);
                resize(cv, n * ch);
                conv(&w.conv, width, ch, conv_state, sq.start + a, &xm[t0 * ch..(t0 + n) * ch], cv);
                // SiLU, through the kernels' vector exp a token's row at a time (which of a
                // row's values take its scalar tail is then the same however many rows come).
                g.clear();
                g.extend(cv.iter().map(|x| -x));
                g.chunks_exact_mut(ch).for_each(|row| (self.k.exp)(row));
                cv.iter_mut().zip(g.iter()).for_each(|(x, e)| *x /= 1.0 + e);
                q.clear();
                k.clear();
                v.clear();
                for row in cv.chunks_exact(ch) {
                    q.extend_from_slice(&row[..kd]);
                    k.extend_from_slice(&row[kd..2 * kd]);
                    v.extend_from_slice(&row[2 * kd..]);
                }
                l2_norm_each(q, sh.dk, eps);
                l2_norm_each(k, sh.dk, eps);
                // g = softplus(alpha + dt_bias) * a (llama.cpp's softplus: linear past 20), and
                // the write strength sigmoid(beta).
                g.clear();
                wb.clear();
                for t in t0..t0 + n {
                    for h in 0..heads {
                        let x = xa[t * heads + h] + w.dt_bias[h];
                        let sp = if x > 20.0 { x } else { (1.0 + x.exp()).ln() };
                        g.push(sp * w.a[h]);
                        wb.push(1.0 / (1.0 + (-xb[t * heads + h]).exp()));
                    }
                }
                let x = Inputs { q, k, v, g, beta: wb };
                step(Some(self.pool), sh, ssm, sq.start + a, &x, &mut out[t0 * vd..(t0 + n) * vd]);
            }
        }
        self.s.acts[to.index()] = out;
        self.laps.lap(Phase::Recurrence, &[]);
        Ok(())
    }

    fn experts(
        &mut self,
        lw: &LayerWeights,
        router: &Tensor,
        moe: &Moe,
        act: Activation,
        from: Act,
        router_from: Act,
        to: Act,
    ) -> Result<(), BackendError> {
        use inferd_kernels::moe::{experts_ffn, route, ExpertFfn, Experts};
        let (n, h, e) = (self.n, self.cfg.hidden, moe.experts);
        let mut router_logits = std::mem::take(&mut self.s.router);
        let x = &self.s.acts[router_from.index()];
        let (pool, k) = (self.pool, self.k);
        CpuBackend::project(
            pool,
            k,
            Phase::FfnGateUp,
            self.laps,
            &[router],
            x,
            n,
            &mut self.s.q8,
            &mut [&mut router_logits],
        );
        if let Some(b) = &lw.router_bias {
            inferd_kernels::ops::add_bias_rows(&mut router_logits[..n * e], b);
        }
        let mut chosen: Vec<Vec<(u32, f32)>> =
            router_logits.chunks_exact(e).take(n).map(|logits| route(&moe.routing, logits, None)).collect();
        // An expert's own output scale is a factor on its weight.
        if let Some(b) = &lw.beside_dense {
            chosen.iter_mut().flatten().for_each(|(x, wt)| *wt *= b.expert_scale[*x as usize]);
        }
        self.s.router = router_logits;
        fn stack(t: &Tensor, e: usize) -> Experts<'_> {
            Experts { dtype: t.dtype, n: e, rows: t.rows / e, cols: t.cols, data: t.bytes(), layout: t.layout() }
        }
        let ffn = ExpertFfn {
            gate: stack(&lw.w_gate, e),
            up: stack(&lw.w_up, e),
            down: stack(&lw.w_down, e),
            act: activation_fn(k, act),
            biases: lw.expert_biases.as_ref().map(|[g, u, d]| [&g[..], &u[..], &d[..]]),
        };
        let mut bufs = self.take(&[to]);
        resize(&mut bufs[0], n * h);
        let x = &self.s.acts[from.index()];
        let ran = experts_ffn(pool, k, &ffn, &x[..n * h], &chosen, &mut bufs[0][..n * h], &mut self.s.moe);
        self.put(&[to], bufs);
        // The chosen experts' bytes: what the step read of the stacks.
        let per_expert = [&lw.w_gate, &lw.w_up, &lw.w_down].iter().map(|t| t.bytes().len() / e).sum::<usize>();
        self.laps.lap_bytes(Phase::FfnDown, (ran * per_expert) as u64);
        Ok(())
    }
}
