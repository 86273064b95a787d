// The pair vectors of the explicit backends in one pass (see mdtrain/model/accel/pair_vectors.py,
// which loads it, and mdtrain/model/conservative.py's pair_vectors, the torch operations it
// replaces and is tested against).
//
// d[f, i, s, c] = (x[f, j, c] - x[f, i, c]) + ((k0·b[f, 0, c] + k1·b[f, 1, c]) + k2·b[f, 2, c])
// with j = max(nlist[f, i, s], 0) and k = shift[f, i, s, :]: the gather, the subtraction, the
// batched product shift·cell (a sum over three terms, each product rounded, then added in that
// order: measured bit for bit against torch.bmm) and the addition, each rounded once as torch
// rounds them. No contraction into FMAs.
//
// Layouts: x (nf, N, 3) float64; cell (nf, 3, 3) float64 or null (no periodic images: the
// vectors are the differences alone); nlist (nf, N, S) int64; shift (nf, N, S, 3) float64;
// out (nf, N, S, 3) float64. Every array contiguous.

#pragma GCC optimize("fp-contract=off")

#include <omp.h>

#include <cstdint>

namespace {

using i64 = std::int64_t;

void vectors_row(i64 natoms, i64 nnei, i64 row, const double* __restrict x,
                 const double* __restrict cell, const i64* __restrict nl,
                 const double* __restrict shift, double* __restrict out) {
  const i64 f = row / natoms;
  const double* xf = x + f * natoms * 3;
  const double* xi = x + row * 3;
  const i64* nrow = nl + row * nnei;
  double* orow = out + row * nnei * 3;
  if (cell == nullptr) {
    for (i64 s = 0; s < nnei; ++s) {
      const i64 j = nrow[s] < 0 ? 0 : nrow[s];
      for (int c = 0; c < 3; ++c) orow[s * 3 + c] = xf[j * 3 + c] - xi[c];
    }
    return;
  }
  const double* b = cell + f * 9;
  const double* krow = shift + row * nnei * 3;
  for (i64 s = 0; s < nnei; ++s) {
    const i64 j = nrow[s] < 0 ? 0 : nrow[s];
    const double* k = krow + s * 3;
    for (int c = 0; c < 3; ++c) {
      const double p0 = k[0] * b[c];
      const double p1 = k[1] * b[3 + c];
      const double p2 = k[2] * b[6 + c];
      const double image = (p0 + p1) + p2;
      const double d = xf[j * 3 + c] - xi[c];
      orow[s * 3 + c] = d + image;
    }
  }
}

}  // namespace

extern "C" {

// rows = nf·N; threads: torch's count, used only above ATen's elementwise grain.
int mdt_pair_vectors_f64(i64 rows, i64 natoms, i64 nnei, const double* x, const double* cell,
                         const i64* nl, const double* shift, double* out, int threads) {
  if (rows <= 0 || nnei <= 0) return 0;
  const bool split = threads > 1 && rows * nnei * 3 >= 32768;
#pragma omp parallel for num_threads(threads) schedule(static) if (split)
  for (i64 row = 0; row < rows; ++row) {
    vectors_row(natoms, nnei, row, x, cell, nl, shift, out);
  }
  return 0;
}

}  // extern "C"
