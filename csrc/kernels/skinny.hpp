// A float32 product for the few rows of a verify forward: Y [M, N] = X [M, K] . W^T, with W
// [N, K] packed once into panels of 16 outputs (`skinny_pack`: K x 16 floats each, zero-padded).
// Each panel is read from memory once per call and multiplied into several rows held in
// registers (AVX-512: 8 rows x 3 panels), so a tree of a few tokens costs about the weights'
// read, which is what a CPU's verify forward of a small model is bound by (at one thread on an
// AVX-512 CPU it beats oneDNN's prepacked product for the few rows of a verify forward; the form
// chooser in model/kernels.py decides per machine). Every output is one sum over k in
// order, with fused multiply-adds where the ISA has them: a row's values do not depend on the
// other rows (nor on M).
//
// Three kernels: AVX-512 and AVX2 in intrinsics (skinny_avx512.cpp, skinny_avx2.cpp, each
// compiled with its own -m flags and run only where the CPU has them), and the compiler's
// default (skinny_kernel.inc in skinny_generic.cpp, vector extensions: the reference the tests
// compare the others with). `skinny_linear` runs the widest this CPU supports (`skinny_isa`).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/topk.hpp"

namespace lookupdec {

constexpr int kPanel = 16;  // outputs per panel

// Panels of `w` [n, k] into `panels` (ceil(n / 16) * k * 16 floats).
void skinny_pack(const float* w, int64_t n, int64_t k, float* panels);

// `y` [m, n] (row stride ldy) = `x` [m, k] (row stride ldx) . W^T, W packed by skinny_pack;
// `isa` (null: the widest) names one of skinny_isas(). Split over skinny_threads(n) OpenMP
// threads, each a run of whole panels: the outputs are the same whatever the thread count.
void skinny_linear(const float* x, int64_t ldx, int64_t m, int64_t k, const float* panels, int64_t n, float* y,
                   int64_t ldy, const char* isa = nullptr);

// Threads the skinny product of n outputs runs on: OpenMP's count for this thread (torch's
// intra-op threads: torch.set_num_threads sets it), at most one per kMinThreadPanels panels, and
// 1 inside a parallel region or where the core was built without OpenMP.
constexpr int64_t kMinThreadPanels = 4;
int skinny_threads(int64_t n);
// At most `cap` threads from now on (1: the one-thread product), e.g. where the core's OpenMP
// runtime is not torch's (model/kernels.py checks).
void set_skinny_thread_cap(int cap);

// skinny_linear, and each row's top_k output indices (lookupdec::row_topk of the row: NaNs
// first, then values descending, ties by index) into tops [m, top_k], 1 <= top_k <= n: the
// output projection's rows picked from as the kernel stores them (the maximum of each row's
// block of outputs compared with the row's floor while in registers; the few that beat it
// are added), not read back from memory by the greedy walk. weight_bound: max |w| (NaN or
// inf where w is not finite); a row whose outputs could be NaN or inf by it (and its inputs)
// is scanned whole after the product instead.
void skinny_linear_tops(const float* x, int64_t ldx, int64_t m, int64_t k, const float* panels, int64_t n, float* y,
                        int64_t ldy, int32_t top_k, int32_t* tops, float weight_bound, const char* isa = nullptr);

// The instruction set skinny_linear runs: "avx512", "avx2" or "generic"; and every one this CPU runs.
const char* skinny_isa();
std::vector<std::string> skinny_isas();

// Each kernel: with `tops` (one per row of y, else null) and `floors` (each row's floor: what an
// output must beat to be offered; +inf for a row skinny_linear_tops scans once written), the
// outputs stored that may beat their row's floor are offered to its RowTopK in column order
// (offer_rows, which keeps floors[r] up to date).
namespace skinny_avx512 {
void linear(const float* x, int64_t ldx, int64_t m, int64_t k, const float* panels, int64_t n, float* y, int64_t ldy,
            RowTopK* tops, float* floors);
}
namespace skinny_avx2 {
void linear(const float* x, int64_t ldx, int64_t m, int64_t k, const float* panels, int64_t n, float* y, int64_t ldy,
            RowTopK* tops, float* floors);
}
namespace skinny_generic {
void linear(const float* x, int64_t ldx, int64_t m, int64_t k, const float* panels, int64_t n, float* y, int64_t ldy,
            RowTopK* tops, float* floors);
}

// The rows r of a block (bit r of `rows`; tops[r], y + r * ldy) whose outputs in columns [col,
// end) may beat their floor, offered to their picks in column order: those above floors[r],
// which follows the picks' floor as it rises (a row left to a scan keeps +inf: offered
// nothing). Out of line: a kernel's accumulators never live across it.
__attribute__((noinline)) inline void offer_rows(RowTopK* tops, float* floors, const float* y, int64_t ldy, int64_t col,
                                                 int64_t end, uint32_t rows) {
  while (rows) {
    const int r = __builtin_ctz(rows);
    const float* row = y + r * ldy;
    for (int64_t c = col; c < end; ++c)
      if (row[c] > floors[r]) {
        tops[r].add(row[c], static_cast<int32_t>(c));
        floors[r] = tops[r].floor();
      }
    rows &= rows - 1;
  }
}

}  // namespace lookupdec
