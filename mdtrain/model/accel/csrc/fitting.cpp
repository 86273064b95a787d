// Compiled elementwise loops of the fitting node (mdtrain/model/accel/fitting_compiled.py; the
// maths is that of fitting_node.py, which the tests compare against bit for bit).
//
// The fitting net's arrays are small (64 or 128 rows of 240): torch runs each elementwise step
// as its own pass on one thread, paying the interpreter and dispatch every time. Here each
// layer's elementwise work is one loop; the products stay torch's (MKL), and so do tanh and
// the row sums. Every loop computes exactly the operations torch computes, in its order, one
// rounding each: no floating-point contraction (a·b + c stays two roundings), hence the pragma;
// the one exception is torch's own: 1 − t² inside tanh_backward (see one_minus_sq).
//
// Layout: K nets (a committee's members; 1 for one net), each array (K, n, m) contiguous,
// except the sweep's input gradient g, which may be the output weights broadcast over rows
// (strides gk, gr; element stride 1), and idt (K, m) with stride ik between nets (nullptr: the
// layer has none). skip: 0 none, 1 y = … + x, 2 y = … + concat(x, x) (x has m / 2 columns).

#pragma GCC optimize("fp-contract=off")

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace {

using i64 = std::int64_t;

// 1 − t², as torch's tanh_backward rounds it: once (an FMA) where torch's own build contracts
// it (its AVX2 kernels), twice where it does not; the caller probes torch once (`fused`).
template <bool Fused, typename T>
inline T one_minus_sq(T t) {
  if constexpr (Fused) {
    return std::fma(-t, t, T(1));
  } else {
    return T(1) - t * t;
  }
}

// The loops below run over rows, and within a row over column ranges: [0, m) for skip 0 and 1,
// and the two halves [0, n_in) and [n_in, m) for skip 2, where x's column is j − off. Each
// range is a branch-free, vectorisable loop (the variants are template arguments).
template <typename Body>
inline void columns(i64 m, int skip, Body body) {
  if (skip == 2) {
    body(i64(0), m / 2, i64(0));
    body(m / 2, m, m / 2);
  } else {
    body(i64(0), m, i64(0));
  }
}

// y = t·idt + skip(x)  (t without idt: y = t + skip(x))
template <bool Id, bool X, typename T>
void combine(i64 nk, i64 n, i64 m, int skip, const T* t, const T* idt, i64 ik, const T* x, T* y) {
  const i64 n_in = skip == 2 ? m / 2 : m;
  for (i64 k = 0; k < nk; ++k) {
    const T* id = Id ? idt + k * ik : nullptr;
    for (i64 r = 0; r < n; ++r) {
      const T* tr = t + (k * n + r) * m;
      const T* xr = X ? x + (k * n + r) * n_in : nullptr;
      T* yr = y + (k * n + r) * m;
      columns(m, skip, [&](i64 j0, i64 j1, i64 off) {
#pragma omp simd
        for (i64 j = j0; j < j1; ++j) {
          T v = tr[j];
          if constexpr (Id) v = tr[j] * id[j];
          if constexpr (X) v = v + xr[j - off];
          yr[j] = v;
        }
      });
    }
  }
}

// p = (g·idt)(1 − t²)  (torch's tanh_backward of g·idt)
template <bool F, bool Id, typename T>
void slope(i64 nk, i64 n, i64 m, const T* g, i64 gk, i64 gr, const T* idt, i64 ik, const T* t,
           T* p) {
  for (i64 k = 0; k < nk; ++k) {
    const T* id = Id ? idt + k * ik : nullptr;
    for (i64 r = 0; r < n; ++r) {
      const T* grow = g + k * gk + r * gr;
      const T* tr = t + (k * n + r) * m;
      T* pr = p + (k * n + r) * m;
#pragma omp simd
      for (i64 j = 0; j < m; ++j) {
        T a = grow[j];
        if constexpr (Id) a = grow[j] * id[j];
        pr[j] = a * one_minus_sq<F>(tr[j]);
      }
    }
  }
}

// The reverse of one sweep layer, from p̄ = ḡW: r = p̄(1 − t²); ru = r·g (summed over rows by
// the caller for idt̄; only with idt); r ← r·idt; t_extra = ((t·p̄)·(g·idt))·(−2); ḡ_next =
// unfold(ḡ) + r, ḡ (K, n, m / skip) read for skip 1 and 2.
template <bool F, bool Id, bool X, typename T>
void sweep_back(i64 nk, i64 n, i64 m, int skip, const T* pbar, const T* t, const T* g, i64 gk,
                i64 gr, const T* idt, i64 ik, const T* gbar, T* ru, T* t_extra, T* gnext) {
  const i64 n_in = skip == 2 ? m / 2 : m;
  for (i64 k = 0; k < nk; ++k) {
    const T* id = Id ? idt + k * ik : nullptr;
    for (i64 r = 0; r < n; ++r) {
      const i64 row = (k * n + r) * m;
      const T* pb = pbar + row;
      const T* tr = t + row;
      const T* grow = g + k * gk + r * gr;
      const T* gb = X ? gbar + (k * n + r) * n_in : nullptr;
      T* te = t_extra + row;
      T* gn = gnext + row;
      T* rur = Id ? ru + row : nullptr;
      columns(m, skip, [&](i64 j0, i64 j1, i64 off) {
#pragma omp simd
        for (i64 j = j0; j < j1; ++j) {
          T rv = pb[j] * one_minus_sq<F>(tr[j]);
          T q = grow[j];
          if constexpr (Id) {
            rur[j] = rv * grow[j];
            rv = rv * id[j];
            q = grow[j] * id[j];
          }
          te[j] = ((tr[j] * pb[j]) * q) * T(-2);
          if constexpr (X) rv = gb[j - off] + rv;
          gn[j] = rv;
        }
      });
    }
  }
}

// The reverse of one forward layer, from ȳ: yt = ȳ·t (summed over rows by the caller for idt̄;
// only with idt); t̄ = ȳ·idt (+ t_extra); ā = t̄(1 − t²).
template <bool F, bool Id, bool E, typename T>
void forward_back(i64 nk, i64 n, i64 m, const T* ybar, const T* t, const T* idt, i64 ik,
                  const T* t_extra, T* yt, T* abar) {
  for (i64 k = 0; k < nk; ++k) {
    const T* id = Id ? idt + k * ik : nullptr;
    for (i64 r = 0; r < n; ++r) {
      const i64 row = (k * n + r) * m;
      const T* yb = ybar + row;
      const T* tr = t + row;
      const T* te = E ? t_extra + row : nullptr;
      T* ytr = Id ? yt + row : nullptr;
      T* ab = abar + row;
#pragma omp simd
      for (i64 j = 0; j < m; ++j) {
        T tb = yb[j];
        if constexpr (Id) {
          tb = yb[j] * id[j];
          ytr[j] = yb[j] * tr[j];
        }
        if constexpr (E) tb = tb + te[j];
        ab[j] = tb * one_minus_sq<F>(tr[j]);
      }
    }
  }
}

// f(bool constants...) for the run-time flags: the loop variant compiled for them.
template <typename F>
void with(bool a, F f) {
  if (a) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

}  // namespace

#define MDT_FITTING(S, T)                                                                      \
  extern "C" void mdt_fit_combine_##S(i64 nk, i64 n, i64 m, int skip, const T* t,             \
                                      const T* idt, i64 ik, const T* x, T* y) {               \
    with(idt, [&](auto id) {                                                                   \
      with(skip != 0, [&](auto xs) {                                                           \
        combine<id(), xs(), T>(nk, n, m, skip, t, idt, ik, x, y);                             \
      });                                                                                      \
    });                                                                                        \
  }                                                                                            \
  extern "C" void mdt_fit_slope_##S(i64 nk, i64 n, i64 m, const T* g, i64 gk, i64 gr,         \
                                    const T* idt, i64 ik, const T* t, T* p, int fused) {      \
    with(fused, [&](auto f) {                                                                  \
      with(idt, [&](auto id) { slope<f(), id(), T>(nk, n, m, g, gk, gr, idt, ik, t, p); });   \
    });                                                                                        \
  }                                                                                            \
  extern "C" void mdt_fit_sweep_back_##S(i64 nk, i64 n, i64 m, int skip, const T* pbar,       \
                                         const T* t, const T* g, i64 gk, i64 gr, const T* idt, \
                                         i64 ik, const T* gbar, T* ru, T* t_extra, T* gnext,   \
                                         int fused) {                                          \
    with(fused, [&](auto f) {                                                                  \
      with(idt, [&](auto id) {                                                                 \
        with(skip != 0, [&](auto xs) {                                                         \
          sweep_back<f(), id(), xs(), T>(nk, n, m, skip, pbar, t, g, gk, gr, idt, ik, gbar,   \
                                         ru, t_extra, gnext);                                  \
        });                                                                                    \
      });                                                                                      \
    });                                                                                        \
  }                                                                                            \
  extern "C" void mdt_fit_forward_back_##S(i64 nk, i64 n, i64 m, const T* ybar, const T* t,   \
                                           const T* idt, i64 ik, const T* t_extra, T* yt,      \
                                           T* abar, int fused) {                               \
    with(fused, [&](auto f) {                                                                  \
      with(idt, [&](auto id) {                                                                 \
        with(t_extra, [&](auto e) {                                                            \
          forward_back<f(), id(), e(), T>(nk, n, m, ybar, t, idt, ik, t_extra, yt, abar);     \
        });                                                                                    \
      });                                                                                      \
    });                                                                                        \
  }

MDT_FITTING(f32, float)
MDT_FITTING(f64, double)
