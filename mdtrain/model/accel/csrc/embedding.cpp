// Compiled kernels of the tanh embedding net (see mdtrain/model/accel/kernels.py and
// build.py, which build this file at first use; without it the fused PyTorch nodes run).
//
// The math is that of mdtrain/model/accel/embedding_nodes.py (the PyTorch path, which the tests
// compare against): per layer a = xW + b, t = tanh(a), y = t·idt + skip(x), carried forward together with
// the tangent dy/ds; T = Σ_j R̃_jᵀ G(s_j) per centre; and the backward of all of it w.r.t. the
// parameters (the row gradients, from G and dG/ds, are in row_grad.cpp; their cotangent comes
// back here as Z and T̄). The difference is the execution: OpenMP threads (torch's own runtime)
// each take whole blocks of centres through every layer, with single-threaded BLAS products and
// fused elementwise loops, so that a block stays in the core's cache and the two cores never wait
// on each other between operations.
//
// Layouts: rows R̃ of centre c, component a, slot j at R[c·rc + a·ra + j·rj], with A components
// (a template argument: 4 for se_e2_a's [s, s·x/r, s·y/r, s·z/r], 2 for se_e2_r's [s, 1], whose
// weight column makes T[1] = Σ_j G(s_j)); T and T̄ are (centres, A, M); the row gradients and
// their cotangent Z are (centres, n, A). The net's input s is component 0. The net runs on
// blocks of a plan (built in kernel_nodes.py): block b holds the centres order[start[b] : start[b+1]]
// and evaluates their first width[b] slots, as tape rows row0[b] + (centre's place in the
// block)·width[b] + slot. Centres sorted by neighbour count share blocks with others of nearly
// the same count, so few padded slots are evaluated; the slots past a block's width are padding
// for all its centres, and their share of T is added by the caller.

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "blas.h"
#include "status.h"
#include "tanh.h"

namespace {

using i64 = std::int64_t;

// f(std::integral_constant<int, A>) for the row widths the kernels are compiled for.
template <typename F>
int with_axes(int axes, F f) {
  if (axes == 4) return f(std::integral_constant<int, 4>{});
  if (axes == 2) return f(std::integral_constant<int, 2>{});
  return kBadAxes;
}


template <typename T>
struct Net {
  int layers;
  const int* n_in;
  const int* n_out;
  const int* skip;  // 0 none, 1 + x, 2 + concat(x, x)
  const T* const* w;
  const T* const* b;
  const T* const* idt;  // nullptr entries: no idt
  T* const* ts;         // tanh outputs
  T* const* outs;       // layer outputs y (may alias ts)
  T* const* douts;      // dy/ds
  T* const* das;        // da/ds (entry 0 unused: it is W itself)
};

template <typename T>
struct Rows {
  const T* p;
  i64 rc, ra, rj;
  T at(i64 c, int a, i64 j) const { return p[c * rc + a * ra + j * rj]; }
};

struct Plan {
  const i64* order;
  const i64* start;
  const i64* width;
  const i64* row0;
  i64 blocks;
  // Blocks are dealt to the threads in a snake order (0 1 1 0 0 1 ...): sorted blocks shrink
  // steadily, and the snake evens out the threads' shares. Fixed, so results repeat exactly.
  bool mine(i64 b, int me, int team) const {
    const i64 k = b % team;
    return ((b / team) % 2 ? team - 1 - k : k) == me;
  }
};

// Scratch that every use writes before reading: not zero-filled (std::vector would be).
template <typename T>
using Buffer = std::unique_ptr<T[]>;

template <typename T>
Buffer<T> buffer(i64 n) {
  return Buffer<T>(new T[size_t(n)]);
}

// A vector of 32 bytes (8 floats, 4 doubles): GCC's vector extension, which compiles to the
// widest registers -march=native gives (AVX2 here) and to pairs of narrower ones elsewhere.
template <typename T>
struct Vec {
  typedef T type __attribute__((vector_size(32)));
  static constexpr int n = 32 / sizeof(T);
};

// T (A, m) of one centre = Σ_j R̃_jᵀ G_j over its first w rows g (row stride m), with the A
// sums of a column stripe held in registers across j: each product is added in the order of
// the plain loop over j (the same roundings), without reading and writing T for every slot.
template <typename T, int A>
void contract_centre(const Rows<T>& R, i64 c, i64 w, const T* g, int m, T* out) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::n;
  int k0 = 0;
  for (; k0 + 2 * L <= m; k0 += 2 * L) {
    V acc[A][2] = {};
    for (i64 j = 0; j < w; ++j) {
      V g0, g1;
      std::memcpy(&g0, g + j * m + k0, sizeof(V));
      std::memcpy(&g1, g + j * m + k0 + L, sizeof(V));
      for (int a = 0; a < A; ++a) {
        const T r = R.at(c, a, j);
        acc[a][0] += r * g0;
        acc[a][1] += r * g1;
      }
    }
    for (int a = 0; a < A; ++a) std::memcpy(out + a * m + k0, acc[a], 2 * sizeof(V));
  }
  if (k0 == m) return;
  // the last columns as the plain loop does them (a scalar sum over j would round otherwise)
  for (int a = 0; a < A; ++a) std::fill(out + a * m + k0, out + (a + 1) * m, T(0));
  for (i64 j = 0; j < w; ++j) {
    const T* gj = g + j * m;
    for (int a = 0; a < A; ++a) {
      const T r = R.at(c, a, j);
      T* oa = out + a * m;
#pragma omp simd
      for (int k = k0; k < m; ++k) oa[k] += r * gj[k];
    }
  }
}

// The elementwise steps after tanh, in one place for the forward and for the backward, which
// repeats them for the layers whose outputs the tape does not keep (the same operations give
// the same bits): y = t·idt + skip(x), dy = da(1 − t²)·idt + skip(dx) of one row. Layer 0's
// input is s (one column, tangent 1) and its da is W itself.
template <typename T>
inline void first_outputs(const T* ti, const T* wt, const T* sc, T s, int no, int sk, T* yi,
                          T* dyi) {
#pragma omp simd
  for (int k = 0; k < no; ++k) {
    yi[k] = ti[k] * sc[k];
    dyi[k] = wt[k] * (T(1) - ti[k] * ti[k]) * sc[k];
  }
  if (sk != 0) {  // n_in == 1: the skip adds s, its tangent 1, to every output
    for (int k = 0; k < no; ++k) {
      yi[k] += s;
      dyi[k] += T(1);
    }
  }
}

template <typename T>
inline void layer_outputs(const T* ti, const T* dai, const T* sc, const T* xi, const T* dxi,
                          int ni, int no, int sk, T* yi, T* dyi) {
#pragma omp simd
  for (int k = 0; k < no; ++k) {
    yi[k] = ti[k] * sc[k];
    dyi[k] = dai[k] * (T(1) - ti[k] * ti[k]) * sc[k];
  }
  for (int rep = 0; rep < sk; ++rep) {  // skip 1: + x; skip 2: + x on each half
#pragma omp simd
    for (int k = 0; k < ni; ++k) {
      yi[rep * ni + k] += xi[k];
      dyi[rep * ni + k] += dxi[k];
    }
  }
}

// Where a layer's outputs y and dy/ds of one block go: the tape's rows, or (null entries of
// the tape: the layers before the last, which the backward recomputes) scratch.
template <typename T>
inline std::pair<T*, T*> outputs_of(const Net<T>& net, int l, i64 r0, T* y, T* dy) {
  const i64 at = r0 * net.n_out[l];
  return {net.outs[l] ? net.outs[l] + at : y, net.douts[l] ? net.douts[l] + at : dy};
}

// Per-thread scratch of the forward: the products' outputs, and two pairs (y, dy/ds) of
// layer outputs the tape does not keep (this layer's and its input's).
template <typename T>
struct ForwardScratch {
  Buffer<T> a, da, y[2], dy[2];
};

// One block through every layer (value and tangent), then T of each of its centres. The
// products write into the thread's scratch, which stays in cache, and the elementwise pass
// copies what the tape keeps: the products' zeroing of their output (β = 0) then touches
// cached memory instead of the tape's fresh pages.
template <typename T, int A>
void forward_block(const Net<T>& net, const Rows<T>& R, const Plan& P, i64 b, T* tmat,
                   const std::vector<T>& ones, ForwardScratch<T>& sc) {
  const i64 p0 = P.start[b], nb = P.start[b + 1] - p0, w = P.width[b], r0 = P.row0[b];
  const i64 nr = nb * w;
  const T *x = nullptr, *dx = nullptr;
  for (int l = 0; l < net.layers && nr > 0; ++l) {
    const int ni = net.n_in[l], no = net.n_out[l], sk = net.skip[l];
    const T* wt = net.w[l];
    const T* bias = net.b[l];
    const T* scale = net.idt[l] ? net.idt[l] : ones.data();
    T* t = net.ts[l] + r0 * no;
    const auto [y, dy] = outputs_of(net, l, r0, sc.y[l % 2].get(), sc.dy[l % 2].get());
    if (l == 0) {
      for (i64 q = 0; q < nb; ++q) {
        const i64 c = P.order[p0 + q];
        for (i64 j = 0; j < w; ++j) {
          const T s = R.at(c, 0, j);
          const i64 i = q * w + j;
          T* ti = t + i * no;
#pragma omp simd
          for (int k = 0; k < no; ++k) ti[k] = tanh_of(T(s * wt[k] + bias[k]));
          first_outputs(ti, wt, scale, s, no, sk, y + i * no, dy + i * no);
        }
      }
    } else {
      T* da = net.das[l] + r0 * no;
      T* pa = sc.a.get();
      T* pda = sc.da.get();
      gemm(false, false, int(nr), no, ni, T(1), x, ni, wt, no, T(0), pa, no);
      gemm(false, false, int(nr), no, ni, T(1), dx, ni, wt, no, T(0), pda, no);
      for (i64 i = 0; i < nr; ++i) {
        T* ti = t + i * no;
        T* dai = da + i * no;
        const T* ai = pa + i * no;
        const T* pdai = pda + i * no;
#pragma omp simd
        for (int k = 0; k < no; ++k) {
          ti[k] = tanh_of(T(ai[k] + bias[k]));
          dai[k] = pdai[k];
        }
        layer_outputs(ti, dai, scale, x + i * ni, dx + i * ni, ni, no, sk, y + i * no,
                      dy + i * no);
      }
    }
    x = y;
    dx = dy;
  }
  const int m = net.n_out[net.layers - 1];
  const T* g = net.outs[net.layers - 1] + r0 * m;
  for (i64 q = 0; q < nb; ++q)
    contract_centre<T, A>(R, P.order[p0 + q], w, g + q * w * m, m, tmat + P.order[p0 + q] * A * m);
}

// Per-thread scratch and parameter-gradient partials of the backward.
template <typename T>
struct Scratch {
  Buffer<T> gy, gdy, gx, gdx, abar, dabar;
  Buffer<T> inner;               // recomputed outputs of the layers before the last
  std::vector<const T*> xs, dxs;  // each layer's outputs y and dy/ds on the block's rows
  std::vector<T> grads;  // all parameters, in the order W, b[, idt] per layer
};

// The cotangents the backward starts from (any may be null): T̄_T (nc, A, M) of T; Ḡ, dḠ (tape
// rows, M) of G and dG/ds; and, in factored form from the row-gradient node, Z (nc, n, A) with
// T̄ (nc, A, M).
template <typename T>
struct Cotangents {
  const T* tbar_t;
  const T* gv;
  const T* gs;
  const T* z;
  const T* tbar;
  i64 n;  // slot columns of Z
};

// ȳ = R̃ᵀT̄_T + Z T̄ + Ḡ and dȳ = z₀(R̃ᵀT̄) + dḠ of one row i (centre c, slot j) on the
// columns [k0, k1), in the order of the plain loops (every term added to the running sum in
// turn); the caller's form of the sums held in registers must round the same way.
template <typename T, int A>
inline void entry_columns(const Rows<T>& R, const Cotangents<T>& in, i64 c, i64 j, i64 row, int m,
                          int k0, int k1, T* gyi, T* gdyi) {
  std::fill(gyi + k0, gyi + k1, T(0));
  std::fill(gdyi + k0, gdyi + k1, T(0));
  for (int a = 0; a < A; ++a) {
    const T r = R.at(c, a, j);
    if (in.tbar_t) {
      const T* ta = in.tbar_t + (c * A + a) * m;
#pragma omp simd
      for (int k = k0; k < k1; ++k) gyi[k] += r * ta[k];
    }
    if (in.z) {
      const T* zj = in.z + (c * in.n + j) * A;
      const T za = zj[a], zr = r * zj[0];
      const T* ta = in.tbar + (c * A + a) * m;
#pragma omp simd
      for (int k = k0; k < k1; ++k) {
        gyi[k] += za * ta[k];
        gdyi[k] += zr * ta[k];
      }
    }
  }
  if (in.gv) {
    const T* g = in.gv + row * m;
#pragma omp simd
    for (int k = k0; k < k1; ++k) gyi[k] += g[k];
  }
  if (in.gs) {
    const T* g = in.gs + row * m;
#pragma omp simd
    for (int k = k0; k < k1; ++k) gdyi[k] += g[k];
  }
}

// The same on the block's rows, the sums of each stripe of 2·(vector) columns in registers
// (the order of entry_columns: per component, T̄_T's term, then Z's; Ḡ and dḠ last).
template <typename T, int A>
void entry_cotangents(const Rows<T>& R, const Plan& P, i64 b, int m, const Cotangents<T>& in,
                      T* gy, T* gdy) {
  using V = typename Vec<T>::type;
  constexpr int L = Vec<T>::n;
  const int stripes = m / (2 * L);
  const i64 p0 = P.start[b], nb = P.start[b + 1] - p0, w = P.width[b], r0 = P.row0[b];
  for (i64 q = 0; q < nb; ++q) {
    const i64 c = P.order[p0 + q];
    const T* tt = in.tbar_t ? in.tbar_t + c * A * m : nullptr;
    const T* tb = in.z ? in.tbar + c * A * m : nullptr;
    for (i64 j = 0; j < w; ++j) {
      const i64 i = q * w + j;
      T* gyi = gy + i * m;
      T* gdyi = gdy + i * m;
      T r[A], za[A], zr[A];
      const T* zj = in.z ? in.z + (c * in.n + j) * A : nullptr;
      for (int a = 0; a < A; ++a) {
        r[a] = R.at(c, a, j);
        za[a] = zj ? zj[a] : T(0);
        zr[a] = zj ? r[a] * zj[0] : T(0);
      }
      const T* gv = in.gv ? in.gv + (r0 + i) * m : nullptr;
      const T* gs = in.gs ? in.gs + (r0 + i) * m : nullptr;
      for (int st = 0; st < stripes; ++st) {
        const int k = st * 2 * L;
        V y0 = {}, y1 = {}, d0 = {}, d1 = {};
        for (int a = 0; a < A; ++a) {
          V u0, u1;
          if (tt) {
            std::memcpy(&u0, tt + a * m + k, sizeof(V));
            std::memcpy(&u1, tt + a * m + k + L, sizeof(V));
            y0 += r[a] * u0;
            y1 += r[a] * u1;
          }
          if (tb) {
            std::memcpy(&u0, tb + a * m + k, sizeof(V));
            std::memcpy(&u1, tb + a * m + k + L, sizeof(V));
            y0 += za[a] * u0;
            y1 += za[a] * u1;
            d0 += zr[a] * u0;
            d1 += zr[a] * u1;
          }
        }
        V u0, u1;
        if (gv) {
          std::memcpy(&u0, gv + k, sizeof(V));
          std::memcpy(&u1, gv + k + L, sizeof(V));
          y0 += u0;
          y1 += u1;
        }
        if (gs) {
          std::memcpy(&u0, gs + k, sizeof(V));
          std::memcpy(&u1, gs + k + L, sizeof(V));
          d0 += u0;
          d1 += u1;
        }
        std::memcpy(gyi + k, &y0, sizeof(V));
        std::memcpy(gyi + k + L, &y1, sizeof(V));
        std::memcpy(gdyi + k, &d0, sizeof(V));
        std::memcpy(gdyi + k + L, &d1, sizeof(V));
      }
      if (stripes * 2 * L < m)
        entry_columns<T, A>(R, in, c, j, r0 + i, m, stripes * 2 * L, m, gyi, gdyi);
    }
  }
}

// The outputs y and dy/ds of the layers before the last on the block's rows (sc.xs, sc.dxs):
// the tape's, or, where the tape does not keep them, the forward's elementwise steps again
// from t, da/ds and s (no products) into sc.inner.
template <typename T>
void inner_outputs(const Net<T>& net, const Rows<T>& R, const Plan& P, i64 b,
                   const std::vector<T>& ones, Scratch<T>& sc) {
  const i64 p0 = P.start[b], nb = P.start[b + 1] - p0, w = P.width[b], r0 = P.row0[b];
  const i64 nr = nb * w;
  T* free = sc.inner.get();
  for (int l = 0; l + 1 < net.layers; ++l) {
    const int ni = net.n_in[l], no = net.n_out[l], sk = net.skip[l];
    if (net.outs[l] && net.douts[l]) {
      sc.xs[l] = net.outs[l] + r0 * no;
      sc.dxs[l] = net.douts[l] + r0 * no;
      continue;
    }
    const T* scale = net.idt[l] ? net.idt[l] : ones.data();
    const T* t = net.ts[l] + r0 * no;
    T* y = free;
    T* dy = free + nr * no;
    free += 2 * nr * no;
    if (l == 0) {
      for (i64 q = 0; q < nb; ++q) {
        const i64 c = P.order[p0 + q];
        for (i64 j = 0; j < w; ++j) {
          const i64 i = (q * w + j) * no;
          first_outputs(t + i, net.w[0], scale, R.at(c, 0, j), no, sk, y + i, dy + i);
        }
      }
    } else {
      const T* da = net.das[l] + r0 * no;
      for (i64 i = 0; i < nr; ++i)
        layer_outputs(t + i * no, da + i * no, scale, sc.xs[l - 1] + i * ni,
                      sc.dxs[l - 1] + i * ni, ni, no, sk, y + i * no, dy + i * no);
    }
    sc.xs[l] = y;
    sc.dxs[l] = dy;
  }
}

template <typename T>
void backward_block(const Net<T>& net, const Rows<T>& R, const Plan& P, i64 b,
                    const int* offsets, Scratch<T>& sc, const std::vector<T>& ones) {
  const i64 p0 = P.start[b], nb = P.start[b + 1] - p0, w = P.width[b], r0 = P.row0[b];
  const i64 nr = nb * w;
  inner_outputs(net, R, P, b, ones, sc);
  T* gy = sc.gy.get();
  T* gdy = sc.gdy.get();
  T* gx = sc.gx.get();
  T* gdx = sc.gdx.get();
  T* abar = sc.abar.get();
  T* dabar = sc.dabar.get();
  for (int l = net.layers - 1; l >= 0; --l) {
    const int ni = net.n_in[l], no = net.n_out[l], sk = net.skip[l];
    const T* wt = net.w[l];
    const T* idt = net.idt[l];
    const T* scale = idt ? idt : ones.data();
    const T* t = net.ts[l] + r0 * no;
    T* gw = sc.grads.data() + offsets[l];
    T* gb = gw + ni * no;
    T* gidt = idt ? gb + no : nullptr;
    for (i64 i = 0; i < nr; ++i) {
      const T* ti = t + i * no;
      const T* dai = l == 0 ? wt : net.das[l] + (r0 + i) * no;
      const T* gyi = gy + i * no;
      const T* gdyi = gdy + i * no;
      T* ai = abar + i * no;
      T* dai_bar = dabar + i * no;
      if (gidt) {
        for (int k = 0; k < no; ++k) {
          const T g = T(1) - ti[k] * ti[k];
          gidt[k] += gyi[k] * ti[k] + gdyi[k] * dai[k] * g;
        }
      }
#pragma omp simd
      for (int k = 0; k < no; ++k) {
        const T g = T(1) - ti[k] * ti[k];
        const T q = gyi[k] * scale[k], dq = gdyi[k] * scale[k];
        dai_bar[k] = dq * g;
        ai[k] = (q - T(2) * ti[k] * dai[k] * dq) * g;
      }
#pragma omp simd
      for (int k = 0; k < no; ++k) gb[k] += ai[k];
      if (l > 0) {  // fold(ȳ), fold(dȳ) of the row while it is in cache: the start of x̄, dx̄
        T* gxi = gx + i * ni;
        T* gdxi = gdx + i * ni;
        std::fill(gxi, gxi + ni, T(0));
        std::fill(gdxi, gdxi + ni, T(0));
        for (int rep = 0; rep < sk; ++rep) {
          const T* a = gyi + rep * ni;
          const T* d = gdyi + rep * ni;
#pragma omp simd
          for (int k = 0; k < ni; ++k) {
            gxi[k] += a[k];
            gdxi[k] += d[k];
          }
        }
      }
    }
    if (l == 0) {  // x = s, dx = 1; the inputs s get no gradient on this path
      for (i64 q = 0; q < nb; ++q) {
        const i64 c = P.order[p0 + q];
        for (i64 j = 0; j < w; ++j) {
          const T s = R.at(c, 0, j);
          const T* ai = abar + (q * w + j) * no;
          const T* di = dabar + (q * w + j) * no;
#pragma omp simd
          for (int k = 0; k < no; ++k) gw[k] += s * ai[k] + di[k];
        }
      }
      break;
    }
    const T* x = sc.xs[l - 1];
    const T* dx = sc.dxs[l - 1];
    gemm(true, false, ni, no, int(nr), T(1), x, ni, abar, no, T(1), gw, no);
    gemm(true, false, ni, no, int(nr), T(1), dx, ni, dabar, no, T(1), gw, no);
    // x̄ = ā Wᵀ + fold(ȳ), dx̄ = dā Wᵀ + fold(dȳ)
    gemm(false, true, int(nr), ni, no, T(1), abar, no, wt, no, T(1), gx, ni);
    gemm(false, true, int(nr), ni, no, T(1), dabar, no, wt, no, T(1), gdx, ni);
    std::swap(gy, gx);
    std::swap(gdy, gdx);
  }
}

int widest(const int* n_out, int layers) {
  int m = 1;
  for (int l = 0; l < layers; ++l) m = n_out[l] > m ? n_out[l] : m;
  return m;
}

// The tape rows of the plan's largest block.
i64 most_rows(const Plan& P) {
  i64 most = 0;
  for (i64 b = 0; b < P.blocks; ++b) {
    const i64 nr = (P.start[b + 1] - P.start[b]) * P.width[b];
    most = nr > most ? nr : most;
  }
  return most;
}

template <typename T>
Net<T> make_net(int layers, const int* n_in, const int* n_out, const int* skip, void* const* w,
                void* const* b, void* const* idt, void* const* ts, void* const* outs,
                void* const* douts, void* const* das) {
  return Net<T>{layers,
                n_in,
                n_out,
                skip,
                reinterpret_cast<const T* const*>(w),
                reinterpret_cast<const T* const*>(b),
                reinterpret_cast<const T* const*>(idt),
                reinterpret_cast<T* const*>(ts),
                reinterpret_cast<T* const*>(outs),
                reinterpret_cast<T* const*>(douts),
                reinterpret_cast<T* const*>(das)};
}

template <typename T, int A>
int forward(const Rows<T>& R, const Net<T>& net, const Plan& P, void* tmat, int threads) {
  const SerialBlas serial;
  const int width = widest(net.n_out, net.layers);
  const std::vector<T> ones(width, T(1));
  const i64 rows_max = most_rows(P);
  // every thread's scratch from the calling thread's heap, which keeps freed memory for the
  // next call (see mdtrain.heap), not from a worker's arena
  std::vector<ForwardScratch<T>> scratch(threads);
  for (auto& sc : scratch)
    for (auto* v : {&sc.a, &sc.da, &sc.y[0], &sc.y[1], &sc.dy[0], &sc.dy[1]})
      *v = buffer<T>(rows_max * width);
  std::atomic<bool> failed{false};
#pragma omp parallel num_threads(threads)
  {
    ThreadsScope scope;
    const int me = omp_get_thread_num(), team = omp_get_num_threads();
    try {
      for (i64 b = 0; b < P.blocks && !failed; ++b)
        if (P.mine(b, me, team))
          forward_block<T, A>(net, R, P, b, static_cast<T*>(tmat), ones, scratch[me]);
    } catch (const std::bad_alloc&) {
      failed = true;
    }
  }
  return failed ? kOutOfMemory : kOk;
}

template <typename T, int A>
int backward(const Rows<T>& R, const Net<T>& net, const Plan& P, const Cotangents<T>& in,
             void* const* grads, int threads) {
  const SerialBlas serial;
  const int m = net.n_out[net.layers - 1];
  const int width = widest(net.n_out, net.layers);
  const std::vector<T> ones(width, T(1));
  std::vector<int> offsets(net.layers + 1, 0);
  for (int l = 0; l < net.layers; ++l)
    offsets[l + 1] =
        offsets[l] + net.n_in[l] * net.n_out[l] + net.n_out[l] * (net.idt[l] ? 2 : 1);
  const i64 rows_max = most_rows(P);
  i64 inner = 0;  // the recomputed layers' two outputs per row
  for (int l = 0; l + 1 < net.layers; ++l)
    inner += net.outs[l] && net.douts[l] ? 0 : 2 * net.n_out[l];
  std::vector<Scratch<T>> scratch(threads);  // from the calling thread's heap (see forward)
  for (auto& sc : scratch) {
    sc.grads.assign(offsets[net.layers], T(0));
    for (auto* v : {&sc.gy, &sc.gdy, &sc.gx, &sc.gdx, &sc.abar, &sc.dabar})
      *v = buffer<T>(rows_max * width);
    if (inner > 0) sc.inner = buffer<T>(rows_max * inner);
    sc.xs.assign(net.layers, nullptr);
    sc.dxs.assign(net.layers, nullptr);
  }
  std::atomic<bool> failed{false};
#pragma omp parallel num_threads(threads)
  {
    ThreadsScope scope;
    const int me = omp_get_thread_num(), team = omp_get_num_threads();
    Scratch<T>& sc = scratch[me];
    try {
      for (i64 b = 0; b < P.blocks && !failed; ++b) {
        if (!P.mine(b, me, team) || P.width[b] == 0) continue;
        entry_cotangents<T, A>(R, P, b, m, in, sc.gy.get(), sc.gdy.get());
        backward_block(net, R, P, b, offsets.data(), sc, ones);
      }
    } catch (const std::bad_alloc&) {
      failed = true;
    }
  }
  if (failed) return kOutOfMemory;  // the gradients are left untouched
  // Partials summed in thread order: the same result for the same thread count.
  for (int l = 0; l < net.layers; ++l) {
    const int sizes[3] = {net.n_in[l] * net.n_out[l], net.n_out[l], net.idt[l] ? net.n_out[l] : 0};
    int at = offsets[l];
    for (int p = 0; p < 3; ++p) {
      T* out = static_cast<T*>(grads[3 * l + p]);
      for (int th = 0; th < threads && out; ++th) {
        const T* part = scratch[th].grads.data() + at;
        for (int k = 0; k < sizes[p]; ++k) out[k] += part[k];
      }
      at += sizes[p];
    }
  }
  return kOk;
}

// The padded slots' share of T (kernel_nodes._PaddedShare), with the roundings of the PyTorch
// operations it replaces (terms = R̃ᵀG per padded row, then flip, cumsum, flip, a gather):
// each product rounded to T, the running sums in torch's CPU accumulator (double) and each
// partial sum rounded to T. No contraction of a product into a sum here (an FMA rounds once).
#pragma STDC FP_CONTRACT OFF
template <typename T>
__attribute__((optimize("fp-contract=off"))) void padded_share_forward(
    const T* rows, const T* g, i64 types, i64 cols, int A, int m, const i64* first,
    const i64* kind, i64 nc, T* out) {
  // S[τ, k] = Σ_{k' ≥ k} R̃[τ, k']ᵀ G[τ, k'], summed from the right; then out[c] = S[kind, first]
  Buffer<T> sums = buffer<T>(types * cols * A * m);
  std::vector<double> acc(m);
  for (i64 t = 0; t < types; ++t) {
    for (int a = 0; a < A; ++a) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (i64 k = cols - 1; k >= 0; --k) {
        const T r = rows[(t * cols + k) * A + a];
        const T* gk = g + (t * cols + k) * m;
        T* sk = sums.get() + ((t * cols + k) * A + a) * m;
        for (int j = 0; j < m; ++j) {
          const T term = r * gk[j];
          acc[j] += double(term);
          sk[j] = T(acc[j]);
        }
      }
    }
  }
  for (i64 c = 0; c < nc; ++c) {
    T* oc = out + c * A * m;
    if (first[c] >= cols) {
      std::fill(oc, oc + A * m, T(0));
    } else {
      const T* sk = sums.get() + (kind[c] * cols + first[c]) * A * m;
      std::copy(sk, sk + A * m, oc);
    }
  }
}

// Its backward up to the products' cotangent: index_select's (the centres' cotangents added
// into their (type, first column) rows in centre order, in T), then the reversed cumulative
// sum's (a prefix sum over the columns, accumulated in double), into terms (types, cols, A, m).
template <typename T>
void padded_share_backward(const T* grad, const i64* first, const i64* kind, i64 nc, i64 types,
                           i64 cols, int A, int m, T* terms) {
  const i64 row = i64(A) * m;
  std::fill(terms, terms + types * cols * row, T(0));
  for (i64 c = 0; c < nc; ++c) {
    if (first[c] >= cols) continue;
    T* dst = terms + (kind[c] * cols + first[c]) * row;
    const T* src = grad + c * row;
    for (i64 j = 0; j < row; ++j) dst[j] += src[j];
  }
  std::vector<double> acc(row);
  for (i64 t = 0; t < types; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (i64 k = 0; k < cols; ++k) {
      T* tk = terms + (t * cols + k) * row;
      for (i64 j = 0; j < row; ++j) {
        acc[j] += double(tk[j]);
        tk[j] = T(acc[j]);
      }
    }
  }
}
#pragma STDC FP_CONTRACT ON

}  // namespace

extern "C" {

int mdt_abi_version() { return 9; }

// dgemm/sgemm: Fortran BLAS entry points; ilp64: whether they take 64-bit integers;
// set_local_threads: the library's per-thread thread count (returns the previous one), or null;
// set_threads/get_threads: its process-wide thread count, or null.
void mdt_set_blas(void* dgemm, void* sgemm, int ilp64, void* set_local_threads,
                  void* set_threads, void* get_threads) {
  g_set_threads = reinterpret_cast<set_threads_fn>(set_threads);
  g_get_threads = reinterpret_cast<get_threads_fn>(get_threads);
  g_dgemm = ilp64 ? nullptr : reinterpret_cast<dgemm_fn>(dgemm);
  g_sgemm = ilp64 ? nullptr : reinterpret_cast<sgemm_fn>(sgemm);
  g_dgemm64 = ilp64 ? reinterpret_cast<dgemm64_fn>(dgemm) : nullptr;
  g_sgemm64 = ilp64 ? reinterpret_cast<sgemm64_fn>(sgemm) : nullptr;
  g_set_local_threads = reinterpret_cast<set_local_threads_fn>(set_local_threads);
}

// Let every thread of the kernels' team take its BLAS working buffer now, all at once, while
// memory is free: an OpenBLAS that cannot allocate one later calls exit() (no error code),
// and it keeps the buffers it made for reuse. The products are large enough to need a buffer
// and start together after a barrier, so each thread holds one at the same time.
int mdt_reserve_blas(int threads) {
  return guarded([&] {
    const SerialBlas serial;
    const int n = 256;
    std::vector<double> a(size_t(threads) * 3 * n * n, 1e-3);
    std::vector<float> f(size_t(threads) * 3 * n * n, 1e-3f);
#pragma omp parallel num_threads(threads)
    {
      ThreadsScope scope;
      const size_t me = size_t(omp_get_thread_num()) * 3 * n * n;
#pragma omp barrier
      for (int round = 0; round < 2; ++round) {
        gemm(false, false, n, n, n, 1.0, &a[me], n, &a[me + n * n], n, 0.0, &a[me + 2 * n * n], n);
        gemm(false, false, n, n, n, 1.0f, &f[me], n, &f[me + n * n], n, 0.0f, &f[me + 2 * n * n], n);
      }
    }
    return kOk;
  });
}

#define MDT_ROWS_ARGS const void *rows, i64 rc, i64 ra, i64 rj, int axes
#define MDT_ROWS(T) Rows<T>{static_cast<const T*>(rows), rc, ra, rj}
#define MDT_PLAN_ARGS const i64 *order, const i64 *start, const i64 *width, const i64 *row0, i64 blocks
#define MDT_PLAN Plan{order, start, width, row0, blocks}
#define MDT_NET_ARGS                                                                         \
  int layers, const int *n_in, const int *n_out, const int *skip, void *const *w,            \
      void *const *b, void *const *idt, void *const *ts, void *const *outs, void *const *douts, \
      void *const *das
#define MDT_NET(T) make_net<T>(layers, n_in, n_out, skip, w, b, idt, ts, outs, douts, das)
// the kernel instance for the row width ``axes`` (A in the body)
#define MDT_AXES(body) with_axes(axes, [&](auto axes_c) { constexpr int A = decltype(axes_c)::value; return body; })

#define MDT_EXPORT(T, suffix)                                                                 \
  int mdt_embed_forward_##suffix(MDT_ROWS_ARGS, MDT_NET_ARGS, MDT_PLAN_ARGS, void* tmat,      \
                                 int threads) {                                               \
    return guarded([&] {                                                                      \
      return MDT_AXES((forward<T, A>(MDT_ROWS(T), MDT_NET(T), MDT_PLAN, tmat, threads)));     \
    });                                                                                       \
  }                                                                                           \
  int mdt_embed_backward_##suffix(MDT_ROWS_ARGS, MDT_NET_ARGS, MDT_PLAN_ARGS, i64 n,          \
                                  const void* tbar_t, const void* gv, const void* gs,         \
                                  const void* z, const void* tbar, void* const* grads,        \
                                  int threads) {                                              \
    const Cotangents<T> in{static_cast<const T*>(tbar_t), static_cast<const T*>(gv),          \
                           static_cast<const T*>(gs),     static_cast<const T*>(z),           \
                           static_cast<const T*>(tbar),   n};                                 \
    return guarded([&] {                                                                      \
      return MDT_AXES((backward<T, A>(MDT_ROWS(T), MDT_NET(T), MDT_PLAN, in, grads, threads))); \
    });                                                                                       \
  }

MDT_EXPORT(double, f64)
MDT_EXPORT(float, f32)

#define MDT_SHARE_EXPORT(T, suffix)                                                           \
  int mdt_padded_share_##suffix(const void* rows, const void* g, i64 types, i64 cols, int axes, \
                                int m, const i64* first, const i64* kind, i64 nc, void* out) {  \
    return guarded([&] {                                                                      \
      padded_share_forward<T>(static_cast<const T*>(rows), static_cast<const T*>(g), types,   \
                              cols, axes, m, first, kind, nc, static_cast<T*>(out));          \
      return kOk;                                                                             \
    });                                                                                       \
  }                                                                                           \
  int mdt_padded_share_backward_##suffix(const void* grad, const i64* first, const i64* kind, \
                                         i64 nc, i64 types, i64 cols, int axes, int m,        \
                                         void* terms) {                                       \
    return guarded([&] {                                                                      \
      padded_share_backward<T>(static_cast<const T*>(grad), first, kind, nc, types, cols,     \
                               axes, m, static_cast<T*>(terms));                              \
      return kOk;                                                                             \
    });                                                                                       \
  }

MDT_SHARE_EXPORT(double, f64)
MDT_SHARE_EXPORT(float, f32)
}
