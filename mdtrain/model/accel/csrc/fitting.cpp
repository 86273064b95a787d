// The compiled float32 fitting node (mdtrain/model/accel/fitting_compiled.py loads it): the
// atomic energies and dE/dD of one tanh net per atom type, and in the backward dL/dD and every
// parameter's gradient. The maths is that of fitting_sweep.py (sweep and reverse, documented
// there), which the tests compare against; the roundings differ in the last bits (float32
// only: float64 keeps the PyTorch node).
//
// Execution: one OpenMP region per call (torch's runtime), single-threaded BLAS inside it.
// The rows (all atoms of all frames, grouped by type) are split evenly over the threads, both
// types together; each thread takes its rows through every layer with fused elementwise loops
// (forward: the net, its output and the gradient sweep; backward: the reverse of the sweep and
// of the net). After one barrier, the weight gradients (sums over rows) are split by output
// columns, so no thread waits on another's partial sums.
//
// Layouts (float32, row-major). lay: per hidden layer (n_in, n_out, skip, has idt); the output
// layer is (n_L, 1). params: per type, per hidden layer W (n_in, n_out), b (n_out)[, idt
// (n_out)], then W_out (n_L), b_out (1); grads: one flat array in the same order. Rows:
// counts[c] per type, in type order; order[r]: row r's place in (frame·N + atom). The tape
// (Fit's offsets; its size per row from mdt_fit_tape_per_row): per hidden layer k its input
// rows X_k with the backward's ḡ_k beside them (2R rows, see Fit::X), T_k, the backward's ā_k
// beside P_k (2R rows), G_k = g_(k+1) (all but the last layer); X_L, the output layer's input.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "blas.h"
#include "status.h"
#include "tanh.h"

namespace {

using i64 = std::int64_t;
using f32 = float;

// Row-major C (m×n) = op(A)·op(B) + beta·C (blas.h's gemm, alpha 1), C = beta·C for no rows.
void product(bool ta, bool tb, int m, int n, int k, const f32* a, int lda, const f32* b,
             int ldb, f32 beta, f32* c, int ldc) {
  if (k == 0) {
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : c[i * ldc + j];
    return;
  }
  gemm(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
}

// The layout, the parameters of each type and the tape's arrays.
struct Fit {
  int L;
  std::vector<int> ni, no, skip, idt;
  int ntypes;
  std::vector<i64> first;  // each type's first row, and R last
  const i64* order;
  i64 R;
  std::vector<int> poff;  // per layer (L + 1: the output layer) its first parameter of a net
  int per_net;
  std::vector<i64> goff;  // the flat gradient's offset of each parameter
  const f32* const* params;
  // tape arrays: offsets of X_k (k ≤ L), T_k, P_k, G_k, and its floats
  std::vector<i64> x, t, p, g;
  i64 size;

  Fit(int layers, const int* lay, int types, const i64* counts, const i64* ord, void* const* pr)
      : L(layers), ntypes(types), order(ord), params(reinterpret_cast<const f32* const*>(pr)) {
    for (int k = 0; k < L; ++k) {
      ni.push_back(lay[4 * k]);
      no.push_back(lay[4 * k + 1]);
      skip.push_back(lay[4 * k + 2]);
      idt.push_back(lay[4 * k + 3]);
    }
    first.push_back(0);
    for (int c = 0; c < ntypes; ++c) first.push_back(first.back() + counts[c]);
    R = first.back();
    poff.push_back(0);
    for (int k = 0; k < L; ++k) poff.push_back(poff.back() + (idt[k] ? 3 : 2));
    per_net = poff.back() + 2;
    goff.push_back(0);
    for (int c = 0; c < ntypes; ++c) {
      for (int k = 0; k < L; ++k) {
        goff.push_back(goff.back() + i64(ni[k]) * no[k]);
        goff.push_back(goff.back() + no[k]);
        if (idt[k]) goff.push_back(goff.back() + no[k]);
      }
      goff.push_back(goff.back() + no[L - 1]);
      goff.push_back(goff.back() + 1);
    }
    i64 at = 2 * R * ni[0];
    x.push_back(0);
    for (int k = 0; k < L; ++k) {
      t.push_back(at);
      at += R * no[k];
      x.push_back(at);
      at += (k + 1 < L ? 2 : 1) * R * no[k];
      p.push_back(at);
      at += 2 * R * no[k];
      g.push_back(at);
      if (k + 1 < L) at += R * no[k];
    }
    size = at;
  }
  // Per hidden layer, each type's rows of X_k then of its cotangent ḡ_k (the backward's),
  // and of ā_k (the backward's) then of P_k: one product gives W̄ = X_kᵀā_k + ḡ_kᵀP_k.
  // Pointers to row s (in type order) of type c.
  f32* X(f32* tape, int k, int c, i64 s) const {
    return tape + x[k] + (k < L ? s + first[c] : s) * (k < L ? ni[k] : no[L - 1]);
  }
  f32* GB(f32* tape, int k, int c, i64 s) const { return tape + x[k] + (s + first[c + 1]) * ni[k]; }
  f32* AB(f32* tape, int k, int c, i64 s) const { return tape + p[k] + (s + first[c]) * no[k]; }
  f32* P(f32* tape, int k, int c, i64 s) const { return tape + p[k] + (s + first[c + 1]) * no[k]; }
  const f32* W(int c, int k) const { return params[c * per_net + poff[k]]; }
  const f32* B(int c, int k) const { return params[c * per_net + poff[k] + 1]; }
  const f32* I(int c, int k) const {
    return k < L && idt[k] ? params[c * per_net + poff[k] + 2] : nullptr;
  }
  i64 grad_at(int c, int k, int j) const { return goff[c * per_net + poff[k] + j]; }
  int widest() const {
    int w = ni[0];
    for (int k = 0; k < L; ++k) w = std::max(w, no[k]);
    return w;
  }
  // The rows of each of `parts` threads (bounds, parts + 1): equal shares of the rows, where
  // a thread that also takes rows of another type counts kPackRows more: each of its products
  // then packs two weight matrices (MKL copies W into its own layout per call, about as long
  // as that many rows of the 1600 × 240 product).
  std::vector<i64> split(int parts) const {
    const i64 kPackRows = 12;
    std::vector<i64> at(ntypes + 1);  // each type's first row on an axis with the extra rows
    for (int c = 0; c <= ntypes; ++c) at[c] = first[c] + kPackRows * std::max(0, std::min(c, ntypes - 1));
    const i64 total = at[ntypes];
    std::vector<i64> bounds(parts + 1, R);
    bounds[0] = 0;
    for (int v = 1; v < parts; ++v) {
      const i64 x = total * v / parts;
      int c = 0;
      while (c + 1 < ntypes && at[c + 1] <= x) ++c;
      bounds[v] = std::min(first[c + 1], first[c] + std::max(i64(0), x - at[c]));
      bounds[v] = std::max(bounds[v], bounds[v - 1]);
    }
    return bounds;
  }
  // fn(type, first row, rows) for the part of [lo, hi) in each type
  template <typename F>
  void segments(i64 lo, i64 hi, F fn) const {
    for (int c = 0; c < ntypes; ++c) {
      const i64 s = std::max(lo, first[c]), e = std::min(hi, first[c + 1]);
      if (e > s) fn(c, s, int(e - s));
    }
  }
};

inline i64 part(i64 n, int j, int team) { return n * j / team; }

// y's fold through a skip into a layer's input side: dst (n × ni) = fold(src (n × no)); false
// where there is no skip.
bool fold_into(const f32* src, int n, int ni, int no, int skip, f32* dst) {
  if (skip == 0) return false;
  for (int i = 0; i < n; ++i) {
    const f32* s = src + i64(i) * no;
    f32* d = dst + i64(i) * ni;
    if (skip == 1)
      for (int j = 0; j < ni; ++j) d[j] = s[j];
    else
      for (int j = 0; j < ni; ++j) d[j] = s[j] + s[j + ni];
  }
  return true;
}

void forward_rows(const Fit& F, f32* tape, int c, i64 s, int n, const f32* D, i64 dim,
                  double* energies, f32* grad_out, f32* gbuf) {
  const int L = F.L;
  f32* x0 = F.X(tape, 0, c, s);
  for (int i = 0; i < n; ++i) {
    const f32* src = D + F.order[s + i] * dim;
    std::copy(src, src + dim, x0 + i * dim);
  }
  for (int k = 0; k < L; ++k) {
    const int ni = F.ni[k], no = F.no[k], sk = F.skip[k];
    const f32* xk = F.X(tape, k, c, s);
    f32* tk = tape + F.t[k] + s * no;
    f32* yk = F.X(tape, k + 1, c, s);
    product(false, false, n, no, ni, xk, ni, F.W(c, k), no, 0.0f, tk, no);
    const f32* b = F.B(c, k);
    const f32* id = F.I(c, k);
    for (int i = 0; i < n; ++i) {
      f32* ti = tk + i64(i) * no;
      f32* yi = yk + i64(i) * no;
      const f32* xi = xk + i64(i) * ni;
      for (int j = 0; j < no; ++j) ti[j] = tanh_of(ti[j] + b[j]);
      if (id)
        for (int j = 0; j < no; ++j) yi[j] = ti[j] * id[j];
      else
        std::copy(ti, ti + no, yi);
      if (sk == 1)
        for (int j = 0; j < no; ++j) yi[j] += xi[j];
      else if (sk == 2)
        for (int j = 0; j < no; ++j) yi[j] += xi[j < ni ? j : j - ni];
    }
  }
  const int nl = F.no[L - 1];
  const f32* xl = F.X(tape, L, c, s);
  const f32* wo = F.W(c, L);
  const f32 bo = F.B(c, L)[0];
  for (int i = 0; i < n; ++i) {
    f32 e = 0.0f;
    const f32* xi = xl + i64(i) * nl;
    for (int j = 0; j < nl; ++j) e += xi[j] * wo[j];
    energies[F.order[s + i]] = double(e + bo);
  }
  // the sweep: g_L = wᵀ, p = (g·idt)(1 − t²), g_k = p Wᵀ + fold(g_(k+1))
  for (int k = L - 1; k >= 0; --k) {
    const int ni = F.ni[k], no = F.no[k], sk = F.skip[k];
    const f32* tk = tape + F.t[k] + s * no;
    f32* pk = F.P(tape, k, c, s);
    const f32* gk = k + 1 < L ? tape + F.g[k] + s * no : nullptr;  // g_(k+1)
    const f32* id = F.I(c, k);
    for (int i = 0; i < n; ++i) {
      const f32* ti = tk + i64(i) * no;
      const f32* ui = gk ? gk + i64(i) * no : wo;
      f32* pi = pk + i64(i) * no;
      if (id)
        for (int j = 0; j < no; ++j) pi[j] = ui[j] * id[j] * (1.0f - ti[j] * ti[j]);
      else
        for (int j = 0; j < no; ++j) pi[j] = ui[j] * (1.0f - ti[j] * ti[j]);
    }
    f32* dst = k > 0 ? tape + F.g[k - 1] + s * ni : gbuf;
    bool folded = false;
    if (sk != 0) {
      if (gk) {
        folded = fold_into(gk, n, ni, no, sk, dst);
      } else {
        for (int i = 0; i < n; ++i)
          for (int j = 0; j < ni; ++j)
            dst[i64(i) * ni + j] = sk == 1 ? wo[j] : wo[j] + wo[j + ni];
        folded = true;
      }
    }
    product(false, true, n, ni, no, pk, no, F.W(c, k), no, folded ? 1.0f : 0.0f, dst, ni);
  }
  for (int i = 0; i < n; ++i) {
    const f32* src = gbuf + i64(i) * dim;
    std::copy(src, src + dim, grad_out + F.order[s + i] * dim);
  }
}

// Backward scratch, R rows each (ḡ_k and ā_k of the hidden layers are in the tape): ḡ_L
// (n_L), Q_k (n_out: the idt gradient's terms), e (1).
struct Scratch {
  std::vector<i64> q;
  i64 gl, e, size;
  explicit Scratch(const Fit& F) {
    gl = 0;
    i64 at = F.R * F.no[F.L - 1];
    for (int k = 0; k < F.L; ++k) {
      q.push_back(at);
      at += F.R * F.no[k];
    }
    e = at;
    size = at + F.R;
  }
};

struct Cotangents {
  const double* e;  // (nf, N) with strides, or null
  i64 natoms, es0, es1;
  const f32* g;  // (nf·N, dim) contiguous, or null
  f32* d;        // dL/dD (nf·N, dim), or null
};

void backward_rows(const Fit& F, f32* tape, const Scratch& S, f32* w, int c, i64 s, int n,
                   i64 dim, const Cotangents& in, f32* pb, f32* ya, f32* yb) {
  const int L = F.L;
  const bool has_g = in.g != nullptr;
  const f32* wo = F.W(c, L);
  if (has_g) {
    f32* g0 = F.GB(tape, 0, c, s);
    for (int i = 0; i < n; ++i) {
      const f32* src = in.g + F.order[s + i] * dim;
      std::copy(src, src + dim, g0 + i64(i) * dim);
    }
    for (int k = 0; k < L; ++k) {  // p̄ = ḡW, ḡ_(k+1) = unfold(ḡ) + p̄(1 − t²)·idt
      const int ni = F.ni[k], no = F.no[k], sk = F.skip[k];
      const f32* gk = F.GB(tape, k, c, s);
      product(false, false, n, no, ni, gk, ni, F.W(c, k), no, 0.0f, pb, no);
      const f32* tk = tape + F.t[k] + s * no;
      const f32* up = k + 1 < L ? tape + F.g[k] + s * no : nullptr;
      const f32* id = F.I(c, k);
      f32* gn = k + 1 < L ? F.GB(tape, k + 1, c, s) : w + S.gl + s * no;
      f32* ek = F.AB(tape, k, c, s);  // t·p̄·g·idt, until ā_k takes its place
      f32* qk = w + S.q[k] + s * no;
      for (int i = 0; i < n; ++i) {
        const f32* ti = tk + i64(i) * no;
        const f32* ui = up ? up + i64(i) * no : wo;
        const f32* pi = pb + i64(i) * no;
        const f32* gi = gk + i64(i) * ni;
        f32* ni_ = gn + i64(i) * no;
        f32* ei = ek + i64(i) * no;
        f32* qi = qk + i64(i) * no;
        for (int j = 0; j < no; ++j) {
          const f32 idj = id ? id[j] : 1.0f;
          const f32 r = pi[j] * (1.0f - ti[j] * ti[j]);
          qi[j] = r * ui[j];
          ei[j] = ti[j] * pi[j] * (ui[j] * idj);
          f32 v = r * idj;
          if (sk == 1) v += gi[j];
          if (sk == 2) v += gi[j < ni ? j : j - ni];
          ni_[j] = v;
        }
      }
    }
  }
  const int nl = F.no[L - 1];
  f32* es = w + S.e + s;
  for (int i = 0; i < n; ++i) {
    const i64 o = F.order[s + i];
    es[i] = in.e ? f32(in.e[(o / in.natoms) * in.es0 + (o % in.natoms) * in.es1]) : 0.0f;
    for (int j = 0; j < nl; ++j) ya[i64(i) * nl + j] = es[i] * wo[j];
  }
  for (int k = L - 1; k >= 0; --k) {  // ȳ of layer k's output in ya
    const int ni = F.ni[k], no = F.no[k], sk = F.skip[k];
    const f32* tk = tape + F.t[k] + s * no;
    const f32* id = F.I(c, k);
    f32* ak = F.AB(tape, k, c, s);
    f32* qk = w + S.q[k] + s * no;
    for (int i = 0; i < n; ++i) {
      const f32* ti = tk + i64(i) * no;
      const f32* yi = ya + i64(i) * no;
      f32* ai = ak + i64(i) * no;
      f32* qi = qk + i64(i) * no;
      for (int j = 0; j < no; ++j) {
        f32 tb = id ? yi[j] * id[j] : yi[j];
        if (has_g) {
          tb -= 2.0f * ai[j];
          qi[j] += yi[j] * ti[j];
        } else {
          qi[j] = yi[j] * ti[j];
        }
        ai[j] = tb * (1.0f - ti[j] * ti[j]);
      }
    }
    if (k == 0 && !in.d) break;
    const bool folded = fold_into(ya, n, ni, no, sk, yb);
    product(false, true, n, ni, no, ak, no, F.W(c, k), no, folded ? 1.0f : 0.0f, yb, ni);
    std::swap(ya, yb);
  }
  if (in.d)
    for (int i = 0; i < n; ++i) {
      const f32* src = ya + i64(i) * dim;
      std::copy(src, src + dim, in.d + F.order[s + i] * dim);
    }
}

// Column sums over a type's rows: out[j] (+)= Σ_i a[i·ld + j] for j in [c0, c1).
void column_sums(const f32* a, int n, int ld, int c0, int c1, bool add, f32* out) {
  if (!add) std::fill(out + c0, out + c1, 0.0f);
  for (int i = 0; i < n; ++i) {
    const f32* ai = a + i64(i) * ld;
    for (int j = c0; j < c1; ++j) out[j] += ai[j];
  }
}

// This thread's columns of every weight gradient (sums over each type's rows).
void weight_grads(const Fit& F, f32* tape, const Scratch& S, const f32* w, bool has_g,
                  bool has_e, f32* grads, int me, int team) {
  const int L = F.L;
  for (int c = 0; c < F.ntypes; ++c) {
    const i64 s = F.first[c];
    const int n = int(F.first[c + 1] - s);
    for (int k = 0; k < L; ++k) {
      const int ni = F.ni[k], no = F.no[k];
      const int c0 = int(part(no, me, team)), c1 = int(part(no, me + 1, team));
      if (c1 <= c0) continue;
      f32* wb = grads + F.grad_at(c, k, 0);
      const f32* ab = F.AB(tape, k, c, s);
      product(true, false, ni, c1 - c0, has_g ? 2 * n : n, F.X(tape, k, c, s), ni, ab + c0, no,
              0.0f, wb + c0, no);
      column_sums(ab, n, no, c0, c1, false, grads + F.grad_at(c, k, 1));
      if (F.idt[k]) column_sums(w + S.q[k] + s * no, n, no, c0, c1, false, grads + F.grad_at(c, k, 2));
    }
    const int nl = F.no[L - 1];
    const int c0 = int(part(nl, me, team)), c1 = int(part(nl, me + 1, team));
    f32* wo = grads + F.grad_at(c, L, 0);
    const f32* es = w + S.e + s;
    const f32* xl = F.X(tape, L, c, s);
    if (has_g) {
      column_sums(w + S.gl + s * nl, n, nl, c0, c1, false, wo);
    } else {
      std::fill(wo + c0, wo + c1, 0.0f);
    }
    for (int i = 0; i < n; ++i)
      for (int j = c0; j < c1; ++j) wo[j] += es[i] * xl[i64(i) * nl + j];
    if (me == 0 && has_e) {
      f32 total = 0.0f;
      for (int i = 0; i < n; ++i) total += es[i];
      grads[F.grad_at(c, L, 1)] = total;
    }
  }
}

}  // namespace

extern "C" {

// The tape's floats per row for this layout.
i64 mdt_fit_tape_per_row(int layers, const int* lay) {
  const i64 one = 1, zero = 0;
  return Fit(layers, lay, 1, &one, &zero, nullptr).size;
}

// D (nf·N, dim) → tape, energies (nf·N, float64), dE/dD (nf·N, dim); rows of no type untouched.
int mdt_fit_forward_f32(int layers, const int* lay, int types, const i64* counts,
                        const i64* order, void* const* params, const void* D, void* tape,
                        void* energies, void* grad, int threads) {
  return guarded([&] {
    const Fit F(layers, lay, types, counts, order, params);
    const i64 dim = F.ni[0];
    const std::vector<i64> bounds = F.split(threads);
    i64 most = 1;
    for (int v = 0; v < threads; ++v) most = std::max(most, bounds[v + 1] - bounds[v]);
    const std::unique_ptr<f32[]> gbuf(new f32[size_t(threads * most * dim)]);
    const SerialBlas serial;
#pragma omp parallel num_threads(threads)
    {
      const ThreadsScope scope;
      const int me = omp_get_thread_num(), team = omp_get_num_threads();
      f32* mine = gbuf.get() + me * most * dim;
      for (int v = me; v < threads; v += team)  // threads parts, whatever the team's size
        F.segments(bounds[v], bounds[v + 1], [&](int c, i64 s, int n) {
          forward_rows(F, static_cast<f32*>(tape), c, s, n, static_cast<const f32*>(D), dim,
                       static_cast<double*>(energies), static_cast<f32*>(grad), mine);
        });
    }
    return kOk;
  });
}

// The cotangents of the energies (double, strides es0/es1 over (nf, N); null: none) and of
// dE/dD (contiguous; null: none) → dL/dD (null: not wanted) and the flat parameter gradients
// (b_out's left untouched without an energy cotangent).
int mdt_fit_backward_f32(int layers, const int* lay, int types, const i64* counts,
                         const i64* order, void* const* params, void* tape,
                         const void* e_bar, i64 natoms, i64 es0, i64 es1, const void* g_bar,
                         void* d_bar, void* grads, int threads) {
  return guarded([&] {
    const Fit F(layers, lay, types, counts, order, params);
    const Scratch S(F);
    const Cotangents in{static_cast<const double*>(e_bar), natoms, es0, es1,
                        static_cast<const f32*>(g_bar), static_cast<f32*>(d_bar)};
    const i64 dim = F.ni[0];
    const std::vector<i64> bounds = F.split(threads);
    i64 most = 1;
    for (int v = 0; v < threads; ++v) most = std::max(most, bounds[v + 1] - bounds[v]);
    const i64 wide = F.widest();
    const std::unique_ptr<f32[]> work(new f32[size_t(S.size)]);
    const std::unique_ptr<f32[]> rows(new f32[size_t(threads * most * wide * 3)]);
    const SerialBlas serial;
#pragma omp parallel num_threads(threads)
    {
      const ThreadsScope scope;
      const int me = omp_get_thread_num(), team = omp_get_num_threads();
      f32* mine = rows.get() + me * most * wide * 3;
      for (int v = me; v < threads; v += team)
        F.segments(bounds[v], bounds[v + 1], [&](int c, i64 s, int n) {
          backward_rows(F, static_cast<f32*>(tape), S, work.get(), c, s, n, dim, in,
                        mine, mine + most * wide, mine + 2 * most * wide);
        });
#pragma omp barrier
      weight_grads(F, static_cast<f32*>(tape), S, work.get(), g_bar != nullptr,
                   e_bar != nullptr, static_cast<f32*>(grads), me, team);
    }
    return kOk;
  });
}
}
