// The target's forward over a few new tokens (a decode step's one per row, or a verify step's few) through every
// decoder layer in one call: the ``native`` engine of ``trtllm_dflash.models.target``, built with ``packed_mm.cpp``
// by ``models.native``.
//
// A one-token step of a small model streams its weights once through a few products per layer, and between them does
// a little work on vectors of the hidden size: norms, RoPE, attention over the cache, the gated activation, residual
// adds. Run as separate operators, that little work costs more in dispatch than in arithmetic. Here it is plain loops
// between the products, which are the packed kernel's (``packed_product``), with no Python, no dispatcher and no
// temporary tensors in between. Each token names its cache row and its slot: its K/V is written there, and it attends
// to its row's slots up to its own, so a row's tokens of one call are causal among themselves.
//
// Numerics are those of the float32 forward, and like the packed products they do not depend on the CPU's vector
// width or on the row count: every dot product sums 16 lanes with fused multiply-adds and then the lanes in order,
// every other sum is a scalar loop in order, and each output is computed by one thread. A token rounds the same
// whatever else the call holds: a row of a batch step is bit for bit the row stepped alone, and the tokens of a
// verify step are bit for bit the same tokens decoded one at a time.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_vec.h"

void packed_product(const float* x, const float* w, float* y, long m, long k, long np);  // packed_mm.cpp

namespace {

constexpr int PER_LAYER = 9;  // weights per layer: see ``decode_step``

// a . b over n (a multiple of L) floats: lane-wise fused multiply-adds, then the lanes summed by ``vsum``'s tree
inline float dot(const float* a, const float* b, long n) {
  V acc = vzero();
  for (long i = 0; i < n; i += L) acc = vfma(vload(a + i), vload(b + i), acc);
  return vsum(acc);
}

// out[i] = w[i] * (x[i] / rms(x)) over n floats (out may be x)
inline void rms_norm(const float* x, const float* w, float* out, long n, float eps) {
  double squares = 0.0;
  for (long i = 0; i < n; i++) squares += static_cast<double>(x[i]) * x[i];
  const float r = 1.f / std::sqrt(static_cast<float>(squares / n) + eps);
  for (long i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

// x [d] rotated at one position: x * cos + rotate_half(x) * sin, rotate_half's sign folded into sin
inline void rope(float* x, const float* cos, const float* sin, long d) {
  float rotated[512];
  const long half = d / 2;
  for (long i = 0; i < d; i++) rotated[i] = x[(i + half) % d];
  for (long i = 0; i < d; i++) x[i] = x[i] * cos[i] + rotated[i] * sin[i];
}

// out[i] = silu(gate[i]) * up[i] over n floats, silu(g) = g * sigmoid(g) with e^-|g| (``vexp``'s range); a tail of
// fewer than L goes through the same lanes from a copy, so every position rounds alike
void silu_mul(const float* gate, const float* up, float* out, long n) {
  auto lanes = [](V g, V u) {
    const V e = vexp(vsub(vzero(), vabs(g)));
    const V sigmoid = vdiv(vnonneg(g, vset(1.f), e), vadd(vset(1.f), e));
    return vmul(vmul(g, sigmoid), u);
  };
  long i = 0;
  for (; i + L <= n; i += L) vstore(out + i, lanes(vload(gate + i), vload(up + i)));
  if (i < n) {
    float g[L] = {}, u[L] = {}, o[L];
    std::copy(gate + i, gate + n, g);
    std::copy(up + i, up + n, u);
    vstore(o, lanes(vload(g), vload(u)));
    std::copy(o, o + (n - i), out + i);
  }
}

// out[0 .. DV * L) += sum over s < n of w[s] * v[s * stride ..], slot after slot, the sums in registers
template <int DV>
inline void weigh(const float* w, const float* v, float* out, long n, long stride) {
  V acc[DV];
  for (int i = 0; i < DV; i++) acc[i] = vload(out + i * L);
  for (long s = 0; s < n; s++) {
    const V ws = vbcast(w + s);
    for (int i = 0; i < DV; i++) acc[i] = vfma(ws, vload(v + s * stride + i * L), acc[i]);
  }
  for (int i = 0; i < DV; i++) vstore(out + i * L, acc[i]);
}

constexpr long SC = 64;  // slots of one attention chunk: fixed, so a token's sums never depend on the thread count

// One chunk of one token's attention: every query head q [heads, d] over the slots [s0, s1) of its row (slot s's
// keys and values at s * stride, KV head g at g * d; query head h reads KV head h / group). Writes, per head h,
// part[h * (d + 2) ..]: the chunk's top score, the sum of e^(score - top), and the values weighted by those.
void attend_chunk(const float* q, const float* keys, const float* values, float* part, float* e, long s0, long s1,
                  long heads, long group, long d, long stride, float scale) {
  const long n = s1 - s0, padded = (n + L - 1) / L * L;
  for (long s = 0; s < n; s++)  // the chunk's keys in the order they lie in memory, every head's at once
    for (long h = 0; h < heads; h++)
      e[h * padded + s] = dot(q + h * d, keys + (s0 + s) * stride + h / group * d, d) * scale;
  for (long h = 0; h < heads; h++) {
    float* row = e + h * padded;
    float top = row[0];
    for (long s = 1; s < n; s++) top = row[s] > top ? row[s] : top;
    const V shift = vset(top);
    for (long s = 0; s < padded; s += L) vstore(row + s, vexp(vsub(vload(row + s), shift)));
    float total = 0.f;
    for (long s = 0; s < n; s++) total += row[s];
    float* out = part + h * (d + 2);
    out[0] = top;
    out[1] = total;
    for (long i = 0; i < d; i += L) vstore(out + 2 + i, vzero());
  }
  for (long h = 0; h < heads; h++) {
    const float* v = values + s0 * stride + h / group * d;
    float* out = part + h * (d + 2) + 2;
    if (d == 64) weigh<4>(e + h * padded, v, out, n, stride);
    else if (d == 128) weigh<8>(e + h * padded, v, out, n, stride);
    else
      for (long s = 0; s < n; s++)
        for (long i = 0; i < d; i += L)
          vstore(out + i, vfma(vbcast(e + h * padded + s), vload(v + s * stride + i), vload(out + i)));
  }
}

// A token's attention output for head h [d] from its chunks' parts (``attend_chunk``, chunk c at c * stride), in
// chunk order: the weighted values rescaled to the largest top score, over the rescaled sums.
void combine(const float* parts, long chunks, long stride, float* out, long d) {
  float top = parts[0];
  for (long c = 1; c < chunks; c++) top = parts[c * stride] > top ? parts[c * stride] : top;
  float total = 0.f;
  for (long i = 0; i < d; i += L) vstore(out + i, vzero());
  for (long c = 0; c < chunks; c++) {
    const float* part = parts + c * stride;
    float w[L];
    vstore(w, vexp(vset(part[0] - top)));
    total += part[1] * w[0];
    for (long i = 0; i < d; i += L) vstore(out + i, vfma(vload(part + 2 + i), vset(w[0]), vload(out + i)));
  }
  const V inv = vset(1.f / total);
  for (long i = 0; i < d; i += L) vstore(out + i, vmul(vload(out + i), inv));
}

struct Task {
  long first, last, chunk;  // tokens [first, last) of one row, its slots [chunk * SC, (chunk + 1) * SC)
};

struct Layer {
  const float *norm1, *norm2, *qkv, *qkv_bias, *o, *q_norm, *k_norm, *gate_up, *down;
  long qkv_panels, o_panels, gate_up_panels, down_panels;
};

// an optional vector of n floats: empty (absent), else float32, contiguous, n long
const float* data_or_null(const at::Tensor& t, long n, const char* name) {
  if (!t.numel()) return nullptr;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n,
              "decode_step: ", name, " must be empty or float32 [", n, "]");
  return t.data_ptr<float>();
}

long panels(const at::Tensor& wp, long k, const char* name) {
  TORCH_CHECK(wp.dim() == 3 && wp.size(1) == k && wp.size(2) == L && wp.is_contiguous(),
              "decode_step: ", name, " must be packed as [panels, ", k, ", 16]");
  return wp.size(0);
}

}  // namespace

// x [b, hidden] the new tokens embedded; cos, sin [b, head_dim] RoPE at their positions (rotate_half's sign in sin);
// weights: per layer, in order, input norm [hidden], post-attention norm [hidden], q|k|v packed, q|k|v bias (or empty),
// o packed, q norm [head_dim] (or empty), k norm (or empty), gate|up packed, down packed; cache_k, cache_v
// [layers, rows, slots, kv_heads, head_dim]; rows [b] each token's cache row; slots_at [b] each token's slot there.
// Writes each layer's K/V of token t at slot slots_at[t] of row rows[t], attends token t to that row's slots up to
// slots_at[t], and returns every layer's output [layers, b, hidden], and after them, where final_norm is not empty,
// the last layer's output normed by it ([layers + 1, b, hidden]).
at::Tensor decode_step(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                       at::TensorList weights, at::Tensor cache_k, at::Tensor cache_v, const at::Tensor& rows_in,
                       const at::Tensor& slots_in, const at::Tensor& final_norm, int64_t heads, int64_t kv_heads,
                       double eps_in) {
  const long layers = static_cast<long>(weights.size()) / PER_LAYER;
  TORCH_CHECK(layers * PER_LAYER == static_cast<long>(weights.size()) && layers > 0,
              "decode_step: ", PER_LAYER, " weights per layer");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "decode_step: x [b, hidden] float32");
  TORCH_CHECK(cache_k.dim() == 5 && cache_k.is_contiguous() && cache_v.is_contiguous() &&
                  cache_k.sizes() == cache_v.sizes() && cache_k.scalar_type() == at::kFloat &&
                  cache_v.scalar_type() == at::kFloat && cache_k.size(0) == layers && cache_k.size(3) == kv_heads,
              "decode_step: contiguous float32 caches [layers, rows, slots, kv_heads, head_dim]");
  const long b = x_in.size(0), hidden = x_in.size(1), d = cache_k.size(4), slots = cache_k.size(2);
  TORCH_CHECK(d % L == 0 && d <= 512 && heads % kv_heads == 0, "decode_step: head_dim a multiple of 16, at most 512");
  auto x0 = x_in.contiguous();
  auto cos_t = cos_in.contiguous(), sin_t = sin_in.contiguous();
  TORCH_CHECK(cos_t.numel() == b * d && sin_t.numel() == b * d, "decode_step: cos, sin [b, head_dim]");
  auto rows_t = rows_in.to(at::kLong).contiguous(), at_t = slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(rows_t.numel() == b && at_t.numel() == b, "decode_step: rows, slots_at [b]");
  const int64_t* rows = rows_t.data_ptr<int64_t>();
  const int64_t* at = at_t.data_ptr<int64_t>();
  for (long r = 0; r < b; r++)
    TORCH_CHECK(rows[r] >= 0 && rows[r] < cache_k.size(1) && at[r] >= 0 && at[r] < slots,
                "decode_step: slot ", at[r], " of row ", rows[r], " is not in the cache");
  const long q_dim = heads * d, kv_dim = kv_heads * d, group = heads / kv_heads;

  std::vector<Layer> ls(layers);
  long inner = 0;
  for (long l = 0; l < layers; l++) {
    const at::Tensor* w = &weights[l * PER_LAYER];
    for (int i : {0, 1, 2, 4, 7, 8})
      TORCH_CHECK(w[i].scalar_type() == at::kFloat && w[i].is_contiguous(), "decode_step: float32 weights");
    Layer& p = ls[l];
    TORCH_CHECK(w[0].numel() == hidden && w[1].numel() == hidden, "decode_step: layer norms [hidden]");
    p.norm1 = w[0].data_ptr<float>();
    p.norm2 = w[1].data_ptr<float>();
    p.qkv = w[2].data_ptr<float>();
    p.qkv_panels = panels(w[2], hidden, "q|k|v");
    TORCH_CHECK(p.qkv_panels * L >= q_dim + 2 * kv_dim, "decode_step: q|k|v has too few outputs");
    p.qkv_bias = data_or_null(w[3], q_dim + 2 * kv_dim, "q|k|v bias");
    p.o = w[4].data_ptr<float>();
    p.o_panels = panels(w[4], q_dim, "o");
    p.q_norm = data_or_null(w[5], d, "q norm");
    p.k_norm = data_or_null(w[6], d, "k norm");
    p.gate_up = w[7].data_ptr<float>();
    p.gate_up_panels = panels(w[7], hidden, "gate|up");
    TORCH_CHECK(l == 0 || w[8].size(1) == inner, "decode_step: every layer's MLP of one width");
    inner = w[8].size(1);
    p.down = w[8].data_ptr<float>();
    p.down_panels = panels(w[8], inner, "down");
    TORCH_CHECK(p.o_panels * L >= hidden && p.down_panels * L >= hidden && p.gate_up_panels * L >= 2 * inner,
                "decode_step: a projection has too few outputs");
  }

  const float* last_norm = data_or_null(final_norm, hidden, "final_norm");
  auto outs = at::empty({layers + (last_norm ? 1 : 0), b, hidden}, x0.options());
  float* out = outs.data_ptr<float>();
  const float* cos = cos_t.data_ptr<float>();
  const float* sin = sin_t.data_ptr<float>();
  float* ck = cache_k.data_ptr<float>();
  float* cv = cache_v.data_ptr<float>();
  const long row_stride = slots * kv_dim, layer_stride = cache_k.size(1) * row_stride;
  const float scale = 1.f / std::sqrt(static_cast<float>(d));

  std::vector<long> first_chunk(b + 1, 0);  // token r's attention chunks: [first_chunk[r], first_chunk[r + 1])
  for (long r = 0; r < b; r++) first_chunk[r + 1] = first_chunk[r] + (at[r] + 1 + SC - 1) / SC;
  std::vector<Task> tasks;
  for (long r0 = 0, r1; r0 < b; r0 = r1) {  // runs of consecutive tokens on one row, in chunks
    long span = 0;
    for (r1 = r0; r1 < b && rows[r1] == rows[r0]; r1++) span = std::max(span, static_cast<long>(at[r1]) + 1);
    for (long c = 0; c * SC < span; c++) tasks.push_back({r0, r1, c});
  }
  std::vector<float> parts(first_chunk[b] * heads * (d + 2));
  std::vector<float> x(x0.data_ptr<float>(), x0.data_ptr<float>() + b * hidden), normed(b * hidden);
  std::vector<float> qkv, proj, att(b * q_dim), act(b * inner);
  for (long l = 0; l < layers; l++) {
    const Layer& p = ls[l];
    // attention: norm, q|k|v, the new keys and values into the cache (all of them before any token attends), each
    // query head over its row's slots up to its own
    for (long r = 0; r < b; r++) rms_norm(&x[r * hidden], p.norm1, &normed[r * hidden], hidden, eps_in);
    qkv.resize(b * p.qkv_panels * L);
    packed_product(normed.data(), p.qkv, qkv.data(), b, hidden, p.qkv_panels);
    for (long r = 0; r < b; r++) {
      float* row = &qkv[r * p.qkv_panels * L];
      if (p.qkv_bias)
        for (long i = 0; i < q_dim + 2 * kv_dim; i++) row[i] += p.qkv_bias[i];
      for (long h = 0; h < heads + kv_heads; h++) {
        float* head = row + h * d;
        const float* norm = h < heads ? p.q_norm : p.k_norm;
        if (norm) rms_norm(head, norm, head, d, eps_in);
        rope(head, cos + r * d, sin + r * d, d);
      }
      const long slot = (l * layer_stride) + rows[r] * row_stride + at[r] * kv_dim;
      std::copy(row + q_dim, row + q_dim + kv_dim, ck + slot);
      std::copy(row + q_dim + kv_dim, row + q_dim + 2 * kv_dim, cv + slot);
    }
    // each token's slots in chunks of SC; a task is one chunk of one run of tokens on one row (their keys and values
    // read from memory once), the tasks spread over the threads, then each token's chunks combined per head
    at::parallel_for(0, static_cast<long>(tasks.size()), 1, [&](long k0, long k1) {
      std::vector<float> e(heads * SC);
      for (long k = k0; k < k1; k++) {
        const long c = tasks[k].chunk, s0 = c * SC;
        const float* keys = ck + l * layer_stride + rows[tasks[k].first] * row_stride;
        const float* values = cv + l * layer_stride + rows[tasks[k].first] * row_stride;
        for (long r = tasks[k].first; r < tasks[k].last; r++)
          if (s0 <= at[r])
            attend_chunk(&qkv[r * p.qkv_panels * L], keys, values, &parts[(first_chunk[r] + c) * heads * (d + 2)],
                         e.data(), s0, std::min(s0 + SC, at[r] + 1), heads, group, d, kv_dim, scale);
      }
    });
    for (long r = 0; r < b; r++)
      for (long h = 0; h < heads; h++)
        combine(&parts[(first_chunk[r] * heads + h) * (d + 2)], first_chunk[r + 1] - first_chunk[r],
                heads * (d + 2), &att[r * q_dim + h * d], d);
    proj.resize(b * p.o_panels * L);
    packed_product(att.data(), p.o, proj.data(), b, q_dim, p.o_panels);
    for (long r = 0; r < b; r++)
      for (long i = 0; i < hidden; i++) x[r * hidden + i] += proj[r * p.o_panels * L + i];
    // the gated MLP
    for (long r = 0; r < b; r++) rms_norm(&x[r * hidden], p.norm2, &normed[r * hidden], hidden, eps_in);
    proj.resize(b * p.gate_up_panels * L);
    packed_product(normed.data(), p.gate_up, proj.data(), b, hidden, p.gate_up_panels);
    for (long r = 0; r < b; r++) {
      const float* gu = &proj[r * p.gate_up_panels * L];
      silu_mul(gu, gu + inner, &act[r * inner], inner);
    }
    proj.resize(b * p.down_panels * L);
    packed_product(act.data(), p.down, proj.data(), b, inner, p.down_panels);
    for (long r = 0; r < b; r++)
      for (long i = 0; i < hidden; i++) x[r * hidden + i] += proj[r * p.down_panels * L + i];
    std::copy(x.begin(), x.end(), out + l * b * hidden);
  }
  if (last_norm)
    for (long r = 0; r < b; r++) rms_norm(&x[r * hidden], last_norm, out + (layers * b + r) * hidden, hidden, eps_in);
  return outs;
}

TORCH_LIBRARY_FRAGMENT(trtllm_dflash_cpu, lib) {
  lib.def("decode_step(Tensor x, Tensor cos, Tensor sin, Tensor[] weights, Tensor(a!) cache_k, Tensor(b!) cache_v, "
          "Tensor rows, Tensor slots_at, Tensor final_norm, int heads, int kv_heads, float eps) -> Tensor");
}
TORCH_LIBRARY_IMPL(trtllm_dflash_cpu, CPU, lib) { lib.impl("decode_step", &decode_step); }
