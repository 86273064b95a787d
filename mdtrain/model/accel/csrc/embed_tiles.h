// The float32 embedding kernels' own products (included by embedding.cpp): a row of x and its
// tangent dx times one small weight matrix, both sums sharing every load of W, with no packing
// and no pass over a product's output in memory. The blocks' products are small (512 rows,
// K = 25 or 50, N = 50 or 100) and a BLAS packs its operands on every call; here W is laid out
// once per call (rows of whole vectors, zero past N: it stays in L1), and each row's two result
// rows land in an L1 buffer that the caller's elementwise step reads at once.
//
// Float32 only: its sums run in another order than the BLAS's (float64 keeps the BLAS, bit for
// bit). Compiled where AVX2 and FMA are (-march=native); elsewhere the BLAS path runs.
#pragma once

#include <memory>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MDT_EMBED_TILES 1
#else
#define MDT_EMBED_TILES 0
#endif

namespace tiles {

constexpr int kLanes = 8;     // floats per AVX register
constexpr int kMaxTile = 7;   // vectors per column tile: 2 × 7 sums + 2 broadcasts in 16 registers
constexpr int kMaxWeights = 6144;  // floats of a padded W (24 KiB): larger nets keep the BLAS

inline int padded(int n) { return (n + kLanes - 1) / kLanes * kLanes; }

// W (k × n, row-major, or its transpose when ``transpose``) as k rows of padded(n) floats,
// zero past n. Null when the tiles do not cover it (no AVX2/FMA, or too large for L1).
inline std::unique_ptr<float[]> pad_weights(const float* w, int k, int n, bool transpose) {
  const int np = padded(n);
  if (!MDT_EMBED_TILES || k * np > kMaxWeights) return nullptr;
  std::unique_ptr<float[]> out(new float[size_t(k) * np]);
  for (int r = 0; r < k; ++r)
    for (int c = 0; c < np; ++c)
      out[size_t(r) * np + c] = c < n ? (transpose ? w[size_t(c) * k + r] : w[size_t(r) * n + c]) : 0.0f;
  return out;
}

#if MDT_EMBED_TILES
// a[0 : 8·NV] = x·W[:, cols], da[…] = dx·W[:, cols] for one column tile (wp: its first column)
template <int NV>
inline void row_tile(const float* x, const float* dx, int k, const float* wp, int np, float* a,
                     float* da) {
  __m256 s[NV], d[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) s[v] = d[v] = _mm256_setzero_ps();
  for (int q = 0; q < k; ++q) {
    const __m256 xb = _mm256_broadcast_ss(x + q), db = _mm256_broadcast_ss(dx + q);
    const float* wq = wp + q * np;
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      __m256 w = _mm256_loadu_ps(wq + v * kLanes);
      // up to 6 vectors, W in a register for both sums: one load instead of two (the loads,
      // not the FMAs, limit a 7-vector tile, whose 17th register does not exist)
      if constexpr (NV < 7) __asm__("" : "+x"(w));
      s[v] = _mm256_fmadd_ps(xb, w, s[v]);
      d[v] = _mm256_fmadd_ps(db, w, d[v]);
    }
  }
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) {
    _mm256_storeu_ps(a + v * kLanes, s[v]);
    _mm256_storeu_ps(da + v * kLanes, d[v]);
  }
}

// One row: a (np) = x·W, da (np) = dx·W over all padded columns (x, dx: k values each).
inline void row_products(const float* x, const float* dx, int k, const float* wp, int np,
                         float* a, float* da) {
  for (int c = 0; c < np;) {
    const int nv = (np - c) / kLanes < kMaxTile ? (np - c) / kLanes : kMaxTile;
    const float* w = wp + c;
    switch (nv) {
      case 1: row_tile<1>(x, dx, k, w, np, a + c, da + c); break;
      case 2: row_tile<2>(x, dx, k, w, np, a + c, da + c); break;
      case 3: row_tile<3>(x, dx, k, w, np, a + c, da + c); break;
      case 4: row_tile<4>(x, dx, k, w, np, a + c, da + c); break;
      case 5: row_tile<5>(x, dx, k, w, np, a + c, da + c); break;
      case 6: row_tile<6>(x, dx, k, w, np, a + c, da + c); break;
      default: row_tile<7>(x, dx, k, w, np, a + c, da + c); break;
    }
    c += nv * kLanes;
  }
}

#else
inline void row_products(const float*, const float*, int, const float*, int, float*, float*) {}
#endif

}  // namespace tiles
