// Compiled environment matrix and force path of the explicit backends (see
// mdtrain/model/accel/pair_kernels.py, which loads them, and environment_node.py / force_node.py,
// the PyTorch nodes they replace on the kernels backend and are tested against).
//
// Every value is computed with the operations, in the order and the precision, of those nodes'
// torch operations (each torch elementwise operation rounds once; sqrt and division are
// correctly rounded), so the results are the same bits. No contraction into FMAs: a*b + c is two
// roundings in torch; torch's addcmul(x, a, b) is one, fma(a, b, x) (measured: every element,
// vectorised and tail), written here as fused(). The force gather sums each component over the pairs in pair order, as
// torch's index_add_ does; the sums a torch reduction vectorises (a row's sum over its slots,
// the virial's products) stay torch operations on the Python side.
//
// Layouts (M rows in the environment's group order, S slots per row, K members):
// pair vectors (M, S, 3) float64; lists (M, S) int64 (< 0: padded); davg, dstd (ntypes, S, W);
// rows (M, S, A), columns (M, A, S) with A = W (+1 for a column of ones); far vectors (3, M, S);
// coefficients (C, M, S); scale (M, S, W); mask (M, S) bytes. Kind 0 is se_e2_a (W = 4,
// C = 3), kind 1 se_e2_r (W = 1, C = 1). dE/dR̃ (K·M, S, W) in pieces of whole rows; g = dE/dd
// (K, 3, M, S) float64; the gathered sums (K, 3, F), F = frames × atoms.

#pragma GCC optimize("fp-contract=off")

#include <omp.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#include "status.h"

namespace {

using i64 = std::int64_t;

constexpr int kBadKind = 3;      // rows other than se_e2_a's (4 columns) or se_e2_r's ([s, 1])
constexpr int kBadPieces = 4;    // pieces of dE/dR̃ short of K·M rows; a backward of nothing

template <typename T>
inline T fused(T a, T b, T c) {  // torch.addcmul(c, a, b): a·b + c rounded once
  if constexpr (sizeof(T) == 4) {
    return __builtin_fmaf(a, b, c);
  } else {
    return __builtin_fma(a, b, c);
  }
}

struct Switch {  // the smooth switch's settings
  double rcut, rcut_smth, protection;
};

// Pass 1: the far vectors (padded slots moved to 2·rcut) and |d|² per pair, and (planes not
// null) the pair vectors as float64 planes (3, M, S). The square root is torch's (MKL's vector
// sqrt, which is not always the correctly rounded one), between the passes.
template <typename T>
int distance(i64 m_rows, i64 nnei, const double* vec, const i64* nl, double rcut, T* far,
             T* sq, std::uint8_t* mask, double* planes, int threads) {
  const i64 plane = m_rows * nnei;
  const T two_rcut = T(2.0 * rcut);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (i64 p = 0; p < plane; ++p) {
    const bool real = nl[p] >= 0;
    mask[p] = real;
    const T keep = real ? T(1) : T(0);
    const T base = (T(1) - keep) * two_rcut;
    T f[3];
    for (int c = 0; c < 3; ++c) {
      f[c] = fused(T(vec[3 * p + c]), keep, base);
      far[c * plane + p] = f[c];
      if (planes) planes[c * plane + p] = vec[3 * p + c];
    }
    T s = f[0] * f[0];
    s = fused(f[1], f[1], s);
    sq[p] = fused(f[2], f[2], s);
  }
  return kOk;
}

// Pass 2 for one row m (slots contiguous, so that the compiler vectorises each loop over j):
// the switch and its derivative, the coefficients, then each column of the normalised rows.
template <typename T, int KIND, bool ONES>
void environment_row(const Switch& sw, i64 m, i64 nnei, i64 plane, const T* __restrict far,
                     const T* __restrict dist, const T* __restrict avg_t,
                     const T* __restrict std_t, const T* __restrict inv_t,
                     const std::uint8_t* keep, T* __restrict rows, T* __restrict cols,
                     T* __restrict coef, T* __restrict scale, T* __restrict raw) {
  constexpr int width = KIND == 0 ? 4 : 1;
  constexpr int a_cols = width + (ONES ? 1 : 0);
  const T lo = T(sw.rcut_smth), hi = T(sw.rcut), span = T(sw.rcut - sw.rcut_smth);
  const T slope30 = T(-30.0 / (sw.rcut - sw.rcut_smth)), protection = T(sw.protection);
  const i64 p0 = m * nnei;
  const T* __restrict r_m = dist + p0;
  for (i64 j = 0; j < nnei; ++j) {
    const T r = r_m[j];
    const T rp = r + protection;
    T c = r < lo ? lo : r;  // torch.clamp(r, rcut_smth, rcut)
    c = c > hi ? hi : c;
    const T u = (c - lo) / span;
    const T u3 = u * u * u;
    const T poly = (T(-6.0) * u * u + T(15.0) * u) - T(10.0);
    const T w = u3 * poly + T(1.0);
    const T v = u * (T(1.0) - u);
    const T dw = v * v * slope30;
    if constexpr (KIND == 0) {
      const T inv = w / rp;
      const T h = inv / rp;
      raw[j] = inv;
      for (int a = 0; a < 3; ++a) raw[(a + 1) * nnei + j] = far[a * plane + p0 + j] * h;
      const T slope = dw / rp;
      coef[p0 + j] = h;
      coef[plane + p0 + j] = (slope - h) / r;
      coef[2 * plane + p0 + j] = (slope - T(2.0) * h) / (rp * r);
    } else {
      const T s = w / rp;
      raw[j] = s;
      coef[p0 + j] = (dw - s) / (rp * r);
    }
  }
  T* __restrict rows_m = rows + p0 * a_cols;
  T* __restrict cols_m = cols + m * a_cols * nnei;
  T* __restrict scale_m = scale + p0 * width;
  for (int a = 0; a < width; ++a) {
    const T* __restrict avg_a = avg_t + a * nnei;
    const T* __restrict std_a = std_t + a * nnei;
    const T* __restrict inv_a = inv_t + a * nnei;
    const T* __restrict raw_a = raw + a * nnei;
    T* __restrict col = cols_m + a * nnei;
    for (i64 j = 0; j < nnei; ++j) col[j] = (raw_a[j] - avg_a[j]) / std_a[j];
    if (keep) {
      const std::uint8_t* keep_m = keep + p0;
      for (i64 j = 0; j < nnei; ++j) {
        const T k = keep_m[j] ? T(1) : T(0);
        col[j] = col[j] * k;
        scale_m[j * width + a] = inv_a[j] * k;
      }
    } else {
      for (i64 j = 0; j < nnei; ++j) scale_m[j * width + a] = inv_a[j];
    }
    for (i64 j = 0; j < nnei; ++j) rows_m[j * a_cols + a] = col[j];
  }
  if constexpr (ONES) {
    T* __restrict col = cols_m + width * nnei;
    for (i64 j = 0; j < nnei; ++j) {
      col[j] = T(1);
      rows_m[j * a_cols + width] = T(1);
    }
  }
}

// Pass 2: from the far vectors and r, the rows, their transpose, the coefficients and the scale.
// davg and dstd are (ntypes, S, W); 1/dstd (torch: reciprocal, then ·1.0) is taken once per
// type and slot.
template <typename T, int KIND, bool ONES>
int environment(i64 m_rows, i64 nnei, i64 ntypes, const T* far, const T* dist,
                const i64* types, const std::uint8_t* keep, const T* davg, const T* dstd,
                const Switch& sw, T* rows, T* cols, T* coef, T* scale, int threads) {
  constexpr int width = KIND == 0 ? 4 : 1;
  const i64 plane = m_rows * nnei;
  const i64 table = ntypes * width * nnei;
  std::vector<T> stats(3 * table);  // per type, column, slot: davg, dstd, 1/dstd
  for (i64 t = 0; t < ntypes; ++t)
    for (int a = 0; a < width; ++a)
      for (i64 j = 0; j < nnei; ++j) {
        const i64 from = (t * nnei + j) * width + a, to = (t * width + a) * nnei + j;
        stats[to] = davg[from];
        stats[table + to] = dstd[from];
        stats[2 * table + to] = (T(1) / dstd[from]) * T(1.0);
      }
  // scratch per thread, allocated here: an exception cannot leave a parallel region
  std::vector<T> scratch(static_cast<std::size_t>(threads) * width * nnei);
#pragma omp parallel num_threads(threads)
  {
    T* raw = scratch.data() + static_cast<i64>(omp_get_thread_num()) * width * nnei;
#pragma omp for schedule(static)
    for (i64 m = 0; m < m_rows; ++m) {
      const i64 at = types[m] * width * nnei;
      environment_row<T, KIND, ONES>(sw, m, nnei, plane, far, dist, stats.data() + at,
                                     stats.data() + table + at, stats.data() + 2 * table + at,
                                     keep, rows, cols, coef, scale, raw);
    }
  }
  return kOk;
}

template <typename T>
int environment(int kind, i64 m_rows, i64 nnei, i64 ntypes, const T* far, const T* dist,
                const i64* types, const std::uint8_t* keep, const T* davg, const T* dstd,
                const double* consts, int ones, T* rows, T* cols, T* coef, T* scale,
                int threads) {
  const Switch sw{consts[0], consts[1], consts[2]};
  return guarded([&] {
    if (kind == 0 && !ones)
      return environment<T, 0, false>(m_rows, nnei, ntypes, far, dist, types, keep, davg, dstd,
                                      sw, rows, cols, coef, scale, threads);
    if (kind == 1 && ones)
      return environment<T, 1, true>(m_rows, nnei, ntypes, far, dist, types, keep, davg, dstd,
                                     sw, rows, cols, coef, scale, threads);
    return kBadKind;
  });
}

// g = dE/dd of one row (K members' row k) from its dE/dR̃ rb (S, W): q = dE/dR̃ · scale, then
// the pull-back (se_e2_a: g = d·(q₀c₀ + (q₁₂₃·d)c₁) + h·q₁₂₃, the last an addcmul; se_e2_r:
// g = d·(q·c)), in T, converted to float64.
template <typename T, int KIND>
void force_row(i64 nnei, i64 plane, i64 p0, const T* __restrict rb, const T* __restrict scale,
               const T* __restrict far, const T* __restrict coef, double* __restrict g) {
  const T* __restrict d0 = far + p0;
  const T* __restrict d1 = far + plane + p0;
  const T* __restrict d2 = far + 2 * plane + p0;
  double* __restrict g0 = g + p0;
  double* __restrict g1 = g + plane + p0;
  double* __restrict g2 = g + 2 * plane + p0;
  if constexpr (KIND == 0) {
    const T* __restrict sc = scale + p0 * 4;
    const T* __restrict h = coef + p0;
    const T* __restrict c0 = coef + plane + p0;
    const T* __restrict c1 = coef + 2 * plane + p0;
    for (i64 j = 0; j < nnei; ++j) {
      const T q0 = rb[4 * j] * sc[4 * j], q1 = rb[4 * j + 1] * sc[4 * j + 1];
      const T q2 = rb[4 * j + 2] * sc[4 * j + 2], q3 = rb[4 * j + 3] * sc[4 * j + 3];
      T s = T(0) + q1 * d0[j];  // (q₁₂₃ · d).sum(dim=-3): from 0, in component order
      s = s + q2 * d1[j];
      s = s + q3 * d2[j];
      const T radial = q0 * c0[j] + s * c1[j];
      g0[j] = double(fused(h[j], q1, d0[j] * radial));
      g1[j] = double(fused(h[j], q2, d1[j] * radial));
      g2[j] = double(fused(h[j], q3, d2[j] * radial));
    }
  } else {
    const T* __restrict sc = scale + p0;
    const T* __restrict c = coef + p0;
    for (i64 j = 0; j < nnei; ++j) {
      const T qc = (rb[j] * sc[j]) * c[j];
      g0[j] = double(d0[j] * qc);
      g1[j] = double(d1[j] * qc);
      g2[j] = double(d2[j] * qc);
    }
  }
}

// g of every pair and member from dE/dR̃ (pieces of whole rows, members first), then the
// gathered sums Σ over the pairs whose neighbour is n, per member and component, in pair order
// (torch's index_add_ of single elements, which runs serially in that order).
template <typename T, int KIND>
int force_forward(i64 members, i64 m_rows, i64 nnei, const T* const* pieces,
                  const i64* piece_rows, i64 npieces, const T* scale, const T* far,
                  const T* coef, const i64* neighbour, i64 flat, double* g, double* pulled,
                  int threads) {
  constexpr int width = KIND == 0 ? 4 : 1;
  const i64 plane = m_rows * nnei;
  const i64 total = members * m_rows;
  std::vector<const T*> row_of(total);  // each of the K·M rows' dE/dR̃
  i64 piece = 0, first = 0;
  for (i64 kr = 0; kr < total; ++kr) {
    while (piece < npieces && kr >= first + piece_rows[piece]) first += piece_rows[piece++];
    if (piece == npieces) return kBadPieces;
    row_of[kr] = pieces[piece] + (kr - first) * nnei * width;
  }
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (i64 kr = 0; kr < total; ++kr) {
      const i64 k = kr / m_rows, m = kr % m_rows;
      force_row<T, KIND>(nnei, plane, m * nnei, row_of[kr], scale, far, coef,
                         g + k * 3 * plane);
    }
#pragma omp for schedule(static)
    for (i64 kc = 0; kc < members * 3; ++kc) {
      double* out = pulled + kc * flat;
      for (i64 n = 0; n < flat; ++n) out[n] = 0.0;
      const double* src = g + kc * plane;
      for (i64 p = 0; p < plane; ++p) out[neighbour[p]] += src[p];
    }
  }
  return kOk;
}

template <typename T>
int force_forward(int kind, i64 members, i64 m_rows, i64 nnei, const T* const* pieces,
                  const i64* piece_rows, i64 npieces, const T* scale, const T* far,
                  const T* coef, const i64* neighbour, i64 flat, double* g, double* pulled,
                  int threads) {
  return guarded([&] {
    if (kind == 0)
      return force_forward<T, 0>(members, m_rows, nnei, pieces, piece_rows, npieces, scale, far,
                                 coef, neighbour, flat, g, pulled, threads);
    if (kind == 1)
      return force_forward<T, 1>(members, m_rows, nnei, pieces, piece_rows, npieces, scale, far,
                                 coef, neighbour, flat, g, pulled, threads);
    return kBadKind;
  });
}

// Forces (K, F, 3) = the rows' own sums (K, 3, M) placed at their centres, less the gathered.
void force_assemble(i64 members, i64 m_rows, i64 flat, const double* own, const double* pulled,
                    const i64* centre, double* force) {
  for (i64 k = 0; k < members; ++k)
    for (i64 m = 0; m < m_rows; ++m)
      for (int c = 0; c < 3; ++c) {
        const i64 n = centre[m];
        force[(k * flat + n) * 3 + c] =
            own[(k * 3 + c) * m_rows + m] - pulled[(k * 3 + c) * flat + n];
      }
}

// The transpose for one row: ḡ = F̄_centre − F̄_neighbour (− the virial's part V̄d, torch's
// product), in T; the pull-back's transpose (se_e2_a: [s·c₀, d·(s·c₁) + h·ḡ] with s = ḡ·d, the
// second an addcmul; se_e2_r: s·c) and the scale, into dE/dR̃'s cotangent (S, W).
template <typename T, int KIND>
void force_back_row(i64 nnei, i64 plane, i64 m, const double* fb, const double* vp,
                    const i64* __restrict centre, const i64* __restrict neighbour,
                    const T* __restrict far, const T* __restrict coef, const T* __restrict scale,
                    T* __restrict out, T* __restrict gb) {
  const i64 p0 = m * nnei;
  for (int c = 0; c < 3; ++c) {
    T* __restrict gc = gb + c * nnei;
    if (fb) {
      const double own = fb[centre[m] * 3 + c];
      if (vp) {
        const double* __restrict v = vp + c * plane + p0;
        for (i64 j = 0; j < nnei; ++j) gc[j] = T((own - fb[neighbour[p0 + j] * 3 + c]) - v[j]);
      } else {
        for (i64 j = 0; j < nnei; ++j) gc[j] = T(own - fb[neighbour[p0 + j] * 3 + c]);
      }
    } else {  // torch: zeros, less the virial's part
      const double* __restrict v = vp + c * plane + p0;
      for (i64 j = 0; j < nnei; ++j) gc[j] = T(0.0 - v[j]);
    }
  }
  const T* __restrict d0 = far + p0;
  const T* __restrict d1 = far + plane + p0;
  const T* __restrict d2 = far + 2 * plane + p0;
  const T* __restrict b0 = gb;
  const T* __restrict b1 = gb + nnei;
  const T* __restrict b2 = gb + 2 * nnei;
  if constexpr (KIND == 0) {
    const T* __restrict sc = scale + p0 * 4;
    const T* __restrict h = coef + p0;
    const T* __restrict c0 = coef + plane + p0;
    const T* __restrict c1 = coef + 2 * plane + p0;
    for (i64 j = 0; j < nnei; ++j) {
      T s = T(0) + b0[j] * d0[j];
      s = s + b1[j] * d1[j];
      s = s + b2[j] * d2[j];
      const T sc1 = s * c1[j];
      out[4 * j] = (s * c0[j]) * sc[4 * j];
      out[4 * j + 1] = fused(h[j], b0[j], d0[j] * sc1) * sc[4 * j + 1];
      out[4 * j + 2] = fused(h[j], b1[j], d1[j] * sc1) * sc[4 * j + 2];
      out[4 * j + 3] = fused(h[j], b2[j], d2[j] * sc1) * sc[4 * j + 3];
    }
  } else {
    const T* __restrict sc = scale + p0;
    const T* __restrict c = coef + p0;
    for (i64 j = 0; j < nnei; ++j) {
      T s = T(0) + b0[j] * d0[j];
      s = s + b1[j] * d1[j];
      s = s + b2[j] * d2[j];
      out[j] = (s * c[j]) * sc[j];
    }
  }
}

template <typename T, int KIND>
int force_backward(i64 members, i64 m_rows, i64 nnei, const double* fb, const double* vpart,
                   const i64* centre, const i64* neighbour, i64 flat, const T* far,
                   const T* coef, const T* scale, T* out, int threads) {
  constexpr int width = KIND == 0 ? 4 : 1;
  const i64 plane = m_rows * nnei;
  const i64 total = members * m_rows;
  std::vector<T> scratch(static_cast<std::size_t>(threads) * 3 * nnei);  // ḡ per thread
#pragma omp parallel num_threads(threads)
  {
    T* gb = scratch.data() + static_cast<i64>(omp_get_thread_num()) * 3 * nnei;
#pragma omp for schedule(static)
    for (i64 kr = 0; kr < total; ++kr) {
      const i64 k = kr / m_rows, m = kr % m_rows;
      force_back_row<T, KIND>(nnei, plane, m, fb ? fb + k * flat * 3 : nullptr,
                              vpart ? vpart + k * 3 * plane : nullptr, centre, neighbour, far,
                              coef, scale, out + kr * nnei * width, gb);
    }
  }
  return kOk;
}

template <typename T>
int force_backward(int kind, i64 members, i64 m_rows, i64 nnei, const double* fb,
                   const double* vpart, const i64* centre, const i64* neighbour, i64 flat,
                   const T* far, const T* coef, const T* scale, T* out, int threads) {
  if (!fb && !vpart) return kBadPieces;
  return guarded([&] {
    if (kind == 0)
      return force_backward<T, 0>(members, m_rows, nnei, fb, vpart, centre, neighbour, flat,
                                  far, coef, scale, out, threads);
    if (kind == 1)
      return force_backward<T, 1>(members, m_rows, nnei, fb, vpart, centre, neighbour, flat,
                                  far, coef, scale, out, threads);
    return kBadKind;
  });
}

// Per group of rows [bounds[g], bounds[g+1]) and neighbour type t (slots offsets[t] to
// offsets[t+1]): one past the last slot that holds a real neighbour in any of its rows, or 0
// (environment_node.slot_widths).
void slot_widths(i64 nnei, const std::uint8_t* mask, const i64* bounds, i64 groups,
                 const i64* offsets, i64 ntypes, i64* widths) {
  std::vector<std::uint8_t> used(nnei);
  for (i64 g = 0; g < groups; ++g) {
    for (i64 j = 0; j < nnei; ++j) used[j] = 0;
    for (i64 m = bounds[g]; m < bounds[g + 1]; ++m)
      for (i64 j = 0; j < nnei; ++j) used[j] |= mask[m * nnei + j];
    for (i64 t = 0; t < ntypes; ++t) {
      i64 width = 0;
      for (i64 j = offsets[t]; j < offsets[t + 1]; ++j)
        if (used[j]) width = j + 1 - offsets[t];
      widths[g * ntypes + t] = width;
    }
  }
}

}  // namespace

extern "C" {

#define MDT_PAIRS(SUFFIX, T)                                                                     \
  int mdt_pair_distance_##SUFFIX(i64 m_rows, i64 nnei, const double* vec, const i64* nl,      \
                                 double rcut, T* far, T* sq, std::uint8_t* mask,                \
                                 double* planes, int threads) {                                 \
    return distance<T>(m_rows, nnei, vec, nl, rcut, far, sq, mask, planes, threads);            \
  }                                                                                              \
  int mdt_pair_environment_##SUFFIX(int kind, i64 m_rows, i64 nnei, i64 ntypes, const T* far,  \
                                    const T* r, const i64* types, const std::uint8_t* keep,     \
                                    const T* davg, const T* dstd, const double* consts,         \
                                    int ones, T* rows, T* cols, T* coef, T* scale,              \
                                    int threads) {                                              \
    return environment<T>(kind, m_rows, nnei, ntypes, far, r, types, keep, davg, dstd, consts,  \
                          ones, rows, cols, coef, scale, threads);                              \
  }                                                                                              \
  int mdt_pair_force_forward_##SUFFIX(int kind, i64 members, i64 m_rows, i64 nnei,              \
                                      const T* const* pieces, const i64* piece_rows,            \
                                      i64 npieces, const T* scale, const T* far, const T* coef, \
                                      const i64* neighbour, i64 flat, double* g, double* pulled,\
                                      int threads) {                                            \
    return force_forward<T>(kind, members, m_rows, nnei, pieces, piece_rows, npieces, scale,    \
                            far, coef, neighbour, flat, g, pulled, threads);                    \
  }                                                                                              \
  int mdt_pair_force_backward_##SUFFIX(int kind, i64 members, i64 m_rows, i64 nnei,             \
                                       const double* fb, const double* vpart,                   \
                                       const i64* centre, const i64* neighbour, i64 flat,       \
                                       const T* far, const T* coef, const T* scale, T* out,     \
                                       int threads) {                                           \
    return force_backward<T>(kind, members, m_rows, nnei, fb, vpart, centre, neighbour, flat,   \
                             far, coef, scale, out, threads);                                   \
  }

MDT_PAIRS(f32, float)
MDT_PAIRS(f64, double)

int mdt_pair_slot_widths(i64 nnei, const std::uint8_t* mask, const i64* bounds, i64 groups,
                         const i64* offsets, i64 ntypes, i64* widths) {
  return guarded([&] {
    slot_widths(nnei, mask, bounds, groups, offsets, ntypes, widths);
    return kOk;
  });
}

void mdt_pair_force_assemble(i64 members, i64 m_rows, i64 flat, const double* own,
                             const double* pulled, const i64* centre, double* force) {
  force_assemble(members, m_rows, flat, own, pulled, centre, force);
}
}
