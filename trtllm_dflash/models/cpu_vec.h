// Sixteen float32 lanes as one AVX-512 register or two AVX2 registers, with the same results lane by lane in both:
// the vector type of this package's CPU kernels (``packed_mm.cpp``, ``decode_step.cpp``).
#pragma once
#include <immintrin.h>

#if defined(__AVX512F__)
struct V { __m512 v; };
static inline V vzero() { return {_mm512_setzero_ps()}; }
static inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline V vbcast(const float* p) { return {_mm512_set1_ps(*p)}; }
static inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
static inline V vadd(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
static inline void vstore(float* out, V a) { _mm512_storeu_ps(out, a.v); }
static inline V vset(float f) { return {_mm512_set1_ps(f)}; }
static inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
static inline V vsub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
static inline V vmax(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
static inline V vfloor(V a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)}; }
static inline V vdiv(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
static inline V vabs(V a) { return {_mm512_abs_ps(a.v)}; }
// lane by lane a where c >= 0, else b
static inline V vnonneg(V c, V a, V b) { return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(c.v, _mm512_setzero_ps(), _CMP_GE_OQ), b.v, a.v)}; }
// 2^n for lanes holding integers n in [-126, 127]
static inline V vpow2(V n) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23))};
}
// lanes i and i + 8 added: the first step of ``vsum``
static inline __m256 vfold(V a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
}
#else
struct V { __m256 lo, hi; };
static inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline V vbcast(const float* p) { __m256 b = _mm256_broadcast_ss(p); return {b, b}; }
static inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static inline V vadd(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline void vstore(float* out, V a) { _mm256_storeu_ps(out, a.lo); _mm256_storeu_ps(out + 8, a.hi); }
static inline V vset(float f) { __m256 b = _mm256_set1_ps(f); return {b, b}; }
static inline V vmul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline V vsub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline V vmax(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline V vfloor(V a) { return {_mm256_floor_ps(a.lo), _mm256_floor_ps(a.hi)}; }
static inline V vdiv(V a, V b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
static inline __m256 abs8(__m256 a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
static inline V vabs(V a) { return {abs8(a.lo), abs8(a.hi)}; }
static inline __m256 nonneg8(__m256 c, __m256 a, __m256 b) {
  return _mm256_blendv_ps(b, a, _mm256_cmp_ps(c, _mm256_setzero_ps(), _CMP_GE_OQ));
}
static inline V vnonneg(V c, V a, V b) { return {nonneg8(c.lo, a.lo, b.lo), nonneg8(c.hi, a.hi, b.hi)}; }
static inline __m256 pow2_8(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline V vpow2(V n) { return {pow2_8(n.lo), pow2_8(n.hi)}; }
static inline __m256 vfold(V a) { return _mm256_add_ps(a.lo, a.hi); }
#endif

// The 16 lanes summed by a fixed tree, the same pairs on either ISA: i + (i + 8), then i + (i + 4), i + (i + 2),
// i + (i + 1).
static inline float vsum(V a) {
  const __m256 x = vfold(a);
  const __m128 y = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 z = _mm_add_ps(y, _mm_movehl_ps(y, y));
  return _mm_cvtss_f32(_mm_add_ss(z, _mm_shuffle_ps(z, z, 1)));
}

// e^x lane by lane for x <= 0 (a softmax's shifted scores): x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two
// for the reduction), e^r by a degree-6 polynomial evaluated with fused multiply-adds, times 2^n; lanes below -87
// give 2^-126 * e^r or less, not zero, which a softmax's sum absorbs. About one float32 ulp from the exact value.
static inline V vexp(V x) {
  x = vmax(x, vset(-87.f));
  const V n = vfloor(vfma(x, vset(1.44269504088896341f), vset(0.5f)));
  V r = vfma(n, vset(-0.693359375f), x);
  r = vfma(n, vset(2.12194440e-4f), r);
  V p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset(1.f)));
  return vmul(p, vpow2(n));
}

constexpr long L = 16;  // lanes of V
