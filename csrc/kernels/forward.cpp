// forward.hpp's decoder forward over the kernels beside it.
#include "kernels/forward.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "kernels/attention.hpp"
#include "kernels/norm.hpp"
#include "kernels/rotary.hpp"
#include "kernels/skinny.hpp"

namespace lookupdec {

namespace {

// y[i] = a[i] + b[i] (torch's residual sum: one float addition each)
void add_into(float* y, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = y[i] + b[i];
}

void add_bias(float* y, int64_t rows, int64_t n, const float* bias) {
  if (bias == nullptr) return;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) y[r * n + i] = y[r * n + i] + bias[i];
}

}  // namespace

void decoder_forward(const DecoderShape& s, const float* const* weights, const float* embed, const float* final_norm,
                     const KVBuffer& cache, const int64_t* ids, const int64_t* parents, int64_t m, int64_t n_cached,
                     const float* cos, const float* sin, float* out) {
  const int64_t H = s.hidden, D = s.head_dim, QW = s.heads * D, KW = s.kv_heads * D, I = s.intermediate;
  if (m < 1 || n_cached < 0 || n_cached + m > cache.capacity)
    throw std::invalid_argument("decoder_forward: nodes past the K/V buffer's capacity");
  for (int64_t i = 0; i < m; ++i)
    if ((i == 0) != (parents[i] < 0) || parents[i] >= i)
      throw std::invalid_argument("decoder_forward: parents[0] must be -1 and 0 <= parents[i] < i after it");

  std::vector<float> h(m * H), x(m * H), q(m * QW), qr(m * QW), k(m * KW), v(m * KW), att(m * QW), o(m * H);
  std::vector<float> g(m * I), u(m * I);
  for (int64_t i = 0; i < m; ++i) std::memcpy(&h[i * H], embed + ids[i] * H, H * sizeof(float));

  // the attention plan, the same for every layer: the prefix (common to every node), then the
  // m new slots, each seen by its descendants and itself
  const int64_t cmax = n_cached + m;
  std::vector<int32_t> cols(cmax), counts(1, static_cast<int32_t>(cmax)), common(1, static_cast<int32_t>(n_cached));
  for (int64_t c = 0; c < cmax; ++c) cols[c] = static_cast<int32_t>(c);
  const float hidden_bias = -std::numeric_limits<float>::infinity();
  std::vector<float> bias(m * cmax, 0.0f);
  std::vector<uint8_t> live(m, 1);
  std::vector<uint8_t> sees(m * m, 0);  // sees[i * m + j]: node i sees node j
  for (int64_t i = 0; i < m; ++i) {
    if (i) std::memcpy(&sees[i * m], &sees[parents[i] * m], m);
    sees[i * m + i] = 1;
    for (int64_t j = 0; j < m; ++j) bias[i * cmax + n_cached + j] = sees[i * m + j] ? 0.0f : hidden_bias;
  }
  AttentionArgs a{};
  a.B = 1, a.H = s.heads, a.KVH = s.kv_heads, a.Q = m, a.D = D, a.cmax = cmax;
  a.qs[0] = m * QW, a.qs[1] = D, a.qs[2] = QW, a.qs[3] = 1;  // qr is [m, heads, D]
  a.ks[0] = 0, a.ks[1] = cache.head_stride, a.ks[2] = D, a.ks[3] = 1;
  a.vs[0] = 0, a.vs[1] = cache.head_stride, a.vs[2] = D, a.vs[3] = 1;
  a.cols = cols.data(), a.counts = counts.data(), a.common = common.data(), a.bias = bias.data();
  a.live = live.data(), a.out = att.data(), a.scale = s.scaling;
  const int threads = skinny_threads(int64_t{1} << 40);

  const int64_t rot_shape_q[4] = {1, s.heads, m, D}, rot_shape_k[4] = {1, s.kv_heads, m, D};
  const int64_t q_strides[4] = {m * QW, D, QW, 1}, k_strides[4] = {m * KW, D, KW, 1};
  for (int64_t l = 0; l < s.layers; ++l) {
    const float* const* w = weights + l * kLayerPointers;
    float* keys = cache.kv + l * cache.layer_stride;
    float* values = keys + cache.kind_stride;
    rms_norm(h.data(), H, m, H, w[0], s.eps, x.data(), H);
    skinny_linear(x.data(), H, m, H, w[1], QW, q.data(), QW);
    skinny_linear(x.data(), H, m, H, w[2], KW, k.data(), KW);
    skinny_linear(x.data(), H, m, H, w[3], KW, v.data(), KW);
    add_bias(q.data(), m, QW, w[4]);
    add_bias(k.data(), m, KW, w[5]);
    add_bias(v.data(), m, KW, w[6]);
    rotary(q.data(), rot_shape_q, q_strides, cos, sin, 0, qr.data(), q_strides);
    // the rotated keys straight into their slots; the values copied there
    const int64_t slot_strides[4] = {0, cache.head_stride, D, 1};
    rotary(k.data(), rot_shape_k, k_strides, cos, sin, 0, keys + n_cached * D, slot_strides);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t hd = 0; hd < s.kv_heads; ++hd)
        std::memcpy(values + hd * cache.head_stride + (n_cached + i) * D, &v[i * KW + hd * D], D * sizeof(float));
    a.q = qr.data(), a.k = keys, a.v = values;
    tree_attention(a, threads);
    skinny_linear(att.data(), QW, m, QW, w[7], H, o.data(), H);
    add_into(h.data(), o.data(), m * H);
    rms_norm(h.data(), H, m, H, w[8], s.eps, x.data(), H);
    skinny_linear(x.data(), H, m, H, w[9], I, g.data(), I);
    skinny_linear(x.data(), H, m, H, w[10], I, u.data(), I);
    for (int64_t i = 0; i < m * I; ++i) {
      const float z = g[i];
      g[i] = (z / (1.0f + std::exp(-z))) * u[i];
    }
    skinny_linear(g.data(), I, m, I, w[11], H, o.data(), H);
    add_into(h.data(), o.data(), m * H);
  }
  rms_norm(h.data(), H, m, H, final_norm, s.eps, out, H);
}

}  // namespace lookupdec
