// The se_e2_a descriptor's small batched products in compiled code (see
// mdtrain/model/accel/descriptor_products.py, which loads them and checks them against torch):
// D = TᵀT< (per centre (M, A)·(A, axis)), dE/dT = T< dDᵀ + [T dD, 0] and the backward of both.
// torch runs each as a batched BLAS product, one small matrix at a time (about 1 µs per matrix,
// 0.2–0.9 ms per call for 192 centres); here each node direction is one loop over the centres.
//
// The values are torch's bits: every output element is summed in the order the BLAS library's
// kernels sum it, given per product as an ``Order``: columns [0, split) are a fused
// multiply-add chain over k from the first product (MKL's main kernel on AVX2), columns
// [split, n) lanes over k (k ≡ l mod L) each summed by plain multiply-adds (two roundings), the
// lanes then added (L = 2: l0 + l1; L = 4: (l0 + l2) + (l1 + l3)). The Python side measures
// which order matches torch.bmm on this machine before it uses these kernels at all. The
// elementwise steps between the products (the division by nnei, the sums autograd forms when
// it accumulates the pieces of a gradient) are written as torch does them, in the same order.
//
// Layouts (B centres, A = 4 rows of T, M = neuron_out, X = axis_neuron): t (B, A, M), D and dD
// (B, M, X), dE/dT (B, A, M), all contiguous.

#pragma GCC optimize("fp-contract=off")

#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <new>
#include <vector>

#include "status.h"

namespace {

using i64 = std::int64_t;

template <typename T>
inline T fused(T a, T b, T c) {  // a·b + c rounded once
  if constexpr (sizeof(T) == 4) {
    return __builtin_fmaf(a, b, c);
  } else {
    return __builtin_fma(a, b, c);
  }
}

struct Order {
  i64 split;  // columns before it: the fused chain; from it on: ``lanes`` plain lanes
  i64 lanes;  // 1, 2 or 4
};

struct Mat {  // one operand of a batch: element (i, j) of batch b at p + b·s0 + i·s1 + j·s2
  const void* p;
  i64 s0, s1, s2;
};

#if defined(__AVX2__) && defined(__FMA__)
#define MDT_PRODUCTS_SIMD 1
template <typename T>
struct Simd;
template <>
struct Simd<double> {
  using R = __m256d;
  static constexpr int width = 4;
  static R load(const double* p) { return _mm256_loadu_pd(p); }
  static void store(double* p, R r) { _mm256_storeu_pd(p, r); }
  static R all(double a) { return _mm256_set1_pd(a); }
  static R mul(R a, R b) { return _mm256_mul_pd(a, b); }
  static R add(R a, R b) { return _mm256_add_pd(a, b); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_pd(a, b, c); }
};
template <>
struct Simd<float> {
  using R = __m256;
  static constexpr int width = 8;
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R r) { _mm256_storeu_ps(p, r); }
  static R all(float a) { return _mm256_set1_ps(a); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
};
#endif

// One output element (row ai with stride sa2, column j of the packed (k, n) bp) in ``order``.
template <typename T>
inline T element(const T* ai, i64 sa2, const T* bp, i64 n, i64 k, i64 j, bool main, i64 lanes) {
  if (main) {
    T acc = ai[0] * bp[j];
    for (i64 kk = 1; kk < k; ++kk) acc = fused(ai[kk * sa2], bp[kk * n + j], acc);
    return acc;
  }
  T lane[4] = {};
  for (i64 l = 0; l < lanes; ++l) {
    lane[l] = ai[l * sa2] * bp[l * n + j];
    for (i64 kk = l + lanes; kk < k; kk += lanes) lane[l] = lane[l] + ai[kk * sa2] * bp[kk * n + j];
  }
  if (lanes == 2) return lane[0] + lane[1];
  if (lanes == 4) return (lane[0] + lane[2]) + (lane[1] + lane[3]);
  return lane[0];
}

// pack (k × n, contiguous rows) = the transpose of b (n × k, row stride ld): 8 × 8 (float) or
// 4 × 4 (double) tiles in registers, the edges element by element.
inline void transpose_tile(const float* b, i64 ld, float* pack, i64 n) {
#ifdef MDT_PRODUCTS_SIMD
  __m256 r[8], t[8];
  for (int q = 0; q < 8; ++q) r[q] = _mm256_loadu_ps(b + q * ld);
  for (int q = 0; q < 4; ++q) {
    t[2 * q] = _mm256_unpacklo_ps(r[2 * q], r[2 * q + 1]);
    t[2 * q + 1] = _mm256_unpackhi_ps(r[2 * q], r[2 * q + 1]);
  }
  __m256 u[8];
  for (int h = 0; h < 2; ++h) {  // rows 0-3 (h = 0) and 4-7 of the tile
    const __m256 *lo = t + 4 * h;
    u[4 * h] = _mm256_shuffle_ps(lo[0], lo[2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * h + 1] = _mm256_shuffle_ps(lo[0], lo[2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * h + 2] = _mm256_shuffle_ps(lo[1], lo[3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * h + 3] = _mm256_shuffle_ps(lo[1], lo[3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int q = 0; q < 4; ++q) {
    _mm256_storeu_ps(pack + q * n, _mm256_permute2f128_ps(u[q], u[4 + q], 0x20));
    _mm256_storeu_ps(pack + (q + 4) * n, _mm256_permute2f128_ps(u[q], u[4 + q], 0x31));
  }
#else
  for (i64 q = 0; q < 8; ++q)
    for (i64 j = 0; j < 8; ++j) pack[q * n + j] = b[j * ld + q];
#endif
}

inline void transpose_tile(const double* b, i64 ld, double* pack, i64 n) {
#ifdef MDT_PRODUCTS_SIMD
  const __m256d r0 = _mm256_loadu_pd(b), r1 = _mm256_loadu_pd(b + ld);
  const __m256d r2 = _mm256_loadu_pd(b + 2 * ld), r3 = _mm256_loadu_pd(b + 3 * ld);
  const __m256d t0 = _mm256_unpacklo_pd(r0, r1), t1 = _mm256_unpackhi_pd(r0, r1);
  const __m256d t2 = _mm256_unpacklo_pd(r2, r3), t3 = _mm256_unpackhi_pd(r2, r3);
  _mm256_storeu_pd(pack, _mm256_permute2f128_pd(t0, t2, 0x20));
  _mm256_storeu_pd(pack + n, _mm256_permute2f128_pd(t1, t3, 0x20));
  _mm256_storeu_pd(pack + 2 * n, _mm256_permute2f128_pd(t0, t2, 0x31));
  _mm256_storeu_pd(pack + 3 * n, _mm256_permute2f128_pd(t1, t3, 0x31));
#else
  for (i64 q = 0; q < 4; ++q)
    for (i64 j = 0; j < 4; ++j) pack[q * n + j] = b[j * ld + q];
#endif
}

template <typename T>
void transpose(const T* b, i64 ld, i64 k, i64 n, T* pack) {
  constexpr i64 w = sizeof(T) == 4 ? 8 : 4;
  const i64 kt = k - k % w, nt = n - n % w;
  for (i64 j = 0; j < nt; j += w)
    for (i64 q = 0; q < kt; q += w) transpose_tile(b + j * ld + q, ld, pack + q * n + j, n);
  for (i64 q = 0; q < k; ++q)
    for (i64 j = q < kt ? nt : 0; j < n; ++j) pack[q * n + j] = b[j * ld + q];
}

// Dot products in 128-bit lanes (4 floats, 2 doubles) over k, added as ``element``'s lanes:
// c(i, j) for rows of a and columns of b both contiguous over k (what the BLAS library's kernel
// does for such operands: lanes = 4 for float, 2 for double). Returns false where not handled.
template <typename T>
bool dot_lanes(i64 m, i64 n, i64 k, const T* a, i64 sa1, const T* b, i64 sb2, T* c, i64 sc1,
               i64 sc2, i64 lanes) {
#ifdef MDT_PRODUCTS_SIMD
  constexpr i64 w = sizeof(T) == 4 ? 4 : 2;
  if (lanes != w || k % w != 0) return false;
  for (i64 i = 0; i < m; ++i) {
    i64 j = 0;
    const T* ai = a + i * sa1;
    // four columns at a time: four independent sums in flight, each summed and reduced
    // exactly as the single-column loop below does it
    for (; j + 4 <= n; j += 4) {
      const T* b0 = b + j * sb2;
      T* ci = c + i * sc1 + j * sc2;
      if constexpr (sizeof(T) == 4) {
        __m128 acc[4];
        const __m128 a0 = _mm_loadu_ps(ai);
        for (int q = 0; q < 4; ++q) acc[q] = _mm_mul_ps(a0, _mm_loadu_ps(b0 + q * sb2));
        for (i64 x = 4; x < k; x += 4) {
          const __m128 ax = _mm_loadu_ps(ai + x);
          for (int q = 0; q < 4; ++q)
            acc[q] = _mm_add_ps(acc[q], _mm_mul_ps(ax, _mm_loadu_ps(b0 + q * sb2 + x)));
        }
        _MM_TRANSPOSE4_PS(acc[0], acc[1], acc[2], acc[3]);  // acc[l]: lane l of the four
        const __m128 sum =
            _mm_add_ps(_mm_add_ps(acc[0], acc[2]), _mm_add_ps(acc[1], acc[3]));
        alignas(16) float out[4];
        _mm_store_ps(out, sum);
        for (int q = 0; q < 4; ++q) ci[q * sc2] = out[q];
      } else {
        __m128d acc[4];
        const __m128d a0 = _mm_loadu_pd(ai);
        for (int q = 0; q < 4; ++q) acc[q] = _mm_mul_pd(a0, _mm_loadu_pd(b0 + q * sb2));
        for (i64 x = 2; x < k; x += 2) {
          const __m128d ax = _mm_loadu_pd(ai + x);
          for (int q = 0; q < 4; ++q)
            acc[q] = _mm_add_pd(acc[q], _mm_mul_pd(ax, _mm_loadu_pd(b0 + q * sb2 + x)));
        }
        const __m128d s01 =
            _mm_add_pd(_mm_unpacklo_pd(acc[0], acc[1]), _mm_unpackhi_pd(acc[0], acc[1]));
        const __m128d s23 =
            _mm_add_pd(_mm_unpacklo_pd(acc[2], acc[3]), _mm_unpackhi_pd(acc[2], acc[3]));
        alignas(16) double out[4];
        _mm_store_pd(out, s01);
        _mm_store_pd(out + 2, s23);
        for (int q = 0; q < 4; ++q) ci[q * sc2] = out[q];
      }
    }
    for (; j < n; ++j) {
      const T* bj = b + j * sb2;
      if constexpr (sizeof(T) == 4) {
        __m128 acc = _mm_mul_ps(_mm_loadu_ps(ai), _mm_loadu_ps(bj));
        for (i64 x = 4; x < k; x += 4)
          acc = _mm_add_ps(acc, _mm_mul_ps(_mm_loadu_ps(ai + x), _mm_loadu_ps(bj + x)));
        const __m128 half = _mm_add_ps(acc, _mm_movehl_ps(acc, acc));  // l0 + l2, l1 + l3
        c[i * sc1 + j * sc2] = _mm_cvtss_f32(_mm_add_ss(half, _mm_shuffle_ps(half, half, 1)));
      } else {
        __m128d acc = _mm_mul_pd(_mm_loadu_pd(ai), _mm_loadu_pd(bj));
        for (i64 x = 2; x < k; x += 2)
          acc = _mm_add_pd(acc, _mm_mul_pd(_mm_loadu_pd(ai + x), _mm_loadu_pd(bj + x)));
        c[i * sc1 + j * sc2] = _mm_cvtsd_f64(_mm_add_sd(acc, _mm_unpackhi_pd(acc, acc)));
      }
    }
  }
  return true;
#else
  (void)m, (void)n, (void)k, (void)a, (void)sa1, (void)b, (void)sb2, (void)c, (void)sc1;
  (void)sc2, (void)lanes;
  return false;
#endif
}

// R rows of c (row stride ldc, contiguous columns) from R rows of a (strides sa1, sa2) and b
// with contiguous rows (row stride ldb): R independent chains per column block, so that the
// fused multiply-adds overlap (one row at a time waits on each one's latency).
template <typename T, int R>
void rows(const T* a, i64 sa1, i64 sa2, const T* bp, i64 ldb, i64 n, i64 k, i64 split,
          i64 lanes, T* c, i64 ldc) {
  i64 j = 0;
#ifdef MDT_PRODUCTS_SIMD
  using S = Simd<T>;
  using V = typename S::R;
  constexpr i64 w = S::width;
  for (; j + 2 * w <= split; j += 2 * w) {  // two column blocks: 2R chains in flight
    V acc[R], acd[R];
    V b0 = S::load(bp + j), b1 = S::load(bp + j + w);
    for (int r = 0; r < R; ++r) {
      const V ar = S::all(a[r * sa1]);
      acc[r] = S::mul(ar, b0);
      acd[r] = S::mul(ar, b1);
    }
    for (i64 kk = 1; kk < k; ++kk) {
      const V bk = S::load(bp + kk * ldb + j), bl = S::load(bp + kk * ldb + j + w);
      for (int r = 0; r < R; ++r) {
        const V ar = S::all(a[r * sa1 + kk * sa2]);
        acc[r] = S::fma(ar, bk, acc[r]);
        acd[r] = S::fma(ar, bl, acd[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      S::store(c + r * ldc + j, acc[r]);
      S::store(c + r * ldc + j + w, acd[r]);
    }
  }
  for (; j + w <= split; j += w) {
    V acc[R];
    V b0 = S::load(bp + j);
    for (int r = 0; r < R; ++r) acc[r] = S::mul(S::all(a[r * sa1]), b0);
    for (i64 kk = 1; kk < k; ++kk) {
      const V bk = S::load(bp + kk * ldb + j);
      for (int r = 0; r < R; ++r) acc[r] = S::fma(S::all(a[r * sa1 + kk * sa2]), bk, acc[r]);
    }
    for (int r = 0; r < R; ++r) S::store(c + r * ldc + j, acc[r]);
  }
  for (; j < split; ++j)
    for (int r = 0; r < R; ++r) c[r * ldc + j] = element(a + r * sa1, sa2, bp, ldb, k, j, true, lanes);
  for (; j + w <= n; j += w) {
    for (int r = 0; r < R; ++r) {
      const T* ai = a + r * sa1;
      V lane[4];  // only the first ``lanes`` are set and read (= {} cost a rep stos per block)
      for (i64 l = 0; l < lanes; ++l) {
        lane[l] = S::mul(S::all(ai[l * sa2]), S::load(bp + l * ldb + j));
        for (i64 kk = l + lanes; kk < k; kk += lanes)
          lane[l] = S::add(lane[l], S::mul(S::all(ai[kk * sa2]), S::load(bp + kk * ldb + j)));
      }
      V sum = lane[0];
      if (lanes == 2) sum = S::add(lane[0], lane[1]);
      if (lanes == 4) sum = S::add(S::add(lane[0], lane[2]), S::add(lane[1], lane[3]));
      S::store(c + r * ldc + j, sum);
    }
  }
#endif
  for (; j < n; ++j)
    for (int r = 0; r < R; ++r)
      c[r * ldc + j] = element(a + r * sa1, sa2, bp, ldb, k, j, j < split, lanes);
}

// c (m × n, row stride sc1, column stride sc2) = a · b for one batch item, in ``order``;
// ``lanes`` ≤ k. scratch: k·n + 4·n elements (b packed row-major, a row of c).
template <typename T>
void product(i64 m, i64 n, i64 k, const T* a, i64 sa1, i64 sa2, const T* b, i64 sb1, i64 sb2,
             T* c, i64 sc1, i64 sc2, Order order, T* scratch) {
  if (order.split == 0 && sa2 == 1 && sb1 == 1 &&
      dot_lanes(m, n, k, a, sa1, b, sb2, c, sc1, sc2, order.lanes))
    return;
  const T* bp = b;  // b with contiguous rows (k, n)
  if (sb2 != 1) {
    T* __restrict pack = scratch;
    if (sb1 == 1) {  // bᵀ contiguous
      transpose(b, sb2, k, n, pack);
    } else {
      for (i64 kk = 0; kk < k; ++kk)
        for (i64 j = 0; j < n; ++j) pack[kk * n + j] = b[kk * sb1 + j * sb2];
    }
    bp = pack;
    sb1 = n;
  }
  T* row = scratch + k * n;  // (4, n): rows of c to scatter where its columns are strided
  const i64 split = order.split < n ? order.split : n;
  const i64 lanes = order.lanes;
  for (i64 i = 0; i < m;) {
    const i64 r = i + 4 <= m ? 4 : 1;
    T* out = sc2 == 1 ? c + i * sc1 : row;
    const i64 ldc = sc2 == 1 ? sc1 : n;
    if (r == 4)
      rows<T, 4>(a + i * sa1, sa1, sa2, bp, sb1, n, k, split, lanes, out, ldc);
    else
      rows<T, 1>(a + i * sa1, sa1, sa2, bp, sb1, n, k, split, lanes, out, ldc);
    if (sc2 != 1)
      for (i64 q = 0; q < r; ++q)
        for (i64 j = 0; j < n; ++j) c[(i + q) * sc1 + j * sc2] = row[q * n + j];
    i += r;
  }
}

inline i64 need(i64 k, i64 n) { return k * n + 4 * n; }  // ``product``'s scratch

// Runs body(b, scratch) for every batch item over ``threads`` threads, scratch ``per`` elements
// each (allocated before the parallel region: an exception cannot leave one).
template <typename T, typename Body>
int over_batch(i64 batch, i64 per, int threads, Body body) {
  return guarded([&] {
    std::vector<T> scratch(static_cast<std::size_t>(threads) * per);
#pragma omp parallel num_threads(threads)
    {
      T* s = scratch.data() + static_cast<i64>(omp_get_thread_num()) * per;
#pragma omp for schedule(static)
      for (i64 b = 0; b < batch; ++b) body(b, s);
    }
    return kOk;
  });
}

// One product per batch item, c contiguous (B, m, n): what the Python side calibrates with.
template <typename T>
int batched(i64 batch, i64 m, i64 n, i64 k, Mat a, Mat b, T* c, Order order, int threads) {
  const T* pa = static_cast<const T*>(a.p);
  const T* pb = static_cast<const T*>(b.p);
  return over_batch<T>(batch, need(k, n), threads, [&](i64 i, T* s) {
    product<T>(m, n, k, pa + i * a.s0, a.s1, a.s2, pb + i * b.s0, b.s1, b.s2, c + i * m * n, n,
               1, order, s);
  });
}

// t[b] = s[b] / nnei (the contraction's sum divided, as torch divides), and
// D[b] (M, X) = t[b]ᵀ (M, A) · t[b][:, :X] (A, X).
template <typename T>
int descriptor_forward(i64 batch, i64 rows, i64 m, i64 x, const T* s, double nnei, T* t, T* d,
                       const i64* orders, int threads) {
  const Order o{orders[0], orders[1]};
  const T div = T(nnei);
  return over_batch<T>(batch, need(rows, x), threads, [&](i64 b, T* scratch) {
    const T* sb = s + b * rows * m;
    T* tb = t + b * rows * m;
    for (i64 i = 0; i < rows * m; ++i) tb[i] = sb[i] / div;
    product<T>(m, x, rows, tb, 1, m, tb, m, 1, d + b * m * x, x, 1, o, scratch);
  });
}

// The backward of ``descriptor_forward`` as autograd formed it when t = s / nnei was a division
// of its own and D's node took t twice: t's gradient is t_bar (dE/dT's backward's, which
// arrives first; null when there is none) plus ``low`` = [t dD, 0] (the slice's gradient,
// zeros past X) plus ``across`` = (dD t<ᵀ)ᵀ, added in that order, then divided by nnei.
template <typename T>
int descriptor_backward(i64 batch, i64 rows, i64 m, i64 x, const T* t, const T* dd,
                        const T* t_bar, double nnei, T* s_bar, const i64* orders, int threads) {
  const Order o_low{orders[0], orders[1]}, o_across{orders[2], orders[3]};
  const T div = T(nnei);
  const i64 prod = std::max(need(m, x), need(x, rows));
  return over_batch<T>(batch, prod + 2 * rows * m, threads, [&](i64 b, T* s) {
    const T* tb = t + b * rows * m;
    const T* db = dd + b * m * x;
    T* low = s + prod;
    T* across = low + rows * m;
    product<T>(rows, x, m, tb, m, 1, db, x, 1, low, m, 1, o_low, s);
    for (i64 r = 0; r < rows; ++r)
      for (i64 j = x; j < m; ++j) low[r * m + j] = T(0);
    product<T>(m, rows, x, db, x, 1, tb, 1, m, across, 1, m, o_across, s);
    T* ob = s_bar + b * rows * m;
    if (t_bar != nullptr) {
      const T* gb = t_bar + b * rows * m;
      for (i64 i = 0; i < rows * m; ++i) ob[i] = ((gb[i] + low[i]) + across[i]) / div;
    } else {
      for (i64 i = 0; i < rows * m; ++i) ob[i] = (low[i] + across[i]) / div;
    }
  });
}

// dE/dT (A, M) = [t< dDᵀ (A, M)][:, :X] + t dD (A, X), the rest t< dDᵀ, all divided by nnei
// (torch: bmm, bmm, add, cat, div).
template <typename T>
int tbar_forward(i64 batch, i64 rows, i64 m, i64 x, const T* t, const T* dd, double nnei, T* out,
                 const i64* orders, int threads) {
  const Order o_a{orders[0], orders[1]}, o_b{orders[2], orders[3]};
  const T div = T(nnei);
  const i64 prod = std::max(need(x, m), need(m, x));
  const i64 per = prod + rows * x;
  return over_batch<T>(batch, per, threads, [&](i64 b, T* s) {
    const T* tb = t + b * rows * m;
    const T* db = dd + b * m * x;
    T* ob = out + b * rows * m;
    T* small = s + prod;  // t dD (A, X)
    product<T>(rows, m, x, tb, m, 1, db, 1, x, ob, m, 1, o_a, s);
    product<T>(rows, x, m, tb, m, 1, db, x, 1, small, x, 1, o_b, s);
    for (i64 r = 0; r < rows; ++r) {
      T* o = ob + r * m;
      for (i64 j = 0; j < x; ++j) o[j] = (o[j] + small[r * x + j]) / div;
      for (i64 j = x; j < m; ++j) o[j] = o[j] / div;
    }
  });
}

// The backward of ``tbar_forward`` from its cotangent g (A, M), as autograd forms it: u = g/nnei;
// the first product's cotangent ā = u + 0 (its two slices' zero-padded sums), the second's
// b̄ = u[:, :X]; dt = b̄ dDᵀ + [ā dD, 0] (its pieces in autograd's order of arrival) and
// d(dD) = tᵀ b̄ + (t<ᵀ ā)ᵀ.
template <typename T>
int tbar_backward(i64 batch, i64 rows, i64 m, i64 x, const T* t, const T* dd, const T* g,
                  double nnei, T* t_bar, T* dd_bar, const i64* orders, int threads) {
  const Order o_2a{orders[0], orders[1]}, o_2b{orders[2], orders[3]};
  const Order o_3a{orders[4], orders[5]}, o_3b{orders[6], orders[7]};
  const T div = T(nnei);
  const i64 prod = std::max(std::max(need(m, x), need(rows, m)), std::max(need(x, m), need(rows, x)));
  const i64 per = prod + rows * m + rows * x + rows * x + 2 * m * x;
  return over_batch<T>(batch, per, threads, [&](i64 b, T* s) {
    const T* tb = t + b * rows * m;
    const T* db = dd + b * m * x;
    const T* gb = g + b * rows * m;
    T* abar = s + prod;         // (A, M)
    T* bbar = abar + rows * m;  // (A, X)
    T* p2a = bbar + rows * x;   // ā dD (A, X)
    T* p2b = p2a + rows * x;    // t<ᵀ ā (X, M): its rows contiguous (a strided store is slow)
    T* p2bt = p2b + m * x;      // its transpose (M, X)
    for (i64 i = 0; i < rows * m; ++i) abar[i] = gb[i] / div;  // u (vectorised: no branch)
    for (i64 r = 0; r < rows; ++r) std::copy(abar + r * m, abar + r * m + x, bbar + r * x);
    for (i64 i = 0; i < rows * m; ++i) abar[i] = abar[i] + T(0);
    product<T>(rows, x, m, abar, m, 1, db, x, 1, p2a, x, 1, o_2a, s);
    product<T>(x, m, rows, tb, 1, m, abar, m, 1, p2b, m, 1, o_2b, s);
    transpose(p2b, m, m, x, p2bt);
    T* tbb = t_bar + b * rows * m;
    product<T>(rows, m, x, bbar, x, 1, db, 1, x, tbb, m, 1, o_3a, s);
    T* ddb = dd_bar + b * m * x;
    product<T>(m, x, rows, tb, 1, m, bbar, x, 1, ddb, x, 1, o_3b, s);
    for (i64 r = 0; r < rows; ++r) {
      T* o = tbb + r * m;
      for (i64 j = 0; j < x; ++j) o[j] = o[j] + p2a[r * x + j];
      for (i64 j = x; j < m; ++j) o[j] = o[j] + T(0);
    }
    for (i64 i = 0; i < m * x; ++i) ddb[i] = ddb[i] + p2bt[i];
  });
}

}  // namespace

extern "C" {

#define MDT_PRODUCTS(SUFFIX, T)                                                                  \
  int mdt_small_product_##SUFFIX(i64 batch, i64 m, i64 n, i64 k, const T* a, i64 sa0, i64 sa1,  \
                                 i64 sa2, const T* b, i64 sb0, i64 sb1, i64 sb2, T* c,          \
                                 i64 split, i64 lanes, int threads) {                           \
    return batched<T>(batch, m, n, k, Mat{a, sa0, sa1, sa2}, Mat{b, sb0, sb1, sb2}, c,          \
                      Order{split, lanes}, threads);                                            \
  }                                                                                              \
  int mdt_descriptor_forward_##SUFFIX(i64 batch, i64 rows, i64 m, i64 x, const T* s,          \
                                      double nnei, T* t, T* d, const i64* orders, int threads) {  \
    return descriptor_forward<T>(batch, rows, m, x, s, nnei, t, d, orders, threads);            \
  }                                                                                              \
  int mdt_descriptor_backward_##SUFFIX(i64 batch, i64 rows, i64 m, i64 x, const T* t,          \
                                       const T* dd, const T* t_bar, double nnei, T* s_bar,      \
                                       const i64* orders, int threads) {                        \
    return descriptor_backward<T>(batch, rows, m, x, t, dd, t_bar, nnei, s_bar, orders,        \
                                  threads);                                                     \
  }                                                                                              \
  int mdt_tbar_forward_##SUFFIX(i64 batch, i64 rows, i64 m, i64 x, const T* t, const T* dd,    \
                                double nnei, T* out, const i64* orders, int threads) {          \
    return tbar_forward<T>(batch, rows, m, x, t, dd, nnei, out, orders, threads);               \
  }                                                                                              \
  int mdt_tbar_backward_##SUFFIX(i64 batch, i64 rows, i64 m, i64 x, const T* t, const T* dd,   \
                                 const T* g, double nnei, T* t_bar, T* dd_bar,                  \
                                 const i64* orders, int threads) {                              \
    return tbar_backward<T>(batch, rows, m, x, t, dd, g, nnei, t_bar, dd_bar, orders, threads); \
  }

MDT_PRODUCTS(f32, float)
MDT_PRODUCTS(f64, double)
}
