// Quantized linear products on the CPU, an XLA FFI custom call: y[r, o] = sum_i x[r, i] * w[o, i], where w is kept
// as codes with one scale (and optionally one offset) per group of `group` inputs, as `reference.py` defines them.
// XLA:CPU turns dequantize-then-dot into a float copy of the weight per call, and reductions over the codes run
// below a quarter of the memory bandwidth; this reads each code once per call for up to 8 rows, dequantizes it in
// registers to the float32 weight the reference computes (the same one, except that code * scale + offset is
// rounded once where the reference rounds twice) and multiplies in float32, split over XLA's intra-op thread pool.
// 16 lanes where the CPU has AVX-512, else 8 (AVX2). Float32 and bfloat16 weights (kinds dense and bf16, no scales)
// take the same path: for a few rows it streams them faster than XLA:CPU's small products (bfloat16 ones 10x faster at
// one row: XLA:CPU multiplies a bfloat16 matrix by a vector element by element).
// The MX and NVFP4 kinds keep their checkpoints' bytes: FP4 (e2m1) codes are looked up in a table of the 16 values
// times the block's float32 step (the weights their formats define, exactly), MXFP8 codes are converted as float16
// bit patterns; every kind's scales become float32 once per chunk, so the kinds differ only in how codes are read.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define DAY0JAX_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define DAY0JAX_AVX512 1
#endif
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// dense: float32 weights as they are; bf16: bfloat16 weights, widened exactly to float32 in registers. The ids are
// `cpu_ffi.KIND_IDS`.
enum Kind : int64_t {
  kInt8 = 0, kInt4 = 1, kFp8 = 2, kDense = 3, kBf16 = 4,
  kMxfp4 = 5, kNvfp4 = 6, kNvfp4Modelopt = 7, kMxfp8E4m3 = 8, kMxfp8E5m2 = 9,
};

// The kind whose codes a kind's are: kinds that differ only in their scales share one set of compiled loops (each
// set is compiled for every row count and group size, on a user's first use). kMxfp4 stands for all e2m1 codes,
// kFp8 for all float8_e4m3fn ones.
constexpr Kind codes_of(Kind k) {
  return k == kNvfp4 || k == kNvfp4Modelopt ? kMxfp4 : k == kMxfp8E4m3 ? kFp8 : k;
}
// Weights with no group parameters, read as floats.
constexpr bool plain(Kind k) { return k == kDense || k == kBf16; }
// Two 4-bit codes per byte.
constexpr bool packed(Kind k) { return k == kInt4 || codes_of(k) == kMxfp4; }
constexpr bool mx_scales(Kind k) { return k == kMxfp4 || k == kMxfp8E4m3 || k == kMxfp8E5m2; }  // E8M0 per 32
constexpr bool nv_scales(Kind k) { return k == kNvfp4 || k == kNvfp4Modelopt; }  // e4m3 per 16, a global one
constexpr int64_t kChunk = 32;  // output features per task
// How far ahead of the codes being read the next ones are asked into L2 (one request per group): 10-15% faster than
// the hardware prefetchers alone on a chain of SmolLM2's projections, whose codes come from L3 or memory.
constexpr int64_t kPrefetchBytes = 8192;
// The vector paths read an FP8 code as the float16 with the same sign, exponent and mantissa bits, which is its
// value / 256 (the exponent biases differ by 8); the scales are taken * 256 instead, exactly.
constexpr float kFp8Rebias = 256.0f;

// The 16 values of an FP4 (e2m1) code, by code: sign bit 3, then the 8 magnitudes. The vector paths load their
// tables from here (AVX2 only the magnitudes, taking the sign from bit 3).
alignas(64) constexpr float kE2m1[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};

// Code i of a row of e2m1 codes packed as MXFP4 and NVFP4 ship them: element 2b in the low nibble of byte b, 2b + 1
// in the high one (not int4's layout).
uint8_t fp4_code(const uint8_t* row, int64_t i) { return (row[i >> 1] >> (4 * (i & 1))) & 15; }

// An E8M0 scale byte as float32 2^(e - 127), exactly, from its bits (as `reference.e8m0_to_float`): e << 23 is the
// normal float 2^(e - 127), e = 0 the subnormal 2^-127, 255 the format's NaN.
float e8m0_to_float(uint8_t e) {
  const uint32_t bits = e == 0 ? 1u << 22 : e == 255 ? 0x7FC00000u : static_cast<uint32_t>(e) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float half_to_float(uint16_t h) {
#ifdef DAY0JAX_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023;
  float magnitude;
  if (exponent == 0) {
    magnitude = mantissa * (1.0f / 16777216.0f);  // subnormal: m * 2^-24
  } else if (exponent == 31) {
    magnitude = mantissa ? __builtin_nanf("") : __builtin_inff();
  } else {
    magnitude = (1.0f + mantissa / 1024.0f) * __builtin_ldexpf(1.0f, static_cast<int>(exponent) - 15);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, 4);
  bits |= sign;
  std::memcpy(&magnitude, &bits, 4);
  return magnitude;
#endif
}

// float8_e4m3fn read as the float16 with the same sign, exponent and mantissa bits, which is its value / 256 (the
// biases differ by 8; as the vector paths read codes), times 256: exact, subnormals included, and a few times faster
// than building it with ldexp (NVFP4 decodes one scale per 16 weights). 0x7F is the format's NaN.
float fp8_e4m3fn_to_float(uint8_t v) {
  if ((v & 0x7F) == 0x7F) return __builtin_nanf("");
  return half_to_float(static_cast<uint16_t>(((v & 0x80) << 8) | ((v & 0x7F) << 7))) * 256.0f;
}

// float8_e5m2 is float16 without its low 8 mantissa bits (same sign, exponent and bias): exact, inf and NaN included.
float fp8_e5m2_to_float(uint8_t v) { return half_to_float(static_cast<uint16_t>(v) << 8); }

float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// n group parameters (scales or offsets) from `begin` on as float32 times `factor`, whatever their stored type.
void to_float(const void* data, ffi::DataType type, int64_t begin, int64_t n, float factor, float* out) {
  switch (type) {
    case ffi::DataType::F16:
      for (int64_t i = 0; i < n; ++i) out[i] = half_to_float(static_cast<const uint16_t*>(data)[begin + i]) * factor;
      return;
    case ffi::DataType::BF16:
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(static_cast<const uint16_t*>(data)[begin + i]) * factor;
      return;
    default:
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<const float*>(data)[begin + i] * factor;
  }
}

struct Problem {
  const float* x;         // [R, I]
  const uint8_t* codes;   // [O, I] (int8, fp8, mxfp8; float32 for dense, bfloat16 for bf16) or [O, I/2] (packed)
  const void* scale;      // [O, I/group] (uint8 E8M0 exponents for the MX kinds, float8_e4m3fn for the NVFP4 ones)
  ffi::DataType scale_type;
  const void* offset;     // [O, I/group], or nullptr
  ffi::DataType offset_type;
  const float* global_scale;  // [O] (the NVFP4 kinds' per-tensor scale, held once per row), or nullptr
  float* y;               // [R, O]
  Kind kind;
  int64_t R, O, I, group;
};

// One chunk of output features' group parameters as float32, so that w = fma(code, scale, offset) is the weight
// (e2m1 codes: w = e2m1(code) * scale): symmetric 4-bit codes are centred on 8, and fma(q, s, -8 s) rounds (q - 8) s
// exactly as the reference does; e4m3 codes' scales carry the vector paths' factor of 256 (exact for any E8M0 scale
// below 2^120). NVFP4's is the format's float32 step, scale / global (ModelOpt's: scale * global), so each table
// entry e2m1 * step is the weight compressed-tensors' dequantization gives in float32 (XLA, running the reference,
// multiplies by the global scale's reciprocal instead, which can move a step by one unit in the last place).
struct ChunkParams {
  std::vector<float> scale, offset;  // [features, I/group]

  void load(const Problem& p, int64_t o_begin, int64_t o_end) {
    const int64_t G = p.I / p.group, n = (o_end - o_begin) * G;
    if (plain(p.kind)) return;  // no group parameters
    scale.resize(n);
    offset.resize(n);
#ifdef DAY0JAX_AVX2
    const float factor = codes_of(p.kind) == kFp8 ? kFp8Rebias : 1.0f;
#else
    const float factor = 1.0f;
#endif
    const uint8_t* bytes = static_cast<const uint8_t*>(p.scale) + o_begin * G;  // MX and NVFP4 scales: one byte
    if (mx_scales(p.kind)) {
      for (int64_t i = 0; i < n; ++i) scale[i] = e8m0_to_float(bytes[i]) * factor;
    } else if (nv_scales(p.kind)) {
      for (int64_t o = 0; o < o_end - o_begin; ++o) {
        const float global = p.global_scale[o_begin + o];
        for (int64_t i = o * G; i < (o + 1) * G; ++i) {
          const float s = fp8_e4m3fn_to_float(bytes[i]);
          scale[i] = p.kind == kNvfp4 ? s / global : s * global;
        }
      }
    } else {
      to_float(p.scale, p.scale_type, o_begin * G, n, factor, scale.data());
    }
    if (p.offset != nullptr) {
      to_float(p.offset, p.offset_type, o_begin * G, n, 1.0f, offset.data());
    } else {
      for (int64_t i = 0; i < n; ++i) offset[i] = p.kind == kInt4 ? -8.0f * scale[i] : 0.0f;
    }
  }
};

#ifdef DAY0JAX_AVX2
// Bytes of packed e2m1 codes, each widened to 16 bits (0x00HL), as one byte per code in element order: v | v << 4 is
// 0x0H?L, whose low byte's low nibble is L (element 2b) and high byte's H (element 2b + 1). The lookups read only
// an index's low bits, so the nibble left above L costs no mask.
inline __m128i fp4_in_order(__m128i v) { return _mm_or_si128(v, _mm_slli_epi16(v, 4)); }
inline __m256i fp4_in_order(__m256i v) { return _mm256_or_si256(v, _mm256_slli_epi16(v, 4)); }

// The vector operations the kernel is written in, for 8 float32 lanes (AVX2) and 16 (AVX-512).
struct Avx2 {
  using F = __m256;
  static constexpr int N = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F broadcast(float v) { return _mm256_set1_ps(v); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static float sum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static __m128i bytes(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
  // N bfloat16 weights: each one's bits are the top half of the float32 it stands for.
  static F bf16(const uint8_t* p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  // N int8 codes.
  static F int8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes(p))); }
  // N bytes of 4-bit codes: the low nibbles and the high nibbles.
  static void int4(const uint8_t* p, F& lo, F& hi) {
    const __m256i v = _mm256_cvtepu8_epi32(bytes(p));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
  static constexpr bool kLookup = false;  // 16-entry lookups take two permutes and a blend on 8 lanes
  static F weights_of_codes(F s, F b) { return s; }
  static void int4_lookup(const uint8_t* p, F table, F& lo, F& hi) {}
  // N float8_e4m3fn codes, each as its value / 256: the sign to bit 15 and the 7 bits below it to bits 7..13 make
  // the float16 with the same exponent and mantissa, subnormals included (conversions from float16 ignore the
  // denormals-are-zero mode XLA's threads run in). The format's one NaN pattern comes out as 480 / 256 instead;
  // weights hold no NaN.
  static F fp8(const uint8_t* p) {
    const __m128i w = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes(p)), 7), _mm_set1_epi16(-0x4080));
    return _mm256_cvtph_ps(w);
  }
  // N float8_e5m2 codes: each is the top byte of the float16 of the same value.
  static F e5m2(const uint8_t* p) { return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes(p)), 8)); }
  // The table e2m1 codes are looked up in: the 8 magnitudes times the group's scale (a permute of 8 lanes takes 3
  // index bits; the sign comes from the code's bit 3).
  static F fp4_table(F s) { return mul(_mm256_load_ps(kE2m1), s); }
  // N bytes of e2m1 codes (2N weights, in order): the first N weights and the next N.
  static void fp4(const uint8_t* p, F table, F& first, F& next) {
    const __m128i codes = fp4_in_order(_mm_cvtepu8_epi16(bytes(p)));
    first = fp4_lookup(_mm256_cvtepu8_epi32(codes), table);
    next = fp4_lookup(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(codes, codes)), table);
  }
  static F fp4_lookup(__m256i code, F table) {
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(code, 28), _mm256_set1_epi32(INT32_MIN));
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(table, code), _mm256_castsi256_ps(sign));
  }
};

#ifdef DAY0JAX_AVX512
struct Avx512 {
  using F = __m512;
  static constexpr int N = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F broadcast(float v) { return _mm512_set1_ps(v); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
  static __m128i bytes(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
  static F int8(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(p))); }
  static F bf16(const uint8_t* p) {  // as Avx2::bf16
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  }
  static void int4(const uint8_t* p, F& lo, F& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(bytes(p));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
  // The 16 weights a group's 4-bit codes stand for, fma(q, s, b) for q = 0..15, and N bytes of codes looked up in
  // them (one permute per 16 codes, where converting and scaling them takes two operations).
  static constexpr bool kLookup = true;
  static F weights_of_codes(F s, F b) {
    return fma(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), s, b);
  }
  static void int4_lookup(const uint8_t* p, F table, F& lo, F& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(bytes(p));
    lo = _mm512_permutexvar_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)), table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
  }
  static F fp8(const uint8_t* p) {  // as Avx2::fp8
    const __m256i w = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes(p)), 7),
                                       _mm256_set1_epi16(-0x4080));
    return _mm512_cvtph_ps(w);
  }
  static F e5m2(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes(p)), 8)); }
  // All 16 e2m1 values times the group's scale: one permute looks a code up, sign included.
  static F fp4_table(F s) { return mul(_mm512_load_ps(kE2m1), s); }
  static void fp4(const uint8_t* p, F table, F& first, F& next) {  // as Avx2::fp4
    const __m256i codes = fp4_in_order(_mm256_cvtepu8_epi16(bytes(p)));
    first = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(codes)), table);
    next = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(codes, 1)), table);
  }
};
using Wide = Avx512;
#else
using Wide = Avx2;
#endif

// Output features [o_begin, o_end) for rows [r0, r0 + NR), codes of kind K in groups of GROUP (0: p.group, known
// only at run time) in L's lanes. Each step dequantizes one vector of codes once
// and multiplies it into every row. With the group a constant the steps unroll and each accumulator is a register;
// indexed by a run-time counter they would live in memory and every FMA would wait on a store.
template <class L, Kind K, int GROUP, int NR>
void features(const Problem& p, const ChunkParams& params, int64_t r0, int64_t o_begin, int64_t o_end) {
  using F = typename L::F;
  constexpr int N = L::N;
  // U independent accumulators per row: with one or two rows, a single chain of FMAs would wait on its own latency.
  constexpr int U = GROUP == 0 ? 1 : NR == 1 ? 4 : NR == 2 ? 2 : 1;
  const int64_t group = GROUP ? GROUP : p.group;
  const int64_t G = p.I / group;
  const int64_t group_bytes = packed(K) ? group / 2 : K == kDense ? group * 4 : K == kBf16 ? group * 2 : group;
  const int64_t half = group / 2;
  const int64_t steps = plain(K) ? group / N : group_bytes / N;  // N bytes of codes (N weights if plain) a step
  const float* x = p.x + r0 * p.I;
  for (int64_t o = o_begin; o < o_end; ++o) {
    F total[NR][U];
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < U; ++u) total[r][u] = L::zero();
    const uint8_t* row = p.codes + o * G * group_bytes;
    const float* scale = params.scale.data() + (o - o_begin) * G;
    const float* offset = params.offset.data() + (o - o_begin) * G;
    // One group's steps, into the accumulators from `first` on: with few steps per group, consecutive groups take
    // different ones, so no chain waits on the previous group's last FMA.
    auto one_group = [&](int64_t g, auto first) __attribute__((always_inline)) {
      // Plain weights have no group parameters (and `params` holds none).
      const F s = plain(K) ? L::zero() : L::broadcast(scale[g]);
      const F b = plain(K) ? L::zero() : L::broadcast(offset[g]);
      const F table = K == kInt4 ? L::weights_of_codes(s, b) : K == kMxfp4 ? L::fp4_table(s) : s;
      const uint8_t* c = row + g * group_bytes;
      const float* xg = x + g * group;
      // One request per 64-byte line where groups are shorter (NVFP4's are 8 bytes).
      if (group_bytes >= 64 || (g * group_bytes) % 64 == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(c + kPrefetchBytes), _MM_HINT_T1);
      }
#pragma GCC unroll 16
      for (int64_t j = 0; j < steps; ++j) {
        if constexpr (K == kMxfp4) {  // 2N consecutive weights a step
          F w0, w1;
          L::fp4(c + N * j, table, w0, w1);
          for (int r = 0; r < NR; ++r) {
            F& t0 = total[r][(first + 2 * j) % U];
            F& t1 = total[r][(first + 2 * j + 1) % U];
            t0 = L::fma(w0, L::load(xg + r * p.I + 2 * N * j), t0);
            t1 = L::fma(w1, L::load(xg + r * p.I + 2 * N * j + N), t1);
          }
        } else if constexpr (K == kInt4) {
          F lo, hi;
          if constexpr (L::kLookup) {
            L::int4_lookup(c + N * j, table, lo, hi);
          } else {
            L::int4(c + N * j, lo, hi);
            lo = L::fma(lo, s, b);
            hi = L::fma(hi, s, b);
          }
          for (int r = 0; r < NR; ++r) {
            F& t0 = total[r][(first + 2 * j) % U];
            F& t1 = total[r][(first + 2 * j + 1) % U];
            t0 = L::fma(lo, L::load(xg + r * p.I + N * j), t0);
            t1 = L::fma(hi, L::load(xg + r * p.I + half + N * j), t1);
          }
        } else {
          F w;
          if constexpr (K == kDense) {
            _mm_prefetch(reinterpret_cast<const char*>(c + 4 * N * j + kPrefetchBytes), _MM_HINT_T1);
            w = L::load(reinterpret_cast<const float*>(c) + N * j);
          } else if constexpr (K == kBf16) {
            // One request per 64-byte line (a step reads half of one with 16 lanes, a quarter with 8).
            if ((2 * N * j) % 64 == 0) {
              _mm_prefetch(reinterpret_cast<const char*>(c + 2 * N * j + kPrefetchBytes), _MM_HINT_T1);
            }
            w = L::bf16(c + 2 * N * j);
          } else {
            const F q = K == kInt8 ? L::int8(c + N * j) : K == kMxfp8E5m2 ? L::e5m2(c + N * j) : L::fp8(c + N * j);
            w = L::fma(q, s, b);
          }
          for (int r = 0; r < NR; ++r) {
            F& t = total[r][(first + j) % U];
            t = L::fma(w, L::load(xg + r * p.I + N * j), t);
          }
        }
      }
    };
    // Accumulators one group uses (known when the group size is: one per N weights, whatever the kind), and so
    // where the next group starts.
    constexpr int kNext = GROUP == 0 ? 0 : (GROUP / N) % U;
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {
      one_group(g, std::integral_constant<int, 0>());
      one_group(g + 1, std::integral_constant<int, kNext>());
    }
    if (g < G) one_group(g, std::integral_constant<int, 0>());
    for (int r = 0; r < NR; ++r) {
      F sum = total[r][0];
      for (int u = 1; u < U; ++u) sum = L::add(sum, total[r][u]);
      p.y[(r0 + r) * p.O + o] = L::sum(sum);
    }
  }
}

template <Kind K, int NR>
void features_of_group(const Problem& p, const ChunkParams& params, int64_t r0, int64_t o_begin, int64_t o_end) {
  switch (p.group) {
    // GGUF's blocks, the --quantize default and the MX block; FP8 and compressed-tensors' usual blocks; any other
    // size (a multiple of 16, so 8 lanes always divide a group's codes).
    case 32: return features<Wide, K, 32, NR>(p, params, r0, o_begin, o_end);
    case 128: return features<Wide, K, 128, NR>(p, params, r0, o_begin, o_end);
    default: return features<Avx2, K, 0, NR>(p, params, r0, o_begin, o_end);
  }
}

template <int NR>
void features(const Problem& p, const ChunkParams& params, int64_t r0, int64_t o_begin, int64_t o_end) {
  switch (p.kind) {
    case kInt8: return features_of_group<kInt8, NR>(p, params, r0, o_begin, o_end);
    case kDense:  // groups only split the row into steps: 64 where they divide it, else 16
      if (p.group == 64) return features<Wide, kDense, 64, NR>(p, params, r0, o_begin, o_end);
      return features<Avx2, kDense, 0, NR>(p, params, r0, o_begin, o_end);
    case kBf16:
      if (p.group == 64) return features<Wide, kBf16, 64, NR>(p, params, r0, o_begin, o_end);
      return features<Avx2, kBf16, 0, NR>(p, params, r0, o_begin, o_end);
    case kInt4: return features_of_group<kInt4, NR>(p, params, r0, o_begin, o_end);
    case kMxfp4:
    case kNvfp4:
    case kNvfp4Modelopt:  // MX blocks of 32 on the widest lanes; NVFP4's 16 (8 bytes) are one step of 8 lanes
      if (p.group == 32) return features<Wide, kMxfp4, 32, NR>(p, params, r0, o_begin, o_end);
      return features<Avx2, kMxfp4, 16, NR>(p, params, r0, o_begin, o_end);
    case kMxfp8E5m2: return features<Wide, kMxfp8E5m2, 32, NR>(p, params, r0, o_begin, o_end);
    default: return features_of_group<kFp8, NR>(p, params, r0, o_begin, o_end);  // fp8 and mxfp8_e4m3
  }
}
#else
template <int NR>
void features(const Problem& p, const ChunkParams& params, int64_t r0, int64_t o_begin, int64_t o_end) {
  const int64_t G = p.I / p.group;
  const int64_t row_bytes = packed(p.kind) ? p.I / 2 : p.kind == kDense ? p.I * 4 : p.kind == kBf16 ? p.I * 2 : p.I;
  const Kind codes = codes_of(p.kind);
  const int64_t half = p.group / 2;
  for (int64_t o = o_begin; o < o_end; ++o) {
    float total[NR] = {};
    const uint8_t* row = p.codes + o * row_bytes;
    if (p.kind == kDense) {
      const float* w = reinterpret_cast<const float*>(row);
      for (int64_t i = 0; i < p.I; ++i)
        for (int r = 0; r < NR; ++r) total[r] += w[i] * p.x[(r0 + r) * p.I + i];
      for (int r = 0; r < NR; ++r) p.y[(r0 + r) * p.O + o] = total[r];
      continue;
    }
    if (p.kind == kBf16) {
      const uint16_t* w = reinterpret_cast<const uint16_t*>(row);
      for (int64_t i = 0; i < p.I; ++i)
        for (int r = 0; r < NR; ++r) total[r] += bf16_to_float(w[i]) * p.x[(r0 + r) * p.I + i];
      for (int r = 0; r < NR; ++r) p.y[(r0 + r) * p.O + o] = total[r];
      continue;
    }
    for (int64_t g = 0; g < G; ++g) {
      const float s = params.scale[(o - o_begin) * G + g], b = params.offset[(o - o_begin) * G + g];
      const float* xg = p.x + r0 * p.I + g * p.group;
      for (int64_t j = 0; j < p.group; ++j) {
        float q;
        if (codes == kInt4) {
          const uint8_t byte = row[g * half + j % half];
          q = static_cast<float>(j < half ? byte & 15 : byte >> 4);
        } else if (codes == kMxfp4) {
          q = kE2m1[fp4_code(row, g * p.group + j)];
        } else if (codes == kInt8) {
          q = static_cast<float>(static_cast<int8_t>(row[g * p.group + j]));
        } else if (codes == kMxfp8E5m2) {
          q = fp8_e5m2_to_float(row[g * p.group + j]);
        } else {
          q = fp8_e4m3fn_to_float(row[g * p.group + j]);
        }
        const float w = std::fma(q, s, b);
        for (int r = 0; r < NR; ++r) total[r] += w * xg[r * p.I + j];
      }
    }
    for (int r = 0; r < NR; ++r) p.y[(r0 + r) * p.O + o] = total[r];
  }
}
#endif

// Rows in passes of 8, 4, 2 and 1 (the only widths compiled: each is a full set of kernels, and the build runs on
// a user's first use).
int64_t rows(const Problem& p, const ChunkParams& params, int64_t r0, int64_t o_begin, int64_t o_end) {
  const int64_t left = p.R - r0;
  if (left >= 8) return features<8>(p, params, r0, o_begin, o_end), 8;
  if (left >= 4) return features<4>(p, params, r0, o_begin, o_end), 4;
  if (left >= 2) return features<2>(p, params, r0, o_begin, o_end), 2;
  return features<1>(p, params, r0, o_begin, o_end), 1;
}

// Tasks claim chunks of output features from a shared counter; the calling thread works too and then waits only
// for chunks already claimed. A pool task that starts late finds nothing left, so the call never waits on a task
// the pool has not started (XLA may run other custom calls on the pool's threads at the same time). A job may hold
// several products of the same x (a layer's q, k and v): one call streams their weights back to back.
struct Job {
  std::vector<Problem> problems;
  std::vector<int64_t> first_chunk;  // problems[k]'s chunks are [first_chunk[k], first_chunk[k + 1])
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> running{0};

  void add(const Problem& p) {
    if (first_chunk.empty()) first_chunk.push_back(0);
    problems.push_back(p);
    first_chunk.push_back(first_chunk.back() + (p.O + kChunk - 1) / kChunk);
  }
  int64_t n_chunks() const { return first_chunk.back(); }

  void work() {
    running.fetch_add(1);
    ChunkParams params;
    size_t k = 0;  // a thread's claims ascend, so the problem they fall in only moves forward
    for (int64_t c = next.fetch_add(1); c < n_chunks(); c = next.fetch_add(1)) {
      while (c >= first_chunk[k + 1]) ++k;
      const Problem& problem = problems[k];
      const int64_t o_begin = (c - first_chunk[k]) * kChunk, o_end = std::min(problem.O, o_begin + kChunk);
      params.load(problem, o_begin, o_end);
      for (int64_t r0 = 0; r0 < problem.R;) r0 += rows(problem, params, r0, o_begin, o_end);
    }
    running.fetch_sub(1);
  }
};

// Runs `job` on the calling thread and up to pool.num_threads() - 1 of the pool's (whose tasks hold the job, so one
// that starts after the call returned still finds it).
void run(const std::shared_ptr<Job>& job, ffi::ThreadPool& pool) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->n_chunks()) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->running.load() != 0 || job->next.load() < job->n_chunks()) {
#ifdef DAY0JAX_AVX2
    _mm_pause();
#endif
  }
}

// Where the MX and NVFP4 kinds' operands are not what their formats hold, the error naming it; else nullptr.
const char* format_error(Kind kind, int64_t group, const ffi::AnyBuffer& codes, const ffi::AnyBuffer& scale,
                         const ffi::AnyBuffer& global_scale, int64_t O) {
  const ffi::DataType code_type = codes.element_type(), scale_type = scale.element_type();
  if (mx_scales(kind) && (group != 32 || scale_type != ffi::DataType::U8)) {
    return "MX kinds take one uint8 E8M0 scale per 32";
  }
  const bool global_per_row = global_scale.element_type() == ffi::DataType::F32 &&
                              static_cast<int64_t>(global_scale.element_count()) == O;
  if (nv_scales(kind) && (group != 16 || scale_type != ffi::DataType::F8E4M3FN || !global_per_row)) {
    return "NVFP4 kinds take one float8_e4m3fn scale per 16 and a float32 global scale per row";
  }
  if ((kind == kMxfp8E4m3 && code_type != ffi::DataType::F8E4M3FN) ||
      (kind == kMxfp8E5m2 && code_type != ffi::DataType::F8E5M2) ||
      (codes_of(kind) == kMxfp4 && code_type != ffi::DataType::U8)) {
    return "codes of the wrong type for the kind";
  }
  return nullptr;
}

ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                               ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::AnyBuffer global_scale,
                               ffi::ResultBuffer<ffi::F32> y, int64_t kind, int64_t group, bool has_offset) {
  const auto x_dims = x.dimensions(), c_dims = codes.dimensions();
  if (x_dims.size() != 2 || c_dims.size() != 2) return ffi::Error::InvalidArgument("x and codes must be 2-D");
  const int64_t R = x_dims[0], I = x_dims[1], O = c_dims[0];
  if (kind < kInt8 || kind > kMxfp8E5m2 || group <= 0 || group % 16 || I % group) {
    return ffi::Error::InvalidArgument("unsupported kind or group");
  }
  const Kind k = static_cast<Kind>(kind);
  if (c_dims[1] != (packed(k) ? I / 2 : I)) return ffi::Error::InvalidArgument("codes do not match x");
  if ((kind == kDense) != (codes.element_type() == ffi::DataType::F32) ||
      (kind == kBf16) != (codes.element_type() == ffi::DataType::BF16)) {
    return ffi::Error::InvalidArgument("dense weights are float32, bf16 ones bfloat16, codes neither");
  }
  if (const char* error = format_error(k, group, codes, scale, global_scale, O)) {
    return ffi::Error::InvalidArgument(error);
  }
  auto job = std::make_shared<Job>();
  job->add(Problem{x.typed_data(), static_cast<const uint8_t*>(codes.untyped_data()), scale.untyped_data(),
                   scale.element_type(), has_offset ? offset.untyped_data() : nullptr, offset.element_type(),
                   nv_scales(k) ? static_cast<const float*>(global_scale.untyped_data()) : nullptr,
                   y->typed_data(), k, R, O, I, group});
  run(job, pool);
  return ffi::Error::Success();
}

// y_k = x w_k^T for float32 or bfloat16 weights w_k [O_k, I] (kind dense or bf16, as QuantizedMatmul's), all in
// one job.
ffi::Error DenseMatmulManyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs weights,
                               ffi::RemainingRets ys, int64_t group) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("x must be 2-D");
  const int64_t R = x_dims[0], I = x_dims[1];
  if (group <= 0 || group % 16 || I % group) return ffi::Error::InvalidArgument("unsupported group");
  if (weights.size() != ys.size() || weights.empty()) {
    return ffi::Error::InvalidArgument("one result per weight");
  }
  auto job = std::make_shared<Job>();
  for (size_t k = 0; k < weights.size(); ++k) {
    auto w = weights.get<ffi::AnyBuffer>(k);
    auto y = ys.get<ffi::AnyBuffer>(k);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument("bad weight or result");
    const auto w_dims = w->dimensions(), y_dims = (*y)->dimensions();
    const ffi::DataType type = w->element_type();
    if (type != ffi::DataType::F32 && type != ffi::DataType::BF16) {
      return ffi::Error::InvalidArgument("weights are float32 or bfloat16");
    }
    if (w_dims.size() != 2 || w_dims[1] != I || y_dims.size() != 2 || y_dims[0] != R || y_dims[1] != w_dims[0] ||
        (*y)->element_type() != ffi::DataType::F32) {
      return ffi::Error::InvalidArgument("a weight or result does not match x");
    }
    job->add(Problem{x.typed_data(), static_cast<const uint8_t*>(w->untyped_data()), nullptr, ffi::DataType::F32,
                     nullptr, ffi::DataType::F32, nullptr, static_cast<float*>((*y)->untyped_data()),
                     type == ffi::DataType::F32 ? kDense : kBf16, R, w_dims[0], I, group});
  }
  run(job, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmul, QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()  // codes
                                  .Arg<ffi::AnyBuffer>()  // scale
                                  .Arg<ffi::AnyBuffer>()  // offset, or empty
                                  .Arg<ffi::AnyBuffer>()  // the NVFP4 kinds' global scale [O, 1], or empty
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("kind")
                                  .Attr<int64_t>("group")
                                  .Attr<bool>("has_offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DenseMatmulMany, DenseMatmulManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("group"));
