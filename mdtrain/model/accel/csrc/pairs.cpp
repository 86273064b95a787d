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

#include <cstdint>

namespace {

using i64 = std::int64_t;

constexpr int kOk = 0;
constexpr int kBadKind = 3;

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

// Pass 1: the far vectors (padded slots moved to 2·rcut) and |d|² per pair. The square root is
// torch's (MKL's vector sqrt, which is not always the correctly rounded one), between the passes.
template <typename T>
int distance(i64 m_rows, i64 nnei, const double* vec, const i64* nl, double rcut, T* far,
             T* sq, std::uint8_t* mask, int threads) {
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
    }
    T s = f[0] * f[0];
    s = fused(f[1], f[1], s);
    sq[p] = fused(f[2], f[2], s);
  }
  return kOk;
}

// Pass 2: from the far vectors and r, the rows, their transpose, the coefficients and the scale.
template <typename T>
int environment(int kind, i64 m_rows, i64 nnei, const T* far, const T* dist, const i64* types,
                const std::uint8_t* keep, const T* davg, const T* dstd, const double* consts,
                int ones, T* rows, T* cols, T* coef, T* scale, int threads) {
  if (kind != 0 && kind != 1) return kBadKind;
  const Switch sw{consts[0], consts[1], consts[2]};
  const int width = kind == 0 ? 4 : 1;
  const int a_cols = width + (ones ? 1 : 0);
  const i64 plane = m_rows * nnei;
  const T lo = T(sw.rcut_smth), hi = T(sw.rcut), span = T(sw.rcut - sw.rcut_smth);
  const T slope30 = T(-30.0 / (sw.rcut - sw.rcut_smth));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (i64 m = 0; m < m_rows; ++m) {
    const i64 t = types[m];
    for (i64 j = 0; j < nnei; ++j) {
      const i64 p = m * nnei + j;
      const T r = dist[p];
      const T rp = r + T(sw.protection);
      T c = r < lo ? lo : r;  // torch.clamp(r, rcut_smth, rcut)
      c = c > hi ? hi : c;
      const T u = (c - lo) / span;
      const T u3 = u * u * u;
      const T poly = (T(-6.0) * u * u + T(15.0) * u) - T(10.0);
      const T w = u3 * poly + T(1.0);
      const T v = u * (T(1.0) - u);
      const T dw = v * v * slope30;
      T raw[4];
      if (kind == 0) {
        const T inv = w / rp;
        const T h = inv / rp;
        raw[0] = inv;
        for (int a = 0; a < 3; ++a) raw[a + 1] = far[a * plane + p] * h;
        const T slope = dw / rp;
        coef[p] = h;
        coef[plane + p] = (slope - h) / r;
        coef[2 * plane + p] = (slope - T(2.0) * h) / (rp * r);
      } else {
        raw[0] = w / rp;
        coef[p] = (dw - raw[0]) / (rp * r);
      }
      const i64 stat = (t * nnei + j) * width;
      const T k = keep ? T(keep[p] ? 1 : 0) : T(1);
      for (int a = 0; a < width; ++a) {
        T row = (raw[a] - davg[stat + a]) / dstd[stat + a];
        T sc = (T(1) / dstd[stat + a]) * T(1.0);
        if (keep) {
          row = row * k;
          sc = sc * k;
        }
        rows[p * a_cols + a] = row;
        cols[(m * a_cols + a) * nnei + j] = row;
        scale[p * width + a] = sc;
      }
      if (ones) {
        rows[p * a_cols + width] = T(1);
        cols[(m * a_cols + width) * nnei + j] = T(1);
      }
    }
  }
  return kOk;
}

// g = dE/dd of every pair and member from dE/dR̃ (pieces of whole rows), then the gathered sums
// Σ over the pairs whose neighbour is n, per member and component, in pair order.
template <typename T>
int force_forward(int kind, i64 members, i64 m_rows, i64 nnei, const T* const* pieces,
                  const i64* piece_rows, i64 npieces, const T* scale, const T* far,
                  const T* coef, const i64* neighbour, i64 flat, double* g, double* pulled,
                  int threads) {
  if (kind != 0 && kind != 1) return kBadKind;
  const int width = kind == 0 ? 4 : 1;
  const i64 plane = m_rows * nnei;
  const i64 total = members * m_rows;
  // the piece and its first row of every row of the (K·M) rows
  i64 piece = 0, first = 0;
  (void)npieces;
  const T** row_of = new const T*[total];
  for (i64 kr = 0; kr < total; ++kr) {
    while (kr >= first + piece_rows[piece]) first += piece_rows[piece++];
    row_of[kr] = pieces[piece] + (kr - first) * nnei * width;
  }
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (i64 kr = 0; kr < total; ++kr) {
      const i64 k = kr / m_rows, m = kr % m_rows;
      const T* rb = row_of[kr];
      double* gk = g + k * 3 * plane;
      for (i64 j = 0; j < nnei; ++j) {
        const i64 p = m * nnei + j;
        const T d0 = far[p], d1 = far[plane + p], d2 = far[2 * plane + p];
        if (kind == 0) {
          T q[4];
          for (int a = 0; a < 4; ++a) q[a] = rb[j * 4 + a] * scale[p * 4 + a];
          const T h = coef[p], c0 = coef[plane + p], c1 = coef[2 * plane + p];
          T s = T(0) + q[1] * d0;
          s = s + q[2] * d1;
          s = s + q[3] * d2;
          const T radial = q[0] * c0 + s * c1;
          gk[p] = double(fused(h, q[1], d0 * radial));
          gk[plane + p] = double(fused(h, q[2], d1 * radial));
          gk[2 * plane + p] = double(fused(h, q[3], d2 * radial));
        } else {
          const T qc = (rb[j] * scale[p]) * coef[p];
          gk[p] = double(d0 * qc);
          gk[plane + p] = double(d1 * qc);
          gk[2 * plane + p] = double(d2 * qc);
        }
      }
    }
#pragma omp for schedule(static)
    for (i64 kc = 0; kc < members * 3; ++kc) {
      double* out = pulled + kc * flat;
      for (i64 n = 0; n < flat; ++n) out[n] = 0.0;
      const double* src = g + kc * plane;
      for (i64 p = 0; p < plane; ++p) out[neighbour[p]] += src[p];
    }
  }
  delete[] row_of;
  return kOk;
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

// The transpose: ḡ = F̄_centre − F̄_neighbour (− the virial's part), then the pull-back's
// transpose and the scale, into dE/dR̃'s cotangent (K·M, S, W).
template <typename T>
int force_backward(int kind, i64 members, i64 m_rows, i64 nnei, const double* fb,
                   const double* vpart, const i64* centre, const i64* neighbour, i64 flat,
                   const T* far, const T* coef, const T* scale, T* out, int threads) {
  if (kind != 0 && kind != 1) return kBadKind;
  const int width = kind == 0 ? 4 : 1;
  const i64 plane = m_rows * nnei;
  const i64 total = members * m_rows;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (i64 kr = 0; kr < total; ++kr) {
    const i64 k = kr / m_rows, m = kr % m_rows;
    const double* own = fb ? fb + (k * flat + centre[m]) * 3 : nullptr;
    for (i64 j = 0; j < nnei; ++j) {
      const i64 p = m * nnei + j;
      T gb[3];
      for (int c = 0; c < 3; ++c) {
        double v = 0.0;
        if (fb) v = own[c] - fb[(k * flat + neighbour[p]) * 3 + c];
        if (vpart) v = v - vpart[(k * 3 + c) * plane + p];
        gb[c] = T(v);
      }
      const T d0 = far[p], d1 = far[plane + p], d2 = far[2 * plane + p];
      T s = T(0) + gb[0] * d0;
      s = s + gb[1] * d1;
      s = s + gb[2] * d2;
      T* o = out + (kr * nnei + j) * width;
      if (kind == 0) {
        const T h = coef[p], c0 = coef[plane + p], c1 = coef[2 * plane + p];
        const T sc1 = s * c1;
        o[0] = (s * c0) * scale[p * 4];
        o[1] = fused(h, gb[0], d0 * sc1) * scale[p * 4 + 1];
        o[2] = fused(h, gb[1], d1 * sc1) * scale[p * 4 + 2];
        o[3] = fused(h, gb[2], d2 * sc1) * scale[p * 4 + 3];
      } else {
        o[0] = (s * coef[p]) * scale[p];
      }
    }
  }
  return kOk;
}

}  // namespace

extern "C" {

#define MDT_PAIRS(SUFFIX, T)                                                                     \
  int mdt_pair_distance_##SUFFIX(i64 m_rows, i64 nnei, const double* vec, const i64* nl,      \
                                 double rcut, T* far, T* sq, std::uint8_t* mask, int threads) { \
    return distance<T>(m_rows, nnei, vec, nl, rcut, far, sq, mask, threads);                    \
  }                                                                                              \
  int mdt_pair_environment_##SUFFIX(int kind, i64 m_rows, i64 nnei, const T* far, const T* r,   \
                                    const i64* types, const std::uint8_t* keep, const T* davg,  \
                                    const T* dstd, const double* consts, int ones, T* rows,     \
                                    T* cols, T* coef, T* scale, int threads) {                  \
    return environment<T>(kind, m_rows, nnei, far, r, types, keep, davg, dstd, consts, ones,    \
                          rows, cols, coef, scale, threads);                                    \
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

void mdt_pair_force_assemble(i64 members, i64 m_rows, i64 flat, const double* own,
                             const double* pulled, const i64* centre, double* force) {
  force_assemble(members, m_rows, flat, own, pulled, centre, force);
}
}
