// The embedding's row gradients on the compiled kernels (loaded by mdtrain/model/accel/kernels.py;
// the PyTorch node they replace is embedding_nodes._RowGrad): dE/dR̃ of a block of slot columns
// from T̄ = dE/dT, G and dG/ds, and the T̄ part of its backward.
//
// Layouts as in embedding.cpp: rows R̃ (centre c, component a, slot j) at R[c·rc + a·ra + j·rj];
// T̄ (centres, A, M); G and dG/ds as the forward's tape rows (tape rows, M), the centres of a
// plan's block b at rows row0[b] + (place in block)·width[b] + slot. The row gradients are
// written into a slice of a wider tensor: centre c, slot j, component a at
// out[c·oc + j·ow + a] for a < ow (ow ≤ A: se_e2_r keeps only its first column), and slots j
// from the centre's evaluated width up to `fill` are zeroed, so that one tensor (centres,
// nnei, ow) holds every block of a group without a concatenation. The cotangent Z of the
// backward comes in that layout too (components a ≥ ow taken as 0).
//
// Same bits as the loops these replace (embedding.cpp's row_grad and row_grad_tbar before
// 2026-11-26, compiled by GCC 12 for AMD Zen 3): each of the 2A dot products of a slot is still
// one `omp simd` reduction, but all 2A run in one pass (G and dG/ds read once per slot instead
// of A times; 2A independent accumulators instead of a latency-bound pair), and T̄'s backward
// adds the same terms in slot order, all A rows of T̄ in one pass over a slot's G and dG/ds.

#pragma GCC optimize("fp-contract=off")

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "status.h"

namespace {

using i64 = std::int64_t;

struct Blocks {  // a kernel_nodes.BlockPlan (see embedding.cpp's Plan)
  const i64* order;
  const i64* start;
  const i64* width;
  const i64* row0;
  i64 count;
};

// f(centre, its first tape row, its evaluated width) for every centre of the plan, the blocks
// dealt to the threads in embedding.cpp's snake order (0 1 1 0 0 1 ...): each block on the
// thread that made its tape rows.
template <typename F>
void for_centres(const Blocks& P, int threads, F f) {
#pragma omp parallel num_threads(threads)
  {
    const int me = omp_get_thread_num(), team = omp_get_num_threads();
    for (i64 b = 0; b < P.count; ++b) {
      const i64 lane = b % team, owner = (b / team) % 2 ? team - 1 - lane : lane;
      if (owner != me) continue;
      const i64 p0 = P.start[b], nb = P.start[b + 1] - p0, w = P.width[b];
      for (i64 q = 0; q < nb; ++q) f(P.order[p0 + q], P.row0[b] + q * w, w);
    }
  }
}

// a·b + c as the loops these replace computed it: GCC contracted it into one FMA where the
// CPU has one (their sums over M and T̄'s terms), but not the A-term sum of the slot's radial
// part (its tuning for AMD Zen avoids FMA chains there). This file compiles without
// contraction, so each rounding is written out.
template <typename T>
inline T mul_add(T a, T b, T c) {
#ifdef __FMA__
  if constexpr (sizeof(T) == 4) {
    return __builtin_fmaf(a, b, c);
  } else {
    return __builtin_fma(a, b, c);
  }
#else
  return a * b + c;
#endif
}

// The 2A dot products of one slot: dot[a] = G·T̄_a, dots[a] = G'·T̄_a (T̄_a = tc + a·m), all in
// one pass (A = 2 repeats its two rows of T̄ in the unused accumulators).
template <typename T, int A>
inline void slot_dots(const T* g, const T* d, const T* tc, int m, T* dot, T* dots) {
  const T* t0 = tc;
  const T* t1 = tc + m;
  const T* t2 = A == 4 ? tc + 2 * m : t0;
  const T* t3 = A == 4 ? tc + 3 * m : t1;
  T d0 = 0, d1 = 0, d2 = 0, d3 = 0, s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : d0, d1, d2, d3, s0, s1, s2, s3)
  for (int k = 0; k < m; ++k) {
    const T gk = g[k], dk = d[k];
    d0 = mul_add(gk, t0[k], d0);
    s0 = mul_add(dk, t0[k], s0);
    d1 = mul_add(gk, t1[k], d1);
    s1 = mul_add(dk, t1[k], s1);
    d2 = mul_add(gk, t2[k], d2);
    s2 = mul_add(dk, t2[k], s2);
    d3 = mul_add(gk, t3[k], d3);
    s3 = mul_add(dk, t3[k], s3);
  }
  const T all[8] = {d0, d1, d2, d3, s0, s1, s2, s3};
  std::copy(all, all + A, dot);
  std::copy(all + 4, all + 4 + A, dots);
}

// dE/dR̃ = G T̄ᵀ + [R̃·(G' T̄ᵀ), 0, …] on the evaluated slots, 0 on the others up to `fill`.
template <typename T, int A>
int row_grad(const T* R, i64 rc, i64 ra, i64 rj, const Blocks& P, int m, const T* tbar,
             const T* value, const T* slope, T* out, i64 oc, int ow, i64 fill, int threads) {
  for_centres(P, threads, [&](i64 c, i64 r0, i64 w) {
    const T* tc = tbar + c * A * m;
    const T* rows = R + c * rc;
    T* o = out + c * oc;
    for (i64 j = 0; j < w; ++j) {
      T dot[A], dots[A];
      slot_dots<T, A>(value + (r0 + j) * m, slope + (r0 + j) * m, tc, m, dot, dots);
      T sbar = 0;
      for (int a = 0; a < A; ++a) sbar += rows[a * ra + j * rj] * dots[a];
      T* oj = o + j * ow;
      oj[0] = sbar + dot[0];
      for (int a = 1; a < ow; ++a) oj[a] = dot[a];
    }
    std::fill(o + w * ow, o + fill * ow, T(0));
  });
  return kOk;
}

// T̄ (centres, A, M) of row_grad's backward for the cotangent Z (in row_grad's output layout):
// Σ_j z_j ⊗ G_j + (z_j0 R̃_j) ⊗ G'_j over each centre's evaluated slots, summed in slot order;
// all A rows of T̄ in one pass over a slot's G and G' (loaded once instead of A times). With
// ``add`` the sum is formed apart (in ``scratch``, A·M per thread) and then added to out's
// values (out + sum: another block's T̄, as autograd added the blocks' parts).
template <typename T, int A>
int row_grad_tbar(const T* R, i64 rc, i64 ra, i64 rj, const Blocks& P, int m, const T* z, i64 zc,
                  int zw, const T* value, const T* slope, T* out, T* scratch, int threads) {
  for_centres(P, threads, [&](i64 c, i64 r0, i64 w) {
    const T* rows = R + c * rc;
    const T* zs = z + c * zc;
    T* const target = out + c * A * m;
    T* oc = scratch != nullptr ? scratch + omp_get_thread_num() * A * m : target;
    std::fill(oc, oc + A * m, T(0));
    for (i64 j = 0; j < w; ++j) {
      const T* zj = zs + j * zw;
      T za[A], zr[A];
      for (int a = 0; a < A; ++a) {
        za[a] = a < zw ? zj[a] : T(0);
        zr[a] = rows[a * ra + j * rj] * zj[0];
      }
      const T* g = value + (r0 + j) * m;
      const T* d = slope + (r0 + j) * m;
#pragma omp simd
      for (int k = 0; k < m; ++k) {
        const T gk = g[k], dk = d[k];
        for (int a = 0; a < A; ++a) oc[a * m + k] += mul_add(za[a], gk, zr[a] * dk);
      }
    }
    if (oc != target)
      for (i64 k = 0; k < A * m; ++k) target[k] = target[k] + oc[k];
  });
  return kOk;
}

// f(std::integral_constant<int, A>) for the row widths compiled (as embedding.cpp's with_axes).
template <typename F>
int by_axes(int axes, F f) {
  if (axes == 4) return f(std::integral_constant<int, 4>{});
  if (axes == 2) return f(std::integral_constant<int, 2>{});
  return kBadAxes;
}

}  // namespace

extern "C" {

// rows: R̃ and its strides; order … count: the plan; m: T̄'s columns; out, oc, ow, fill: the
// output slice (see the header); threads: the team.
#define MDT_ROW_GRAD_EXPORT(T, suffix)                                                         \
  int mdt_rows_grad_##suffix(const void* rows, i64 rc, i64 ra, i64 rj, int axes,              \
                             const i64* order, const i64* start, const i64* width,             \
                             const i64* row0, i64 count, int m, const void* tbar,              \
                             const void* value, const void* slope, void* out, i64 oc, int ow, \
                             i64 fill, int threads) {                                          \
    const Blocks P{order, start, width, row0, count};                                          \
    return by_axes(axes, [&](auto axes_c) {                                                    \
      return row_grad<T, decltype(axes_c)::value>(                                             \
          static_cast<const T*>(rows), rc, ra, rj, P, m, static_cast<const T*>(tbar),          \
          static_cast<const T*>(value), static_cast<const T*>(slope), static_cast<T*>(out),    \
          oc, ow, fill, threads);                                                              \
    });                                                                                        \
  }                                                                                            \
  int mdt_rows_grad_tbar_##suffix(const void* rows, i64 rc, i64 ra, i64 rj, int axes,         \
                                  const i64* order, const i64* start, const i64* width,        \
                                  const i64* row0, i64 count, int m, const void* z, i64 zc,    \
                                  int zw, const void* value, const void* slope, void* out,     \
                                  int add, int threads) {                                      \
    const Blocks P{order, start, width, row0, count};                                          \
    return guarded([&] {                                                                       \
      std::vector<T> scratch(add ? static_cast<std::size_t>(threads) * axes * m : 0);          \
      return by_axes(axes, [&](auto axes_c) {                                                  \
        return row_grad_tbar<T, decltype(axes_c)::value>(                                      \
            static_cast<const T*>(rows), rc, ra, rj, P, m, static_cast<const T*>(z), zc, zw,   \
            static_cast<const T*>(value), static_cast<const T*>(slope), static_cast<T*>(out),  \
            add ? scratch.data() : nullptr, threads);                                          \
      });                                                                                      \
    });                                                                                        \
  }

MDT_ROW_GRAD_EXPORT(double, f64)
MDT_ROW_GRAD_EXPORT(float, f32)
}
