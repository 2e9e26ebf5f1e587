// The forward row kernel of the C++ CPU backend (inline templates, included by every translation unit
// that streams a row): one pass over a row of logits (and optionally reference logits) gives the
// statistics of kltriton/kernels/statistics.py: log p(label), logsumexp(x / T), the entropy, the
// reference log-prob / logsumexp, the full KL(p || q) and the forward KL(q || p).
//
// Numerics (as the Triton kernel): exponents are in units of kZUnit nats (base 2 on AVX512, where
// 2^z costs one multiply less than e^z; natural elsewhere), c = 1 / (T kZUnit). The running max m
// is the row's, in raw logit units, and z = (x - m) * c <= 0: the max itself has z = 0 and
// e = 1 exactly, x - m is exact for the values that matter (Sterbenz) and may overflow only to
// -inf (e = 0), and the rounding of c (relative 6e-8) scales every z alike. The vocabulary is
// streamed in L1-sized blocks: the block max is taken first (across the SIMD lanes, so every lane holds the
// row's frame, as the Triton kernel's), the lane state (s = sum e^z, t = sum e^z z, u = sum e^zx (hx - hy),
// v = sum e^zy (hy - hx), e^z meaning exp(z kZUnit)) is rescaled once per block, then the block's exponentials
// are accumulated from L1. Each row is read from memory once. The SIMD lanes are summed in double at the end of
// the row: with one frame, no lane needs an exponential there (on a short row those were most of its cost).
//
// The KL sums u and v are kept in the units of h = (x - m) kH with kH = 2^-33, not in z units: a finfo.min
// logit under the other side's mass has a z beyond fp32 (times c = log2(e) / T) while its term, and the row's
// KL (the sum over s, about 4.8e36), may well be fp32 numbers. In units of h a term never overflows (h = x kH -
// m kH, exactly rounded) and a lane's sum of up to V of them stays in fp32 (terms below 2^-93 vanish, far
// below the KL's fp32 rounding); the factor c / kH is applied in double at the end. The block loop itself sums
// the terms in z units, as cheaply as before (the FMA pipes bound it), and converts the block's sum by kH / c;
// only a block whose z-unit sum is not finite (such a logit, or a -inf one under mass: a true +inf) is summed
// again in units of h.
#pragma once

#include "common.h"


namespace kltriton_cpp {

constexpr int64_t kBlockVecs = 64;  // vectors per block (4 KiB of fp32 on AVX512 per tensor)
constexpr float kH = 0x1p-33f;        // the scale of h (see above)

// The statistics (kltriton/kernels/constants.py STATISTICS): their index in RowOut and in an op's outputs.
enum Stat : int {
  kStatLogp = KLTRITON_STAT_LOGP,
  kStatLse = KLTRITON_STAT_LSE,
  kStatEntropy = KLTRITON_STAT_ENTROPY,
  kStatRefLogp = KLTRITON_STAT_REF_LOGP,
  kStatRefLse = KLTRITON_STAT_REF_LSE,
  kStatFullKl = KLTRITON_STAT_FULL_KL,
  kStatForwardKl = KLTRITON_STAT_FORWARD_KL,
  kStatIsTop1 = KLTRITON_STAT_IS_TOP1,
  kStatSumLogits = KLTRITON_STAT_SUM_LOGITS,
  kStatLogSumSqProbs = KLTRITON_STAT_LOG_SUM_SQ_PROBS,
  kStatMaxLogit = KLTRITON_STAT_MAX_LOGIT,
};
constexpr int kNumStats = KLTRITON_NUM_STATS;

// A forward kernel variant is one template parameter MODE: a bitmask of the statistics' request bits.
enum ModeBit : int {
  kEntropy = KLTRITON_STAT_ENTROPY_REQUEST,
  kRef = KLTRITON_STAT_REF_LOGP_REQUEST,
  kFullKl = KLTRITON_STAT_FULL_KL_REQUEST,
  kForwardKl = KLTRITON_STAT_FORWARD_KL_REQUEST,
  kHead = KLTRITON_STAT_IS_TOP1_REQUEST,  // is_top1, sum_logits, log_sum_sq_probs, max_logit (policy rows only)
};
// The forward variants, by whether they read a reference row: every request with the reference bits (any subset
// of the others but the head's), and every request without them.
template <int M>
struct WithReference : std::bool_constant<(M & kRef) != 0 && (M & kHead) == 0> {};
template <int M>
struct WithoutReference : std::bool_constant<(M & KLTRITON_NEEDS_REF) == 0> {};
constexpr int kRequestLimit = KLTRITON_REQUEST_LIMIT;

// Whether a forward with request bits `wanted` computes statistic `stat`.
inline bool stat_present(int stat, int64_t wanted) {
  int bit = 0;
  switch (stat) {
    case kStatLogp: bit = KLTRITON_STAT_LOGP_REQUEST; break;
    case kStatLse: bit = KLTRITON_STAT_LSE_REQUEST; break;
    case kStatEntropy: bit = KLTRITON_STAT_ENTROPY_REQUEST; break;
    case kStatRefLogp: bit = KLTRITON_STAT_REF_LOGP_REQUEST; break;
    case kStatRefLse: bit = KLTRITON_STAT_REF_LSE_REQUEST; break;
    case kStatFullKl: bit = KLTRITON_STAT_FULL_KL_REQUEST; break;
    case kStatForwardKl: bit = KLTRITON_STAT_FORWARD_KL_REQUEST; break;
    case kStatIsTop1: bit = KLTRITON_STAT_IS_TOP1_REQUEST; break;
    case kStatSumLogits: bit = KLTRITON_STAT_SUM_LOGITS_REQUEST; break;
    case kStatLogSumSqProbs: bit = KLTRITON_STAT_LOG_SUM_SQ_PROBS_REQUEST; break;
    case kStatMaxLogit: bit = KLTRITON_STAT_MAX_LOGIT_REQUEST; break;
    default: break;
  }
  return bit == 0 || (wanted & bit) != 0;
}

// A row's statistics, indexed by Stat.
struct RowOut {
  float v[kNumStats];
};

// The statistics of a row that is never read: kSkip gives 0, kOutOfRange (and any label >= V) NaN; the
// log-sum-exps 0.
inline RowOut skipped_row(int64_t target) {
  const float v = target == kSkip ? 0.f : kNaN;
  RowOut r;
  for (int i = 0; i < kNumStats; ++i) r.v[i] = v;
  r.v[kStatLse] = 0.f;
  r.v[kStatRefLse] = 0.f;
  return r;
}

// (a - b) kH for frames a >= b, exactly rounded and never overflowing (a - b may: finfo.max - finfo.min).
inline Vec scaled_difference(const Vec& a, const Vec& b) {
  return at::vec::fmadd(a, Vec(kH), b * Vec(-kH));
}

inline bool all_finite(const Vec& v) {
  alignas(64) float a[kW];
  v.store(a);
  for (int64_t l = 0; l < kW; ++l) {
    if (!std::isfinite(a[l])) return false;
  }
  return true;
}

template <int MODE>
struct LaneState {
  static constexpr bool ENT = MODE & kEntropy, REF = MODE & kRef, KL = MODE & kFullKl, FKL = MODE & kForwardKl;
  static constexpr bool HEAD = MODE & kHead;
  Vec mx, mix, sx, tx, my, miy, sy, u, v;
  Vec xsum, qsum;  // HEAD: sum x kH (the logits' sum, scaled as h: it never overflows), sum e^2z
  Vec vinv;  // c

  explicit LaneState(float inv)
      : mx(-kInf), mix(0.f), sx(0.f), tx(0.f), my(-kInf), miy(0.f), sy(0.f), u(0.f), v(0.f), xsum(0.f), qsum(0.f),
        vinv(inv) {}

  // nv vectors given by the loaders ldx(i) / ldy(i) (floats; padding lanes are -inf). keep(i, e) receives the
  // policy's exponentials of vector i (relative to the block's frame mix), for a caller that reuses them.
  // PADDED: the block has padding lanes, which the logits' sum (HEAD) leaves to the caller.
  template <bool PADDED = false, typename LX, typename LY, typename KEEP>
  inline void block(int64_t nv, const LX& ldx, const LY& ldy, const KEEP& keep) {
    const Vec ninf(-kInf), zero(0.f);
    Vec bx = ninf, by = ninf;
    for (int64_t i = 0; i < nv; ++i) {
      bx = vmax(bx, ldx(i));
      if constexpr (REF) by = vmax(by, ldy(i));
    }
    bx = hmax(bx);
    if constexpr (REF) by = hmax(by);
    // Rescale the lane sums to the new frame. A lane that was empty (max -inf) has zero sums
    // and gets a factor 0 (avoids exp(+big) * 0). A factor that underflows to 0 (the max grew
    // by > ~100, e.g. from finfo.min to finfo.max, where dx itself overflows to +inf) makes
    // the old sums vanish: t and u are then set to 0 by a blend, never 0 * inf. Once per block.
    const Vec mxn = vmax(mx, bx);
    const Vec mixn = Vec::blendv(mxn, zero, mxn == ninf);  // the lane's frame: its max, 0 while empty
    const Vec vinvh = vinv * Vec(1.f / kH);                 // c / kH: z = h * c / kH, exactly
    const Vec dxh = scaled_difference(mixn, mix);           // the frame's move, in the units of h
    const Vec dx = dxh * vinvh;
    const Vec ax = Vec::blendv(vexpz(zero - dx), zero, mx == ninf);
    const Vec ax_zero = ax == zero;
    Vec dyh = zero;
    if constexpr (REF) {
      const Vec myn = vmax(my, by);
      const Vec miyn = Vec::blendv(myn, zero, myn == ninf);
      dyh = scaled_difference(miyn, miy);
      const Vec ay = Vec::blendv(vexpz(zero - dyh * vinvh), zero, my == ninf);
      // The forward KL's sum mirrors u with the reference's frame (before sy moves).
      if constexpr (FKL) v = Vec::blendv(ay * (v - (dyh - dxh) * sy), zero, ay == zero);
      sy = ay * sy;
      my = myn;
      miy = miyn;
    }
    if constexpr (KL) u = Vec::blendv(ax * (u - (dxh - dyh) * sx), zero, ax_zero);
    if constexpr (ENT) tx = Vec::blendv(ax * (tx - dx * sx), zero, ax_zero);
    if constexpr (HEAD) qsum = (ax * ax) * qsum;  // e^2z moves by the square of e^z's factor
    sx = ax * sx;
    mx = mxn;
    mix = mixn;

    // Block sums relative to the new frame, two accumulators each (independent add chains).
    const Vec lowest(kLowest);
    Vec bs[2] = {zero, zero}, bt[2] = {zero, zero}, bsy[2] = {zero, zero}, bu[2] = {zero, zero};
    Vec bv[2] = {zero, zero}, bz[2] = {zero, zero}, bq[2] = {zero, zero};
    const Vec vkh(kH);
    auto step = [&](int64_t i, int j) {
      const Vec xi = ldx(i);
      const Vec zx = (xi - mix) * vinv;
      const Vec ex = vexpz(zx);
      keep(i, ex);
      bs[j] = bs[j] + ex;
      if constexpr (HEAD) {
        if constexpr (!PADDED) bz[j] = at::vec::fmadd(xi, vkh, bz[j]);
        bq[j] = at::vec::fmadd(ex, ex, bq[j]);
      }
      // x = -inf gives z = -inf and e = 0: clamp z so that e * z is 0, not NaN.
      if constexpr (ENT) bt[j] = at::vec::fmadd(ex, at::vec::clamp_min(zx, lowest), bt[j]);
      if constexpr (REF) {
        const Vec zy = (ldy(i) - miy) * vinv;
        const Vec ey = vexpz(zy);
        bsy[j] = bsy[j] + ey;
        // In z units (kl_block converts): y = -inf where p > 0 gives +inf (correct); where p == 0 the term is 0.
        if constexpr (KL) bu[j] = add_where_pos(bu[j], ex, ex * (zx - zy));
        // The same for the forward KL, the roles swapped (x = -inf where q > 0 gives +inf).
        if constexpr (FKL) bv[j] = add_where_pos(bv[j], ey, ey * (zy - zx));
      }
    };
    int64_t i = 0;
    for (; i + 2 <= nv; i += 2) {
      step(i, 0);
      step(i + 1, 1);
    }
    if (i < nv) step(i, 0);
    sx = sx + (bs[0] + bs[1]);
    if constexpr (ENT) tx = tx + (bt[0] + bt[1]);
    if constexpr (HEAD) {
      xsum = xsum + (bz[0] + bz[1]);
      qsum = qsum + (bq[0] + bq[1]);
    }
    if constexpr (REF) sy = sy + (bsy[0] + bsy[1]);
    if constexpr (KL) u = u + kl_block<false>(bu[0] + bu[1], nv, ldx, ldy, vinvh);
    if constexpr (FKL) v = v + kl_block<true>(bv[0] + bv[1], nv, ldx, ldy, vinvh);
  }

  // A block's KL sum in the units of h from its sum in z units (FORWARD: the forward KL's, sum e^zy (zy - zx)):
  // scaled by kH / c where every lane's is finite, else summed again in the units of h, where no term overflows
  // (a -inf logit under the other side's mass still gives +inf). Exponentials as the block loop's, bit for bit.
  template <bool FORWARD, typename LX, typename LY>
  inline Vec kl_block(const Vec& in_z_units, int64_t nv, const LX& ldx, const LY& ldy, const Vec& vinvh) const {
    if (all_finite(in_z_units)) return in_z_units * (Vec(kH) / vinv);
    const Vec vkh(kH), nmixh = mix * Vec(-kH), nmiyh = miy * Vec(-kH);
    Vec acc(0.f);
    for (int64_t i = 0; i < nv; ++i) {
      const Vec hx = at::vec::fmadd(ldx(i), vkh, nmixh), hy = at::vec::fmadd(ldy(i), vkh, nmiyh);
      if constexpr (FORWARD) {
        const Vec ey = vexpz(hy * vinvh);
        acc = add_where_pos(acc, ey, ey * (hy - hx));
      } else {
        const Vec ex = vexpz(hx * vinvh);
        acc = add_where_pos(acc, ex, ex * (hx - hy));
      }
    }
    return acc;
  }
};

// The exponentials of a row's forward kept for its gradient pass (the fused loss, loss_forward.cpp), so that
// each element's exponential is computed once: e[v] = exp((x_v - frame) / T) with frame the row's running max
// when v's block was folded, frames[b * kW + l] that frame for block b (of kBlockVecs vectors) in every lane l.
// e holds the padded vocabulary (a multiple of kW); the tail block is the last one.
struct ExpCache {
  float* e;
  float* frames;
};

struct NoKeep {
  inline void operator()(int64_t, const Vec&) const {}
};

struct Combined {
  bool bad = false;    // a NaN or +inf logit in the row
  bool dead = false;   // every logit is -inf
  double mi = 0.0;     // max raw logit: the frame of s and t
  double s = 0.0, t = 0.0;
};

// Combine the lanes' (m, frame mi, s[, t]) into row totals. Every lane holds the row's max and frame (the block
// maxima are taken across lanes), so the totals are the lanes' sums, in double and in lane order.
inline Combined combine_lanes(const float* m, const float* mi, const float* s, const float* t) {
  Combined c;
  c.bad = std::isnan(m[0]) || m[0] == kInf || std::isnan(mi[0]);
  c.dead = !c.bad && m[0] == -kInf;
  if (c.bad || c.dead) return c;
  c.mi = mi[0];
  for (int64_t l = 0; l < kW; ++l) {
    c.s += s[l];
    if (t != nullptr) c.t += t[l];
  }
  return c;
}

// hi + lo = 1 / T (Temperatures::inverse). Exponents are in kZUnit units (c = 1 / (T kZUnit)), the
// results in natural units.
// FLOOR (the truncation family, truncation.h): the logits below `floor` are read as -inf, so the statistics are
// those of the row restricted to {x >= floor}; floor = -inf reads every logit as it is.
// cache: where to keep the policy's exponentials (ExpCache), or nullptr.
template <typename T, typename R, int MODE, bool FLOOR = false>
inline RowOut forward_row(const T* x, const R* y, int64_t V, int64_t label, float hi, double lo,
                          float floor = -kInf, const ExpCache* cache = nullptr) {
  constexpr bool ENT = MODE & kEntropy, REF = MODE & kRef, KL = MODE & kFullKl, FKL = MODE & kForwardKl;
  constexpr bool HEAD = MODE & kHead;
  const Vec vfloor(floor), vninf(-kInf);
  const double c = (static_cast<double>(hi) + lo) / kZUnit;
  LaneState<MODE> st(static_cast<float>(c));
  const int64_t nvec = V / kW, rem = V - nvec * kW;
  // HEAD: the largest logit before the label, for is_top1 (argmax's rule: the first maximum wins). The blocks before
  // the label's are the running max when its block begins; the label's block adds its entries before the label.
  float before_label = -kInf;
  auto note_label_block = [&](int64_t start, int64_t end) {
    if constexpr (HEAD) {
      if (start <= label && label < end) {
        alignas(64) float am[kW];
        st.mx.store(am);
        before_label = am[0];
        for (int64_t i = start; i < label; ++i) before_label = std::max(before_label, static_cast<float>(x[i]));
      }
    }
  };
  int64_t b = 0;
  for (int64_t v0 = 0; v0 < nvec; v0 += kBlockVecs, ++b) {
    const int64_t nv = std::min(kBlockVecs, nvec - v0);
    note_label_block(v0 * kW, (v0 + nv) * kW);
    const T* px = x + v0 * kW;
    const R* py = REF ? y + v0 * kW : nullptr;
    auto ldx = [px, &vfloor, &vninf](int64_t i) {
      const Vec v = load_f(px + i * kW);
      if constexpr (FLOOR) return Vec::blendv(v, vninf, v < vfloor);
      return v;
    };
    auto ldy = [py](int64_t i) { return load_f(py + i * kW); };
    if (cache) {
      float* e = cache->e + v0 * kW;
      st.block(nv, ldx, ldy, [e](int64_t i, const Vec& ex) { ex.store(e + i * kW); });
      st.mix.store(cache->frames + b * kW);
    } else {
      st.block(nv, ldx, ldy, NoKeep{});
    }
  }
  double tail_sum = 0.0;  // HEAD: the logits of the tail (padded) block, summed here
  if (rem) {
    note_label_block(nvec * kW, V);
    alignas(64) float bx[kW], by[kW];
    for (int64_t l = 0; l < kW; ++l) {
      bx[l] = l < rem ? static_cast<float>(x[nvec * kW + l]) : -kInf;
      if (FLOOR && bx[l] < floor) bx[l] = -kInf;
      by[l] = (REF && l < rem) ? static_cast<float>(y[nvec * kW + l]) : -kInf;
      if (HEAD && l < rem) tail_sum += bx[l];
    }
    auto ldx = [&bx](int64_t) { return Vec::loadu(bx); };
    auto ldy = [&by](int64_t) { return Vec::loadu(by); };
    if (cache) {
      float* e = cache->e + nvec * kW;
      st.template block<true>(1, ldx, ldy, [e](int64_t, const Vec& ex) { ex.store(e); });
      st.mix.store(cache->frames + b * kW);
    } else {
      st.template block<true>(1, ldx, ldy, NoKeep{});
    }
  }

  alignas(64) float amx[kW], amix[kW], asx[kW], atx[kW];
  st.mx.store(amx);
  st.mix.store(amix);
  st.sx.store(asx);
  st.tx.store(atx);
  const Combined cx = combine_lanes(amx, amix, asx, ENT ? atx : nullptr);

  RowOut r;
  for (int i = 0; i < kNumStats; ++i) r.v[i] = kNaN;
  const float xlf = static_cast<float>(x[label]);
  const double xl = (FLOOR && xlf < floor) ? -static_cast<double>(kInf) : static_cast<double>(xlf);
  if (cx.bad) {
    // NaN / +inf logits: no distribution (lse NaN so the backward writes zeros).
  } else if (cx.dead) {
    r.v[kStatLse] = -kInf;
  } else {
    const double log_s = std::log(cx.s);
    r.v[kStatLse] = static_cast<float>(kZUnit * c * cx.mi + log_s);
    const double zl = (xl - cx.mi) * c;
    r.v[kStatLogp] = xl == -kInf ? -kInf : static_cast<float>(std::min(kZUnit * zl - log_s, 0.0));
    if constexpr (ENT) r.v[kStatEntropy] = static_cast<float>(log_s - kZUnit * cx.t / cx.s);
    if constexpr (HEAD) {
      // A NaN logit that the max skipped shows in the sum: NaN, as every other statistic.
      r.v[kStatIsTop1] = std::isnan(log_s) ? kNaN : (xl >= cx.mi && xlf > before_label) ? 1.f : 0.f;
      alignas(64) float aq[kW];
      st.qsum.store(aq);
      double q = 0.0;
      for (int64_t l = 0; l < kW; ++l) q += aq[l];
      r.v[kStatLogSumSqProbs] = static_cast<float>(std::log(q) - 2.0 * log_s);
    }
  }
  if constexpr (HEAD) {
    if (!cx.bad) {  // all -inf: the sum and the max are -inf
      alignas(64) float az[kW];
      st.xsum.store(az);
      double z = 0.0;
      for (int64_t l = 0; l < kW; ++l) z += az[l];
      z += tail_sum * kH;  // in units of h: kH is constants.LOGIT_SUM_SCALE
      r.v[kStatSumLogits] = static_cast<float>(z * (static_cast<double>(hi) + lo));
      // A NaN logit that the max skipped shows in the sum of exponentials: NaN.
      r.v[kStatMaxLogit] = cx.dead ? -kInf : std::isnan(cx.s) ? kNaN : static_cast<float>(cx.mi);
    }
  }
  if constexpr (REF) {
    alignas(64) float amy[kW], amiy[kW], asy[kW];
    st.my.store(amy);
    st.miy.store(amiy);
    st.sy.store(asy);
    const Combined cy = combine_lanes(amy, amiy, asy, nullptr);
    if (cy.bad) {
      r.v[kStatRefLse] = kNaN;
    } else if (cy.dead) {
      r.v[kStatRefLse] = -kInf;
    } else {
      const double log_s = std::log(cy.s);
      r.v[kStatRefLse] = static_cast<float>(kZUnit * c * cy.mi + log_s);
      const double yl = static_cast<double>(static_cast<float>(y[label]));
      const double zl = (yl - cy.mi) * c;
      r.v[kStatRefLogp] = yl == -kInf ? -kInf : static_cast<float>(std::min(kZUnit * zl - log_s, 0.0));
      if constexpr (KL) {
        if (!cx.bad && !cx.dead) {
          alignas(64) float au[kW];
          st.u.store(au);
          double U = 0.0;  // in the units of h
          for (int64_t l = 0; l < kW; ++l) U += au[l];
          const double scale = c * kZUnit / kH;
          r.v[kStatFullKl] = static_cast<float>(nonnegative(scale * U / cx.s - std::log(cx.s) + log_s));
        }
      }
      if constexpr (FKL) {
        if (!cx.bad && !cx.dead) {
          alignas(64) float av[kW];
          st.v.store(av);
          double W = 0.0;  // in the units of h
          for (int64_t l = 0; l < kW; ++l) W += av[l];
          const double scale = c * kZUnit / kH;
          r.v[kStatForwardKl] = static_cast<float>(nonnegative(scale * W / cy.s - log_s + std::log(cx.s)));
        }
      }
    }
  }
  return r;
}

}  // namespace kltriton_cpp
