// Quantized linear products on the CPU, an XLA FFI custom call: y[r, o] = sum_i x[r, i] * w[o, i], where w is kept
// as codes with one scale (and optionally one offset) per group of `group` inputs, as `reference.py` defines them.
// XLA:CPU turns dequantize-then-dot into a float copy of the weight per call, and reductions over the codes run
// below a quarter of the memory bandwidth; this reads each code once per call for up to 8 rows, converts it
// in registers and multiplies in float32, split over XLA's intra-op thread pool.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define DAY0JAX_AVX2 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum Kind : int64_t { kInt8 = 0, kInt4 = 1, kFp8 = 2 };
constexpr int64_t kChunk = 16;   // output features per task

float fp8_e4m3fn_to_float(uint8_t v) {
  const int sign = v >> 7, exponent = (v >> 3) & 15, mantissa = v & 7;
  float magnitude;
  if (exponent == 15 && mantissa == 7) {
    magnitude = __builtin_nanf("");
  } else if (exponent == 0) {
    magnitude = mantissa / 8.0f / 64.0f;  // subnormal: m/8 * 2^-6
  } else {
    magnitude = (1.0f + mantissa / 8.0f) * __builtin_ldexpf(1.0f, exponent - 7);
  }
  return sign ? -magnitude : magnitude;
}

struct Fp8Table {
  float values[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) values[i] = fp8_e4m3fn_to_float(static_cast<uint8_t>(i));
  }
};
const Fp8Table kFp8Values;

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

float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One group parameter (a scale or an offset) as float32, whatever its stored type.
struct GroupParams {
  const void* data;
  ffi::DataType type;
  float at(int64_t i) const {
    switch (type) {
      case ffi::DataType::F16: return half_to_float(static_cast<const uint16_t*>(data)[i]);
      case ffi::DataType::BF16: return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
      default: return static_cast<const float*>(data)[i];
    }
  }
};

struct Problem {
  const float* x;         // [R, I]
  const uint8_t* codes;   // [O, I] (int8, fp8) or [O, I/2] (int4)
  GroupParams scale;      // [O, I/group]
  GroupParams offset;     // [O, I/group], or data == nullptr
  float* y;               // [R, O]
  const float* xsum;      // [R, I/group]: each group's input sum, for offsets
  Kind kind;
  int64_t R, O, I, group;
};

#ifdef DAY0JAX_AVX2
inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Eight float8_e4m3fn codes as float32: the code's exponent and mantissa bits placed in a float32's and the exponent
// rebased (+120, the difference of the biases). A subnormal code (exponent 0, m/8 * 2^-6) is built as the normal
// number with exponent 1, (1 + m/8) * 2^-6, minus 2^-6: exact, and never a float32 subnormal (XLA's threads flush
// those to zero). The format's one NaN pattern comes out as 480 instead; weights hold no NaN.
inline __m256 fp8_to_float(__m128i bytes) {
  const __m256i v = _mm256_cvtepu8_epi32(bytes);
  const __m256i subnormal = _mm256_cmpeq_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x78)), _mm256_setzero_si256());
  __m256i magnitude = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7F)), 20);
  magnitude = _mm256_or_si256(magnitude, _mm256_and_si256(subnormal, _mm256_set1_epi32(1 << 23)));
  magnitude = _mm256_add_epi32(magnitude, _mm256_set1_epi32(120 << 23));
  const __m256 value = _mm256_sub_ps(_mm256_castsi256_ps(magnitude),
                                     _mm256_and_ps(_mm256_castsi256_ps(subnormal), _mm256_set1_ps(0x1p-6f)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(value, _mm256_castsi256_ps(sign));
}

// Output features [o_begin, o_end) for rows [r0, r0 + NR), codes of kind K in groups of GROUP (0: p.group, known
// only at run time, for sizes other than 32 and 128). With the group a constant the loop over a group unrolls and each accumulator is a register;
// indexed by a run-time counter they would live in memory and every FMA would wait on a store.
template <Kind K, int GROUP, int NR>
void features(const Problem& p, int64_t r0, int64_t o_begin, int64_t o_end) {
  // U independent accumulators per row: with one or two rows, a single chain of FMAs would wait on its own latency.
  constexpr int U = GROUP == 0 ? 1 : NR == 1 ? 4 : NR == 2 ? 2 : 1;
  const int64_t group = GROUP ? GROUP : p.group;
  const int64_t steps = (K == kInt4 ? group / 2 : group) / 8;  // 8 bytes of codes per step
  const int64_t G = p.I / group, row_bytes = K == kInt4 ? p.I / 2 : p.I;
  const bool offsets = p.offset.data != nullptr;
  for (int64_t o = o_begin; o < o_end; ++o) {
    __m256 total[NR];
    float offset_total[NR];
    for (int r = 0; r < NR; ++r) total[r] = _mm256_setzero_ps(), offset_total[r] = 0.0f;
    const uint8_t* row = p.codes + o * row_bytes;
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc[NR][U];
      for (int r = 0; r < NR; ++r)
        for (int u = 0; u < U; ++u) acc[r][u] = _mm256_setzero_ps();
      const float* xg = p.x + r0 * p.I + g * group;
      const uint8_t* c = row + g * (K == kInt4 ? group / 2 : group);
#pragma GCC unroll 16
      for (int64_t j = 0; j < steps; ++j) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * j));
        if constexpr (K == kInt4) {
          const __m256i v = _mm256_cvtepu8_epi32(bytes);
          const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
          const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
          const int64_t half = group / 2;
          for (int r = 0; r < NR; ++r) {
            __m256& a = acc[r][(2 * j) % U];
            __m256& b = acc[r][(2 * j + 1) % U];
            a = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xg + r * p.I + 8 * j), a);
            b = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xg + r * p.I + half + 8 * j), b);
          }
        } else {
          const __m256 w = K == kInt8 ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)) : fp8_to_float(bytes);
          for (int r = 0; r < NR; ++r) {
            __m256& a = acc[r][j % U];
            a = _mm256_fmadd_ps(w, _mm256_loadu_ps(xg + r * p.I + 8 * j), a);
          }
        }
      }
      const float s = p.scale.at(o * G + g);
      // Symmetric 4-bit codes are centred on 8: (q - 8) * s = q * s + (-8 s), exactly in float32.
      const float off = offsets ? p.offset.at(o * G + g) : (K == kInt4 ? -8.0f * s : 0.0f);
      const __m256 sv = _mm256_set1_ps(s);
      for (int r = 0; r < NR; ++r) {
        __m256 sum = acc[r][0];
        for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, acc[r][u]);
        total[r] = _mm256_fmadd_ps(sum, sv, total[r]);
        offset_total[r] += off * p.xsum[(r0 + r) * G + g];
      }
    }
    for (int r = 0; r < NR; ++r) p.y[(r0 + r) * p.O + o] = horizontal_sum(total[r]) + offset_total[r];
  }
}

template <Kind K, int NR>
void features_of_group(const Problem& p, int64_t r0, int64_t o_begin, int64_t o_end) {
  switch (p.group) {
    // GGUF's blocks and the --quantize default; FP8 and compressed-tensors' usual blocks; any other size.
    case 32: return features<K, 32, NR>(p, r0, o_begin, o_end);
    case 128: return features<K, 128, NR>(p, r0, o_begin, o_end);
    default: return features<K, 0, NR>(p, r0, o_begin, o_end);
  }
}

template <int NR>
void features(const Problem& p, int64_t r0, int64_t o_begin, int64_t o_end) {
  switch (p.kind) {
    case kInt8: return features_of_group<kInt8, NR>(p, r0, o_begin, o_end);
    case kInt4: return features_of_group<kInt4, NR>(p, r0, o_begin, o_end);
    default: return features_of_group<kFp8, NR>(p, r0, o_begin, o_end);
  }
}
#else
template <int NR>
void features(const Problem& p, int64_t r0, int64_t o_begin, int64_t o_end) {
  const int64_t G = p.I / p.group, row_bytes = p.kind == kInt4 ? p.I / 2 : p.I;
  for (int64_t o = o_begin; o < o_end; ++o) {
    float total[NR] = {}, offset_total[NR] = {};
    const uint8_t* row = p.codes + o * row_bytes;
    for (int64_t g = 0; g < G; ++g) {
      float acc[NR] = {};
      const float* xg = p.x + r0 * p.I + g * p.group;
      for (int64_t j = 0; j < p.group; ++j) {
        float w;
        if (p.kind == kInt4) {
          const int64_t half = p.group / 2;
          const uint8_t b = row[g * half + j % half];
          w = static_cast<float>(j < half ? b & 15 : b >> 4);
        } else if (p.kind == kInt8) {
          w = static_cast<float>(static_cast<int8_t>(row[g * p.group + j]));
        } else {
          w = kFp8Values.values[row[g * p.group + j]];
        }
        for (int r = 0; r < NR; ++r) acc[r] += w * xg[r * p.I + j];
      }
      const float s = p.scale.at(o * G + g);
      const float off = p.offset.data ? p.offset.at(o * G + g) : (p.kind == kInt4 ? -8.0f * s : 0.0f);
      for (int r = 0; r < NR; ++r) {
        total[r] += acc[r] * s;
        offset_total[r] += off * p.xsum[(r0 + r) * G + g];
      }
    }
    for (int r = 0; r < NR; ++r) p.y[(r0 + r) * p.O + o] = total[r] + offset_total[r];
  }
}
#endif

// Rows in passes of 8, 4, 2 and 1 (the only widths compiled: each is a full set of kernels, and the build runs on
// a user's first use).
int64_t rows(const Problem& p, int64_t r0, int64_t o_begin, int64_t o_end) {
  const int64_t left = p.R - r0;
  if (left >= 8) return features<8>(p, r0, o_begin, o_end), 8;
  if (left >= 4) return features<4>(p, r0, o_begin, o_end), 4;
  if (left >= 2) return features<2>(p, r0, o_begin, o_end), 2;
  return features<1>(p, r0, o_begin, o_end), 1;
}

// Tasks claim chunks of output features from a shared counter; the calling thread works too and then waits only
// for chunks already claimed. A pool task that starts late finds nothing left, so the call never waits on a task
// the pool has not started (XLA may run other custom calls on the pool's threads at the same time).
struct Job {
  Problem problem;
  int64_t n_chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> running{0};

  void work() {
    running.fetch_add(1);
    for (int64_t c = next.fetch_add(1); c < n_chunks; c = next.fetch_add(1)) {
      const int64_t o_begin = c * kChunk, o_end = std::min(problem.O, o_begin + kChunk);
      for (int64_t r0 = 0; r0 < problem.R;) r0 += rows(problem, r0, o_begin, o_end);
    }
    running.fetch_sub(1);
  }
};

ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                               ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::ResultBuffer<ffi::F32> y,
                               int64_t kind, int64_t group, bool has_offset) {
  const auto x_dims = x.dimensions(), c_dims = codes.dimensions();
  if (x_dims.size() != 2 || c_dims.size() != 2) return ffi::Error::InvalidArgument("x and codes must be 2-D");
  const int64_t R = x_dims[0], I = x_dims[1], O = c_dims[0];
  if (kind < kInt8 || kind > kFp8 || group <= 0 || group % 16 || I % group) {
    return ffi::Error::InvalidArgument("unsupported kind or group");
  }
  if (c_dims[1] != (kind == kInt4 ? I / 2 : I)) return ffi::Error::InvalidArgument("codes do not match x");
  const int64_t G = I / group;
  std::vector<float> xsum(R * G);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int64_t j = 0; j < group; ++j) s += x.typed_data()[r * I + g * group + j];
      xsum[r * G + g] = s;
    }
  }
  auto job = std::make_shared<Job>();
  job->problem = Problem{x.typed_data(), static_cast<const uint8_t*>(codes.untyped_data()),
                         GroupParams{scale.untyped_data(), scale.element_type()},
                         GroupParams{has_offset ? offset.untyped_data() : nullptr, offset.element_type()},
                         y->typed_data(), xsum.data(), static_cast<Kind>(kind), R, O, I, group};
  job->n_chunks = (O + kChunk - 1) / kChunk;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->n_chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->running.load() != 0 || job->next.load() < job->n_chunks) {
#ifdef DAY0JAX_AVX2
    _mm_pause();
#endif
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmul, QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("kind")
                                  .Attr<int64_t>("group")
                                  .Attr<bool>("has_offset"));
