// The kernels group's bindings (submodule `kernels`): the forward's CPU kernels (skinny product,
// RMS norm, rotary embedding, tree attention: kernels/*.hpp) and the K/V cache's slot moves,
// called by lookupdec/model/kernels.py and model/cache.py with addresses they have checked.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/bindings.hpp"
#include "kernels/attention.hpp"
#include "kernels/forward.hpp"
#include "kernels/norm.hpp"
#include "kernels/rotary.hpp"
#include "kernels/skinny.hpp"
#if defined(LOOKUPDEC_OPENMP)
#include <omp.h>
#endif

namespace lookupdec_bindings {

namespace {

// model/cache.SlotStore.gather (and BatchStore.gather_row) on a CPU buffer, in place: in each
// row of slots (`outer` x `inner` rows at base + o * outer_stride + i * inner_stride bytes, each
// `capacity` slots of `slot_bytes`), slot slots[j] is copied to start + j. The slots increase
// and none lies before its target, so copying in order never overwrites a slot still to be
// read; runs of consecutive slots move in one memmove. No allocation: index_select's temporary
// (180 rows x the accepted slots of SmolLM2's cache, often past malloc's mmap threshold) cost
// page faults on every step that moved K/V.
void gather_slots(uintptr_t base, int64_t outer, int64_t outer_stride, int64_t inner, int64_t inner_stride,
                  int64_t slot_bytes, int64_t capacity, const std::vector<int64_t>& slots, int64_t start) {
  int64_t count = static_cast<int64_t>(slots.size());
  if (!base || outer < 0 || inner < 0 || slot_bytes <= 0 || start < 0 || start + count > capacity)
    throw std::invalid_argument("gather_slots: buffer shape out of range");
  for (int64_t j = 0; j < count; ++j)
    if (slots[j] < start + j || slots[j] >= capacity || (j > 0 && slots[j] <= slots[j - 1]))
      throw std::invalid_argument("gather_slots: slots must increase, each at or after its target, below capacity");
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first j, length) of consecutive slots not in place
  for (int64_t j = 0; j < count;) {
    int64_t k = j + 1;
    while (k < count && slots[k] == slots[k - 1] + 1) ++k;
    if (slots[j] != start + j) runs.emplace_back(j, k - j);
    j = k;
  }
  uint8_t* data = reinterpret_cast<uint8_t*>(base);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t i = 0; i < inner; ++i) {
      uint8_t* row = data + o * outer_stride + i * inner_stride;
      for (const auto& run : runs)
        std::memmove(row + (start + run.first) * slot_bytes, row + slots[run.first] * slot_bytes,
                     static_cast<size_t>(run.second * slot_bytes));
    }
}

// model/kernels.SkinnyLinears: a weight [n, k] packed into panels, and the product with them.
using MatrixIn = nb::ndarray<const float, nb::ndim<2>, nb::device::cpu>;
using MatrixOut = nb::ndarray<float, nb::ndim<2>, nb::device::cpu>;
using PanelsIn = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using PanelsOut = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

void skinny_pack(MatrixIn w, PanelsOut panels) {
  const int64_t n = static_cast<int64_t>(w.shape(0)), k = static_cast<int64_t>(w.shape(1));
  if (w.stride(1) != 1 || w.stride(0) != k) throw std::invalid_argument("skinny_pack: a contiguous weight");
  if (static_cast<int64_t>(panels.shape(0)) != (n + lookupdec::kPanel - 1) / lookupdec::kPanel * lookupdec::kPanel * k)
    throw std::invalid_argument("skinny_pack: panels of ceil(n / 16) * 16 * k floats");
  lookupdec::skinny_pack(w.data(), n, k, panels.data());
}

using TopsOut = nb::ndarray<int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// With `tops` [m, top_k] int32: each row's top_k output indices too (skinny_linear_tops; weight_bound:
// max |w| of the packed weight, inf where unknown).
void skinny_linear(MatrixIn x, PanelsIn panels, MatrixOut y, std::optional<std::string> isa,
                   std::optional<TopsOut> tops, float weight_bound) {
  const int64_t m = static_cast<int64_t>(x.shape(0)), k = static_cast<int64_t>(x.shape(1));
  const int64_t n = static_cast<int64_t>(y.shape(1));
  if (x.stride(1) != 1 || y.stride(1) != 1) throw std::invalid_argument("skinny_linear: rows contiguous");
  if (static_cast<int64_t>(y.shape(0)) != m) throw std::invalid_argument("skinny_linear: y has x's rows");
  if (static_cast<int64_t>(panels.shape(0)) != (n + lookupdec::kPanel - 1) / lookupdec::kPanel * lookupdec::kPanel * k)
    throw std::invalid_argument("skinny_linear: panels of ceil(n / 16) * 16 * k floats (y's columns, x's)");
  if (tops.has_value()) {
    const int64_t top_k = static_cast<int64_t>(tops->shape(1));
    if (static_cast<int64_t>(tops->shape(0)) != m || top_k < 1 || top_k > n)
      throw std::invalid_argument("skinny_linear: tops of x's rows and 1 to n columns");
    nb::gil_scoped_release release;
    lookupdec::skinny_linear_tops(x.data(), x.stride(0), m, k, panels.data(), n, y.data(), y.stride(0),
                                  static_cast<int32_t>(top_k), tops->data(), weight_bound, isa ? isa->c_str() : nullptr);
    return;
  }
  nb::gil_scoped_release release;
  lookupdec::skinny_linear(x.data(), x.stride(0), m, k, panels.data(), n, y.data(), y.stride(0),
                           isa ? isa->c_str() : nullptr);
}

// skinny_linear without the ndarray conversions (a torch tensor's DLPack import cost more than
// the rest of a small call, and a forward makes one call per linear layer): addresses and sizes
// the caller has checked
// (model/kernels.py: float32 CPU tensors, x's rows contiguous, panels of ceil(n / 16) * 16 * k
// floats, y [m, n] contiguous).
void skinny_linear_at(uintptr_t x, int64_t ldx, int64_t m, int64_t k, uintptr_t panels, int64_t n, uintptr_t y) {
  if (m < 0 || k < 1 || n < 1 || ldx < k) throw std::invalid_argument("skinny_linear_at: bad sizes");
  nb::gil_scoped_release release;
  lookupdec::skinny_linear(reinterpret_cast<const float*>(x), ldx, m, k, reinterpret_cast<const float*>(panels), n,
                           reinterpret_cast<float*>(y), n);
}

// The rotary embedding of a float32 CPU tensor x [B, H, T, D] into out (the same shape), from
// addresses, sizes and strides the caller has checked (model/kernels.py, fused_rotary_for):
// cos and sin rows of D contiguous floats (rotary.hpp).
void rotary_at(uintptr_t x, int64_t b, int64_t h, int64_t t, int64_t d, int64_t sb, int64_t sh, int64_t st, int64_t sd,
               uintptr_t cos, uintptr_t sin, int64_t cos_batch, uintptr_t out, int64_t ob, int64_t oh, int64_t ot,
               int64_t od) {
  if (b < 0 || h < 0 || t < 0 || d < 2 || d % 2 || cos_batch < 0) throw std::invalid_argument("rotary_at: bad sizes");
  const int64_t shape[4] = {b, h, t, d}, xs[4] = {sb, sh, st, sd}, os[4] = {ob, oh, ot, od};
  lookupdec::rotary(reinterpret_cast<const float*>(x), shape, xs, reinterpret_cast<const float*>(cos),
                    reinterpret_cast<const float*>(sin), cos_batch, reinterpret_cast<float*>(out), os);
}

// RMS norm of float32 rows (norm.hpp) from addresses and sizes the caller has checked
// (model/kernels.py, fused_norms_for): rows of n floats at x + r * ldx into y + r * ldy.
void rms_norm_at(uintptr_t x, int64_t ldx, int64_t rows, int64_t n, uintptr_t w, double eps, uintptr_t y,
                 int64_t ldy) {
  if (rows < 0 || n < 1 || ldx < n || ldy < n) throw std::invalid_argument("rms_norm_at: bad sizes");
  lookupdec::rms_norm(reinterpret_cast<const float*>(x), ldx, rows, n, reinterpret_cast<const float*>(w),
                      static_cast<float>(eps), reinterpret_cast<float*>(y), ldy);
}

// Tree attention (attention.hpp) from addresses the caller has checked (model/kernels.py,
// core_attention): float32 q, k, v (last dim contiguous), the plan's int32 cols [B, cmax],
// counts and common [B], float32 bias [B, Q, cmax], uint8 live [B, Q], out [B, Q, H, D]
// contiguous. `sizes`: B, H, KVH, Q, D, cmax, then q's, k's and v's four strides.
void tree_attention_at(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t cols, uintptr_t counts, uintptr_t common,
                       uintptr_t bias, uintptr_t live, uintptr_t out, const std::vector<int64_t>& sizes, double scale,
                       std::optional<std::string> isa) {
  if (sizes.size() != 18) throw std::invalid_argument("tree_attention_at: sizes holds B, H, KVH, Q, D, cmax, 12 strides");
  lookupdec::AttentionArgs a{};
  a.B = sizes[0], a.H = sizes[1], a.KVH = sizes[2], a.Q = sizes[3], a.D = sizes[4], a.cmax = sizes[5];
  if (a.B < 0 || a.Q < 0 || a.KVH < 1 || a.H % a.KVH || a.cmax < 0 || a.D < 16 || a.D > 128 || a.D % 16)
    throw std::invalid_argument("tree_attention_at: bad sizes");
  for (int i = 0; i < 4; ++i) a.qs[i] = sizes[6 + i], a.ks[i] = sizes[10 + i], a.vs[i] = sizes[14 + i];
  if (a.qs[3] != 1 || a.ks[3] != 1 || a.vs[3] != 1) throw std::invalid_argument("tree_attention_at: head dims not contiguous");
  a.q = reinterpret_cast<const float*>(q), a.k = reinterpret_cast<const float*>(k), a.v = reinterpret_cast<const float*>(v);
  a.cols = reinterpret_cast<const int32_t*>(cols), a.counts = reinterpret_cast<const int32_t*>(counts);
  a.common = reinterpret_cast<const int32_t*>(common), a.bias = reinterpret_cast<const float*>(bias);
  a.live = reinterpret_cast<const uint8_t*>(live), a.out = reinterpret_cast<float*>(out);
  a.scale = static_cast<float>(scale);
  const int threads = lookupdec::skinny_threads(int64_t{1} << 40);
  nb::gil_scoped_release release;
  lookupdec::tree_attention(a, threads, isa ? isa->c_str() : nullptr);
}

// attention.hpp's plan of a mask the caller has checked (model/kernels.py, attention_plan_core):
// float32 or uint8 (bool) elements at b * sb + t * st + j, outputs of `width` >= L per row.
int64_t attention_plan_at(uintptr_t mask, bool boolean, int64_t B, int64_t Q, int64_t L, int64_t sb, int64_t st,
                          double hidden, int64_t width, uintptr_t cols, uintptr_t counts, uintptr_t common,
                          uintptr_t bias, uintptr_t live) {
  if (B < 0 || Q < 0 || L < 0 || width < L) throw std::invalid_argument("attention_plan_at: bad sizes");
  return lookupdec::attention_plan(reinterpret_cast<const void*>(mask), boolean, B, Q, L, sb, st,
                                   static_cast<float>(hidden), width, reinterpret_cast<int32_t*>(cols),
                                   reinterpret_cast<int32_t*>(counts), reinterpret_cast<int32_t*>(common),
                                   reinterpret_cast<float*>(bias), reinterpret_cast<uint8_t*>(live));
}

// forward.hpp's decoder forward from addresses the caller has checked (model/native_forward.py):
// `shape` layers, hidden, heads, kv heads, head dim, intermediate; `weights` layers x 12
// addresses (0: no bias); `kv` the K/V buffer with its layer, kind and head strides and
// capacity (in floats); cos, sin [m, head dim]; out [m, hidden] contiguous.
void decoder_forward_at(const std::vector<int64_t>& shape, double eps, double scaling,
                        const std::vector<uintptr_t>& weights, uintptr_t embed, uintptr_t final_norm, uintptr_t kv,
                        const std::vector<int64_t>& kv_strides, const std::vector<int64_t>& ids,
                        const std::vector<int64_t>& parents, int64_t n_cached, uintptr_t cos, uintptr_t sin,
                        uintptr_t out) {
  if (shape.size() != 6 || kv_strides.size() != 4) throw std::invalid_argument("decoder_forward_at: shape holds 6 sizes, kv_strides 4");
  lookupdec::DecoderShape s{shape[0], shape[1], shape[2], shape[3], shape[4], shape[5], static_cast<float>(eps),
                            static_cast<float>(scaling)};
  if (s.layers < 1 || s.hidden < 1 || s.kv_heads < 1 || s.heads % s.kv_heads || s.intermediate < 1 ||
      s.head_dim < 16 || s.head_dim > 128 || s.head_dim % 16)
    throw std::invalid_argument("decoder_forward_at: bad sizes");
  if (static_cast<int64_t>(weights.size()) != s.layers * lookupdec::kLayerPointers)
    throw std::invalid_argument("decoder_forward_at: 12 addresses per layer");
  if (ids.size() != parents.size() || ids.empty()) throw std::invalid_argument("decoder_forward_at: one parent per id");
  std::vector<const float*> w(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) w[i] = reinterpret_cast<const float*>(weights[i]);
  lookupdec::KVBuffer cache{reinterpret_cast<float*>(kv), kv_strides[0], kv_strides[1], kv_strides[2], kv_strides[3]};
  nb::gil_scoped_release release;
  lookupdec::decoder_forward(s, w.data(), reinterpret_cast<const float*>(embed), reinterpret_cast<const float*>(final_norm),
                             cache, ids.data(), parents.data(), static_cast<int64_t>(ids.size()), n_cached,
                             reinterpret_cast<const float*>(cos), reinterpret_cast<const float*>(sin),
                             reinterpret_cast<float*>(out));
}

}  // namespace

void bind_kernels(nb::module_& m) {
  m.def("gather_slots", &gather_slots);
  m.def("skinny_pack", &skinny_pack);
  m.def("skinny_linear", &skinny_linear, nb::arg("x"), nb::arg("panels"), nb::arg("y"), nb::arg("isa") = nb::none(),
        nb::arg("tops") = nb::none(), nb::arg("weight_bound") = std::numeric_limits<float>::infinity());
  m.def("skinny_linear_at", &skinny_linear_at);
  m.def("rotary_at", &rotary_at);
  m.def("rms_norm_at", &rms_norm_at);
  m.def("tree_attention_at", &tree_attention_at, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("cols"),
        nb::arg("counts"), nb::arg("common"), nb::arg("bias"), nb::arg("live"), nb::arg("out"), nb::arg("sizes"),
        nb::arg("scale"), nb::arg("isa") = nb::none());
  m.def("decoder_forward_at", &decoder_forward_at);
  m.def("attention_isas", &lookupdec::attention_isas);
  m.def("attention_plan_at", &attention_plan_at);
  m.def("skinny_isa", &lookupdec::skinny_isa);
  m.def("skinny_isas", &lookupdec::skinny_isas);
  m.def("skinny_threads", &lookupdec::skinny_threads);
  m.def("set_skinny_thread_cap", &lookupdec::set_skinny_thread_cap);
#if defined(LOOKUPDEC_OPENMP)
  m.attr("OPENMP") = true;  // the skinny product splits over torch's OpenMP threads
  // the thread count of the OpenMP runtime the core runs on, for this thread (torch's where
  // torch.set_num_threads moves it: model/kernels.py checks)
  m.def("omp_max_threads", []() { return omp_get_max_threads(); });
#else
  m.attr("OPENMP") = false;
#endif
}

}  // namespace lookupdec_bindings
