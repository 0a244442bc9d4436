// Float32 products of a few rows with a weight packed in panels of 16 output features ([panels, k, 16]): the
// ``packed`` kind of ``trtllm_dflash.models.products``, built on the machine at hand by ``models.native``.
//
// Each output is summed in the lane of its output feature, in a fixed order: a chain of fused multiply-adds over
// each chunk of KC consecutive reduction indices, and the chunks' sums added in order (a two-level sum, whose rounding
// grows with KC + k / KC rather than with k). Nothing is summed across lanes, so an output does not depend on how
// many rows are multiplied together, on the tile that computes it, or on whether the lanes are one AVX-512 register
// or two AVX2 registers: a verify row rounds exactly as the same row alone, on any x86 CPU with FMA.
//
// Tiles: P panels (P * 16 outputs) against MC rows at a time, the P * MC accumulators in registers; the weight
// panels are streamed once per group of MC rows, so a step of a few rows reads each weight from memory once.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include "cpu_vec.h"

// L (cpu_vec.h): output features per panel
constexpr long KC = 64;  // reduction indices summed in one chain before it is added to the output

// out[m0 + r, p*L .. p*L + P*L) for r < M from panels p .. p + P of wp ([panels, k, L])
template <int P, int M>
static inline void tile(const float* wp, const float* x, float* y, long k, long ld, long p, long m0) {
  const float* w = wp + p * k * L;
  const float* xr = x + m0 * k;
  for (long j0 = 0; j0 < k; j0 += KC) {
    const long j1 = j0 + KC < k ? j0 + KC : k;
    V acc[M][P];
    for (int r = 0; r < M; r++)
      for (int q = 0; q < P; q++) acc[r][q] = vzero();
    for (long j = j0; j < j1; j++) {
      V wv[P];
      for (int q = 0; q < P; q++) wv[q] = vload(w + (q * k + j) * L);
      for (int r = 0; r < M; r++) {
        V xv = vbcast(xr + r * k + j);
        for (int q = 0; q < P; q++) acc[r][q] = vfma(wv[q], xv, acc[r][q]);
      }
    }
    for (int r = 0; r < M; r++)
      for (int q = 0; q < P; q++) {
        float* out = y + (m0 + r) * ld + (p + q) * L;
        vstore(out, j0 == 0 ? acc[r][q] : vadd(vload(out), acc[r][q]));
      }
  }
}

template <int P, int MC>
static inline void panels(const float* wp, const float* x, float* y, long k, long ld, long p, long m) {
  long m0 = 0;
  for (; m0 + MC <= m; m0 += MC) tile<P, MC>(wp, x, y, k, ld, p, m0);
  switch (m - m0) {
    case 0: break;
#define TAIL(t) case t: if constexpr (t < MC) tile<P, t>(wp, x, y, k, ld, p, m0); break;
    TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7) TAIL(8) TAIL(9) TAIL(10) TAIL(11)
#undef TAIL
  }
}

template <int P, int MC>
static void run(const float* wp, const float* x, float* y, long k, long ld, long np, long m) {
  const long groups = np / P;
  at::parallel_for(0, groups, 1, [&](long g0, long g1) {
    for (long g = g0; g < g1; g++) panels<P, MC>(wp, x, y, k, ld, g * P, m);
  });
  for (long p = groups * P; p < np; p++) panels<1, MC>(wp, x, y, k, ld, p, m);
}

// y [m, np * 16] = x [m, k] times wp packed as [np, k, 16] (every pointer contiguous); also the decode step's product
void packed_product(const float* x, const float* w, float* y, long m, long k, long np) {
  const long ld = np * L;
  // tiles sized to the vector registers (32 with AVX-512, 16 half-width ones with AVX2); the sums are the same in all
#if defined(__AVX512F__)
  if (m == 1) run<8, 1>(w, x, y, k, ld, np, m);
  else if (m == 2) run<4, 2>(w, x, y, k, ld, np, m);
  else if (m <= 4) run<2, 4>(w, x, y, k, ld, np, m);
  else run<2, 12>(w, x, y, k, ld, np, m);
#else
  if (m == 1) run<4, 1>(w, x, y, k, ld, np, m);
  else if (m == 2) run<2, 2>(w, x, y, k, ld, np, m);
  else run<1, 5>(w, x, y, k, ld, np, m);
#endif
}

// x [m, k] times the weight packed as [panels, k, 16] -> [m, panels * 16]
at::Tensor packed_mm(const at::Tensor& x, const at::Tensor& wp) {
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 3 && wp.size(2) == L && x.size(1) == wp.size(1),
              "packed_mm: x [m, k] and a weight packed as [panels, k, 16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && wp.scalar_type() == at::kFloat, "packed_mm: float32 only");
  auto xc = x.contiguous();
  auto wc = wp.contiguous();
  const long m = xc.size(0), k = xc.size(1), np = wc.size(0);
  auto y = at::empty({m, np * L}, xc.options());
  packed_product(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), m, k, np);
  return y;
}

TORCH_LIBRARY_FRAGMENT(trtllm_dflash_cpu, lib) { lib.def("packed_mm(Tensor x, Tensor wp) -> Tensor"); }
TORCH_LIBRARY_IMPL(trtllm_dflash_cpu, CPU, lib) { lib.impl("packed_mm", &packed_mm); }
