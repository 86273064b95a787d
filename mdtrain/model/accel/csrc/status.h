// What the kernels' entry points return, shared by every csrc/*.cpp (one library).
//
// An allocation failure (std::bad_alloc) must not terminate the process: inside a parallel
// region each thread catches it and raises a flag, since an exception cannot leave the region;
// the entry point then returns kOutOfMemory, which the Python side (kernels._check) raises as
// a recoverable out-of-memory error. Codes above kBadAxes are each file's own.
#pragma once

#include <new>

namespace {

constexpr int kOk = 0;
constexpr int kOutOfMemory = 1;
constexpr int kBadAxes = 2;  // a row width other than 4 (se_e2_a) or 2 (se_e2_r)

// f() with an allocation failure on the calling thread turned into kOutOfMemory.
template <typename F>
int guarded(F f) {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return kOutOfMemory;
  }
}

}  // namespace
