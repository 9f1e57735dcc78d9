// Paged attention for decode steps on the CPU, an XLA FFI custom call: one query per row, each row's keys read
// straight from its pages. On the CPU, XLA runs the reference's gather-then-attend as a page copy and a few small
// products per layer, 60-130 us each even for a hundred keys; here one pass over the keys a query sees scores them,
// one softmax in float32 (max subtracted, as the reference), one pass over the values. Tasks are (row, kv head)
// pairs, each serving the kv head's whole group of query heads, split over XLA's intra-op thread pool.
// Pages hold float32, bfloat16 or float8_e4m3fn codes; fp8 pages come with a float32 scale per token and kv head,
// applied to a key's score and a value's weight (never to the codes: one product per key instead of H).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// 16 float32 lanes in GCC/Clang vector extensions: one AVX-512 register, two AVX2 ones, or plain floats elsewhere.
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// float8_e4m3fn -> float32 for every byte: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
// subnormal (m/8 * 2^-6); 0x7f and 0xff are NaN, the format has no infinities.
struct E4M3Table {
  float value[256];
  E4M3Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float v = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
      if ((b & 127) == 127) v = std::numeric_limits<float>::quiet_NaN();
      value[b] = (b & 128) ? -v : v;
    }
  }
};
const E4M3Table kE4M3;

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x16 load16(const uint16_t* p) {  // bfloat16 bits: the high half of a float32
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
inline f32x16 load16(const uint8_t* p) {  // float8_e4m3fn codes, looked up
  f32x16 v;
  for (int l = 0; l < 16; ++l) v[l] = kE4M3.value[p[l]];
  return v;
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }
inline float to_float(float v) { return v; }
inline float to_float(uint8_t code) { return kE4M3.value[code]; }
inline float to_float(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The sum of 16 lanes as a tree of halves (a chain of 15 additions would wait on each one's latency).
inline float sum16(f32x16 v) {
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// sum_i q[i] * k[i] over n (D when the head size is a compile-time multiple of 16, so the loop unrolls into
// registers; else n, at run time).
template <int D, typename T>
float dot(const float* q, const T* k, int64_t n) {
  if constexpr (D > 0) n = D;
  f32x16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc += load16(q + i) * load16(k + i);
  float sum = sum16(acc);
  for (; i < n; ++i) sum += q[i] * to_float(k[i]);
  return sum;
}

// The largest of n values: 16 running maxima, then their largest.
inline float max_of(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= 16) {
    f32x16 top = load16(x);
    for (i = 16; i + 16 <= n; i += 16) {
      const f32x16 v = load16(x + i);
      top = v > top ? v : top;
    }
    for (int l = 0; l < 16; ++l) best = std::max(best, top[l]);
  }
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

// exp(x) for x <= 0 (scores less their maximum), within 2 ulp of the correctly rounded value, in plain arithmetic
// the compiler vectorizes (a call to expf per key took most of a short row's time): x = n ln 2 + r with |r| <= ln 2 / 2,
// exp(r) by Cephes' polynomial, 2^n put in the exponent bits. Below -87.3 (weights under 2^-126 of the largest) the
// result stays at 2^-126 instead of underflowing; NaN stays NaN.
inline float exp_nonpositive(float x) {
  x = x < -87.3f ? -87.3f : x;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return y * scale;
}

struct Problem {
  const float* q;           // [B, N, H], one query per row
  const void* k_pages;      // [P, page, K, H]
  const void* v_pages;      // [P, page, K, Hv]
  const int32_t* tables;    // [B, W]
  const int32_t* lengths;   // [B]
  const int32_t* positions; // [B]
  const float* k_scales;    // [P, page, K] for fp8 pages, else nullptr
  const float* v_scales;    // [P, page, K] for fp8 pages, else nullptr
  const int32_t* until;     // [B] or nullptr: the last position each query sees (bidirectional spans)
  const float* sinks;       // [N] or nullptr
  float* out;               // [B, N, Hv]
  int64_t B, N, H, Hv, K, P, page, W;
  float scale, softcap;     // softcap 0: none
  int64_t window, chunk;    // 0: none
};

// The keys row b's query sees, [first, last]: an interval, since every mask of the contract is one (its length,
// causality or a bidirectional span's end, the sliding window, the local chunk), cut to the table's width.
void visible_keys(const Problem& p, int64_t b, int64_t& first, int64_t& last) {
  const int64_t pos = p.positions[b];
  first = 0;
  last = std::min<int64_t>(p.lengths[b], p.W * p.page) - 1;
  last = std::min<int64_t>(last, p.until != nullptr ? p.until[b] : pos);
  if (p.window > 0) first = std::max<int64_t>(first, pos - p.window + 1);
  if (p.chunk > 0) {
    const int64_t start = pos / p.chunk * p.chunk;
    first = std::max(first, start);
    last = std::min(last, start + p.chunk - 1);
  }
}

// fn(j, row, n, stride, at) for each run of keys first + j .. first + j + n - 1 in [first, last] that one page
// holds, of row b and kv head kh: row points at the run's first key's `width` values, the next key's `stride`
// further; `at` is the run's first key's index into per-token-and-head arrays [P, page, K] (the next key's K further).
// One table lookup (and division) per page. Table entries are trusted as the reference's gather trusts them,
// clamped into the pool: never read outside it.
template <typename T, typename Fn>
void for_each_page(const Problem& p, const void* pages, int64_t b, int64_t kh, int64_t first, int64_t last,
                   int64_t width, Fn fn) {
  for (int64_t key = first; key <= last;) {
    const int64_t slot = key % p.page, n = std::min(p.page - slot, last - key + 1);
    const int64_t page = std::clamp<int64_t>(p.tables[b * p.W + key / p.page], 0, p.P - 1);
    const int64_t at = (page * p.page + slot) * p.K + kh;
    fn(key - first, static_cast<const T*>(pages) + at * width, n, p.K * width, at);
    key += n;
  }
}

// A key's softmax weight times its value's fp8 scale (`at`: its index in [P, page, K]), or the weight itself.
inline float weight(const Problem& p, float w, int64_t at) {
  return p.v_scales != nullptr ? w * p.v_scales[at] : w;
}

// out[i] = sum_j w[j] * v_j[i] / total over the keys [first, last], for D values per key (D as in `dot`; here
// n = Hv). With D known the accumulators stay in registers across the keys.
template <int D, typename T>
void weighted_values(const Problem& p, int64_t b, int64_t kh, int64_t first, int64_t last, const float* w,
                     float total, float* out) {
  if constexpr (D > 0) {
    // Two sets of accumulators, even and odd keys: each FMA chain waits on its own latency half as often.
    constexpr int C = D / 16;
    f32x16 even[C] = {}, odd[C] = {};
    for_each_page<T>(p, p.v_pages, b, kh, first, last, D,
                     [&](int64_t j, const T* v, int64_t n, int64_t stride, int64_t at) {
      int64_t i = 0;
      for (; i + 2 <= n; i += 2) {
        const float w0 = weight(p, w[j + i], at + i * p.K), w1 = weight(p, w[j + i + 1], at + (i + 1) * p.K);
        for (int c = 0; c < C; ++c) even[c] += w0 * load16(v + i * stride + 16 * c);
        for (int c = 0; c < C; ++c) odd[c] += w1 * load16(v + (i + 1) * stride + 16 * c);
      }
      if (i < n) {
        const float w0 = weight(p, w[j + i], at + i * p.K);
        for (int c = 0; c < C; ++c) even[c] += w0 * load16(v + i * stride + 16 * c);
      }
    });
    for (int c = 0; c < C; ++c) store16(out + 16 * c, (even[c] + odd[c]) / total);
  } else {
    std::fill(out, out + p.Hv, 0.0f);
    for_each_page<T>(p, p.v_pages, b, kh, first, last, p.Hv,
                     [&](int64_t j, const T* v, int64_t n, int64_t stride, int64_t at) {
      for (int64_t i = 0; i < n; ++i) {
        const float wi = weight(p, w[j + i], at + i * p.K);
        for (int64_t h = 0; h < p.Hv; ++h) out[h] += wi * to_float(v[i * stride + h]);
      }
    });
    for (int64_t h = 0; h < p.Hv; ++h) out[h] /= total;
  }
}

// Row b, kv head kh: its G query heads over the visible keys, head sizes D (see `dot`). scores [G, L] is scratch.
template <int D, typename T>
void attend(const Problem& p, int64_t b, int64_t kh, std::vector<float>& scores) {
  const int64_t G = p.N / p.K, n0 = kh * G;
  float* out = p.out + (b * p.N + n0) * p.Hv;
  int64_t first, last;
  visible_keys(p, b, first, last);
  if (first > last) {  // nothing visible (a padding row): zeros, where the reference averages whatever it gathered
    std::fill(out, out + G * p.Hv, 0.0f);
    return;
  }
  const int64_t L = last - first + 1;
  scores.resize(G * L);
  const float* q = p.q + (b * p.N + n0) * p.H;
  for_each_page<T>(p, p.k_pages, b, kh, first, last, p.H,
                   [&](int64_t j, const T* k, int64_t n, int64_t stride, int64_t at) {
    for (int64_t i = 0; i < n; ++i) {
      const float scale = p.k_scales != nullptr ? p.scale * p.k_scales[at + i * p.K] : p.scale;
      for (int64_t g = 0; g < G; ++g) scores[g * L + j + i] = dot<D>(q + g * p.H, k + i * stride, p.H) * scale;
    }
  });
  if (p.softcap > 0.0f)
    for (float& s : scores) s = p.softcap * std::tanh(s / p.softcap);
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * L;
    float peak = max_of(s, L);
    const float sink = p.sinks != nullptr ? p.sinks[n0 + g] : -std::numeric_limits<float>::infinity();
    peak = std::max(peak, sink);  // a sink logit joins the denominator and takes no value
    for (int64_t j = 0; j < L; ++j) s[j] = exp_nonpositive(s[j] - peak);
    f32x16 partial = {};
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) partial += load16(s + j);
    float total = sum16(partial) + (p.sinks != nullptr ? exp_nonpositive(sink - peak) : 0.0f);
    for (; j < L; ++j) total += s[j];
    weighted_values<D, T>(p, b, kh, first, last, s, total, out + g * p.Hv);
  }
}

template <typename T>
void attend(const Problem& p, int64_t b, int64_t kh, std::vector<float>& scores) {
  if (p.H == p.Hv) {
    switch (p.H) {
      case 64: return attend<64, T>(p, b, kh, scores);
      case 128: return attend<128, T>(p, b, kh, scores);
      case 256: return attend<256, T>(p, b, kh, scores);
    }
  }
  attend<0, T>(p, b, kh, scores);
}

// Tasks claim (row, kv head) pairs from a shared counter; the calling thread works too and then waits only for
// pairs already claimed, so the call never waits on a pool task that has not started.
struct Job {
  Problem problem;
  ffi::DataType type;  // of the pages
  int64_t n_tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> running{0};

  void work() {
    running.fetch_add(1);
    std::vector<float> scores;
    for (int64_t t = next.fetch_add(1); t < n_tasks; t = next.fetch_add(1)) {
      const int64_t b = t / problem.K, kh = t % problem.K;
      if (type == ffi::DataType::BF16) {
        attend<uint16_t>(problem, b, kh, scores);
      } else if (type == ffi::DataType::F8E4M3FN) {
        attend<uint8_t>(problem, b, kh, scores);
      } else {
        attend<float>(problem, b, kh, scores);
      }
    }
    running.fetch_sub(1);
  }
};

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                           ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lengths,
                           ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> until, ffi::Buffer<ffi::F32> sinks,
                           ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
                           ffi::ResultBuffer<ffi::F32> out, float scale, float softcap, int64_t window, int64_t chunk) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), vd = v_pages.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("q must be [B, N, H], pages [P, page, K, H], tables [B, W]");
  }
  const int64_t B = qd[0], N = qd[1], H = qd[2], P = kd[0], page = kd[1], K = kd[2], Hv = vd[3];
  if (kd[3] != H || vd[0] != P || vd[1] != page || vd[2] != K || K == 0 || N % K || td[0] != B || P == 0) {
    return ffi::Error::InvalidArgument("q, pages and tables do not agree");
  }
  const ffi::DataType type = k_pages.element_type();
  if (type != v_pages.element_type() ||
      (type != ffi::DataType::F32 && type != ffi::DataType::BF16 && type != ffi::DataType::F8E4M3FN)) {
    return ffi::Error::InvalidArgument("pages must both be float32, bfloat16 or float8_e4m3fn");
  }
  const bool fp8 = type == ffi::DataType::F8E4M3FN;
  const int64_t n_scales = fp8 ? P * page * K : 0;
  if (static_cast<int64_t>(k_scales.element_count()) != n_scales ||
      static_cast<int64_t>(v_scales.element_count()) != n_scales) {
    return ffi::Error::InvalidArgument("float8 pages need scales [P, page, K] for keys and values; others none");
  }
  auto job = std::make_shared<Job>();
  job->problem = Problem{q.typed_data(), k_pages.untyped_data(), v_pages.untyped_data(), tables.typed_data(),
                         lengths.typed_data(), positions.typed_data(), fp8 ? k_scales.typed_data() : nullptr,
                         fp8 ? v_scales.typed_data() : nullptr,
                         until.element_count() ? until.typed_data() : nullptr,
                         sinks.element_count() ? sinks.typed_data() : nullptr, out->typed_data(),
                         B, N, H, Hv, K, P, page, td[1], scale, softcap, window, chunk};
  job->type = type;
  job->n_tasks = B * K;
#ifdef NOHELP
  const int64_t helpers = 0;
#else
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->n_tasks) - 1;
#endif
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->running.load() != 0 || job->next.load() < job->n_tasks) {
#if defined(__SSE2__)
    _mm_pause();
#endif
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("chunk"));
