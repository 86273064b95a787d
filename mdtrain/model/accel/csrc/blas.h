// The BLAS the compiled kernels call (csrc/embedding.cpp's mdt_set_blas sets it: torch's
// MKL, or an OpenBLAS with 64-bit integers when one is given), shared by every source of the
// library: the function types, the pointers (inline variables: one set for the library), the
// row-major product, and the scopes that keep a BLAS call on the calling thread inside the
// kernels' own parallel regions.

#pragma once

#include <cstdint>

using blas_i64 = std::int64_t;

typedef void (*dgemm_fn)(const char*, const char*, const int*, const int*, const int*,
                         const double*, const double*, const int*, const double*, const int*,
                         const double*, double*, const int*);
typedef void (*sgemm_fn)(const char*, const char*, const int*, const int*, const int*,
                         const float*, const float*, const int*, const float*, const int*,
                         const float*, float*, const int*);
typedef void (*dgemm64_fn)(const char*, const char*, const blas_i64*, const blas_i64*,
                           const blas_i64*, const double*, const double*, const blas_i64*,
                           const double*, const blas_i64*, const double*, double*,
                           const blas_i64*);
typedef void (*sgemm64_fn)(const char*, const char*, const blas_i64*, const blas_i64*,
                           const blas_i64*, const float*, const float*, const blas_i64*,
                           const float*, const blas_i64*, const float*, float*, const blas_i64*);
typedef int (*set_local_threads_fn)(int);
typedef void (*set_threads_fn)(int);
typedef int (*get_threads_fn)();

inline dgemm_fn g_dgemm = nullptr;
inline sgemm_fn g_sgemm = nullptr;
inline dgemm64_fn g_dgemm64 = nullptr;
inline sgemm64_fn g_sgemm64 = nullptr;
inline set_local_threads_fn g_set_local_threads = nullptr;  // a per-thread thread count (MKL)
inline set_threads_fn g_set_threads = nullptr;  // a process-wide thread count only (OpenBLAS)
inline get_threads_fn g_get_threads = nullptr;

// Row-major C (m×n) = alpha·op(A)·op(B) + beta·C through the column-major Fortran BLAS.
inline void gemm(bool ta, bool tb, int m, int n, int k, double alpha, const double* a, int lda,
                 const double* b, int ldb, double beta, double* c, int ldc) {
  if (m == 0 || n == 0) return;
  const char* opa = ta ? "T" : "N";
  const char* opb = tb ? "T" : "N";
  if (g_dgemm64) {
    const blas_i64 M = m, N = n, K = k, la = lda, lb = ldb, lc = ldc;
    g_dgemm64(opb, opa, &N, &M, &K, &alpha, b, &lb, a, &la, &beta, c, &lc);
  } else {
    g_dgemm(opb, opa, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
  }
}
inline void gemm(bool ta, bool tb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
  if (m == 0 || n == 0) return;
  const char* opa = ta ? "T" : "N";
  const char* opb = tb ? "T" : "N";
  if (g_sgemm64) {
    const blas_i64 M = m, N = n, K = k, la = lda, lb = ldb, lc = ldc;
    g_sgemm64(opb, opa, &N, &M, &K, &alpha, b, &lb, a, &la, &beta, c, &lc);
  } else {
    g_sgemm(opb, opa, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
  }
}

struct ThreadsScope {  // BLAS calls inside the parallel region run on their own thread
  int before = 0;
  ThreadsScope() {
    if (g_set_local_threads) before = g_set_local_threads(1);
  }
  ~ThreadsScope() {
    if (g_set_local_threads) g_set_local_threads(before);
  }
};

// A BLAS with only a process-wide thread count (OpenBLAS built with pthreads) runs on one
// thread while the kernels' own threads call it, then gets its setting back.
struct SerialBlas {
  int before = 0;
  SerialBlas() {
    if (g_set_threads) {
      before = g_get_threads();
      g_set_threads(1);
    }
  }
  ~SerialBlas() {
    if (g_set_threads) g_set_threads(before);
  }
};
