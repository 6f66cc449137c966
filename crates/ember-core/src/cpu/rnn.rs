//! CPU kernels of the pointwise halves of a fused LSTM time step (Note [Fused LSTM recurrence]
//! in `ops/rnn.rs`), with `kernels/rnn.cu`'s formulas: one pass over the `[N, H]` state, the
//! four gates of row `n` read at `j, H+j, 2H+j, 3H+j` (order i, f, g, o). Rows go to rayon when
//! a step touches at least [`PAR_THRESHOLD`] gate elements. f16/bf16 compute in f32 and round
//! once on store.

use super::reduce::FloatElem;
use super::{CpuStorage, PAR_THRESHOLD};
use crate::backend::step::{LstmBackwardStep, LstmForwardStep};
use crate::backend::{BackendStorage, RnnOps};
use crate::{Error, Result};
use num_traits::Float;
use rayon::prelude::*;

#[inline]
fn sigmoid<A: Float>(x: A) -> A {
    A::one() / (A::one() + Float::exp(-x))
}

/// Calls `f(row, x_row, y_row)` for every row of the two mutable outputs (chunks of `a` and
/// `b` elements), in parallel when `work` gate elements justify it.
fn for_rows<T: Send>(
    work: usize,
    (x, a): (&mut [T], usize),
    (y, b): (&mut [T], usize),
    f: impl Fn(usize, &mut [T], &mut [T]) + Sync + Send,
) {
    if work >= PAR_THRESHOLD {
        super::threads::parallel(|| {
            x.par_chunks_mut(a)
                .zip(y.par_chunks_mut(b))
                .enumerate()
                .for_each(|(r, (x, y))| f(r, x, y))
        });
    } else {
        for (r, (x, y)) in x.chunks_mut(a).zip(y.chunks_mut(b)).enumerate() {
            f(r, x, y);
        }
    }
}

/// [`for_rows`] with three outputs.
fn for_rows3<T: Send>(
    work: usize,
    (x, a): (&mut [T], usize),
    (y, b): (&mut [T], usize),
    (z, c): (&mut [T], usize),
    f: impl Fn(usize, &mut [T], &mut [T], &mut [T]) + Sync + Send,
) {
    if work >= PAR_THRESHOLD {
        super::threads::parallel(|| {
            x.par_chunks_mut(a)
                .zip(y.par_chunks_mut(b))
                .zip(z.par_chunks_mut(c))
                .enumerate()
                .for_each(|(r, ((x, y), z))| f(r, x, y, z))
        });
    } else {
        for (r, ((x, y), z)) in x
            .chunks_mut(a)
            .zip(y.chunks_mut(b))
            .zip(z.chunks_mut(c))
            .enumerate()
        {
            f(r, x, y, z);
        }
    }
}

fn forward<T: FloatElem>(s: &LstmForwardStep, gi: &[T], hh: &[T], h: &mut [T], c: &mut [T], gates: &mut [T])
where
    T::A: Float,
{
    let (hid, nh) = (s.hidden, s.n * s.hidden);
    let h4 = 4 * hid;
    let gi = &gi[s.gi..s.gi + s.n * h4];
    let hh = &hh[s.hh..s.hh + s.n * h4];
    // c_prev is an earlier row of the same buffer (checked by `LstmForwardStep::check`).
    let (lo, hi) = c.split_at_mut(s.c);
    let c_prev = &lo[s.c_prev..s.c_prev + nh];
    let c_out = &mut hi[..nh];
    let h_out = &mut h[s.h..s.h + nh];
    let g_out = &mut gates[s.gates..s.gates + s.n * h4];
    for_rows3(
        s.n * h4,
        (c_out, hid),
        (h_out, hid),
        (g_out, h4),
        |r, co, ho, go| {
            let (gi, hh, cp) = (
                &gi[r * h4..][..h4],
                &hh[r * h4..][..h4],
                &c_prev[r * hid..][..hid],
            );
            for j in 0..hid {
                let pre = |q: usize| gi[q * hid + j].to_acc() + hh[q * hid + j].to_acc();
                let (i, f, g, o) = (
                    sigmoid(pre(0)),
                    sigmoid(pre(1)),
                    Float::tanh(pre(2)),
                    sigmoid(pre(3)),
                );
                let cs = T::from_acc(f * cp[j].to_acc() + i * g);
                co[j] = cs;
                // h from the stored (rounded) c, as the CUDA kernel.
                ho[j] = T::from_acc(o * Float::tanh(cs.to_acc()));
                go[j] = T::from_acc(i);
                go[hid + j] = T::from_acc(f);
                go[2 * hid + j] = T::from_acc(g);
                go[3 * hid + j] = T::from_acc(o);
            }
        },
    );
    if let Some(off) = s.c_copy {
        let c_out = &c[s.c..s.c + nh];
        h[off..off + nh].copy_from_slice(c_out);
    }
}

#[allow(clippy::too_many_arguments)]
fn backward<T: FloatElem>(
    s: &LstmBackwardStep,
    dh_out: &[T],
    dh_rec: Option<&[T]>,
    gates: &[T],
    c: &[T],
    dc: &mut [T],
    dgates: &mut [T],
) where
    T::A: Float,
{
    let (hid, nh) = (s.hidden, s.n * s.hidden);
    let h4 = 4 * hid;
    let dh_out = &dh_out[s.dh_out..s.dh_out + nh];
    let dh_rec = s.dh_rec.zip(dh_rec).map(|(off, d)| &d[off..off + nh]);
    let gates = &gates[s.gates..s.gates + s.n * h4];
    let (c_t, c_prev) = (&c[s.c..s.c + nh], &c[s.c_prev..s.c_prev + nh]);
    let dc = &mut dc[s.dc..s.dc + nh];
    let dg = &mut dgates[s.dgates..s.dgates + s.n * h4];
    for_rows(s.n * h4, (dc, hid), (dg, h4), |r, dc, dg| {
        let (g, ct) = (&gates[r * h4..][..h4], &c_t[r * hid..][..hid]);
        let (cp, dho) = (&c_prev[r * hid..][..hid], &dh_out[r * hid..][..hid]);
        let one = <T::A as num_traits::One>::one();
        for j in 0..hid {
            let (i, f, gg, o) = (
                g[j].to_acc(),
                g[hid + j].to_acc(),
                g[2 * hid + j].to_acc(),
                g[3 * hid + j].to_acc(),
            );
            let mut dh = dho[j].to_acc();
            if let Some(rec) = dh_rec {
                dh = dh + rec[r * hid + j].to_acc();
            }
            let tc = Float::tanh(ct[j].to_acc());
            let dct = dc[j].to_acc() + dh * o * (one - tc * tc);
            dg[j] = T::from_acc(dct * gg * i * (one - i));
            dg[hid + j] = T::from_acc(dct * cp[j].to_acc() * f * (one - f));
            dg[2 * hid + j] = T::from_acc(dct * i * (one - gg * gg));
            dg[3 * hid + j] = T::from_acc(dh * tc * o * (one - o));
            dc[j] = T::from_acc(dct * f);
        }
    });
}

fn mismatch(op: &'static str, a: &CpuStorage, b: &CpuStorage) -> Error {
    Error::DTypeMismatch {
        op,
        expected: a.dtype(),
        found: b.dtype(),
    }
}

impl RnnOps for CpuStorage {
    /// One forward step (see [`LstmForwardStep`]): reads `gi`, `hh` and `c`'s previous row,
    /// writes `h`'s and `c`'s step rows (and the copy of `c`) and the activated `gates`.
    fn lstm_forward_step(
        s: &LstmForwardStep,
        gi: &CpuStorage,
        hh: &CpuStorage,
        h: &mut CpuStorage,
        c: &mut CpuStorage,
        gates: &mut CpuStorage,
    ) -> Result<()> {
        const OP: &str = "lstm_recurrence";
        if s.n * s.hidden == 0 {
            return Ok(());
        }
        use CpuStorage as S;
        match (gi, hh, h, c, gates) {
            (S::F32(a), S::F32(b), S::F32(h), S::F32(c), S::F32(g)) => forward(s, a, b, h, c, g),
            (S::F64(a), S::F64(b), S::F64(h), S::F64(c), S::F64(g)) => forward(s, a, b, h, c, g),
            (S::F16(a), S::F16(b), S::F16(h), S::F16(c), S::F16(g)) => forward(s, a, b, h, c, g),
            (S::BF16(a), S::BF16(b), S::BF16(h), S::BF16(c), S::BF16(g)) => forward(s, a, b, h, c, g),
            (gi, hh, ..) if !gi.dtype().is_floating_point() || gi.dtype() != hh.dtype() => {
                return Err(mismatch(OP, gi, hh))
            }
            (gi, ..) => return Err(Error::dtype(OP, gi.dtype())),
        }
        Ok(())
    }

    /// One backward step (see [`LstmBackwardStep`]): reads the output gradient rows, the
    /// recurrent gradient (if any), the saved gates and `c` rows; updates `dc` in place and
    /// writes the step's pre-activation gate gradients into `dgates`.
    fn lstm_backward_step(
        s: &LstmBackwardStep,
        dh_out: &CpuStorage,
        dh_rec: Option<&CpuStorage>,
        gates: &CpuStorage,
        c: &CpuStorage,
        dc: &mut CpuStorage,
        dgates: &mut CpuStorage,
    ) -> Result<()> {
        const OP: &str = "lstm_recurrence_backward";
        if s.n * s.hidden == 0 {
            return Ok(());
        }
        macro_rules! run {
            ($v:ident, $d:ident) => {{
                let rec = match dh_rec {
                    None => None,
                    Some(CpuStorage::$v(r)) => Some(&r[..]),
                    Some(other) => return Err(mismatch(OP, dh_out, other)),
                };
                match (gates, c, dc, dgates) {
                    (CpuStorage::$v(g), CpuStorage::$v(c), CpuStorage::$v(dc), CpuStorage::$v(dg)) => {
                        backward(s, $d, rec, g, c, dc, dg);
                        Ok(())
                    }
                    (g, ..) => Err(mismatch(OP, dh_out, g)),
                }
            }};
        }
        match dh_out {
            CpuStorage::F32(d) => run!(F32, d),
            CpuStorage::F64(d) => run!(F64, d),
            CpuStorage::F16(d) => run!(F16, d),
            CpuStorage::BF16(d) => run!(BF16, d),
            other => Err(Error::dtype(OP, other.dtype())),
        }
    }
}
