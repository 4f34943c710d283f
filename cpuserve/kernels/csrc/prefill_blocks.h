// Prefill attention in query and key blocks (flash attention's online softmax), for any vector width:
// each ISA's file gives a lane type V (attention_blocks.h lists what it provides) and includes this
// header under its target pragma. A job is one (sequence, KV head) and a block of query tokens: its
// rows are every (token, query head of the group) pair, so each key block is read once for all the
// heads that share it. Keys and values of each (sequence, KV head) are first packed once per call
// (widened, int8 rows times their scale) into blocks of kKeys keys: keys transposed ([d][kKeys], a
// vector holds one dimension of V::kLanes keys), values by key ([kKeys][d]). Scores of a key block
// are a register-blocked matmul (kRows rows x 4 vectors of keys, broadcast queries), the softmax
// statistics are updated per row (a running max and sum, the output rescaled when the max grows), and
// the output rows gain P x V (kRows rows x 4 vectors of the head dimension). The causal mask and the
// sliding window only touch the blocks they cut; blocks no query of the job sees are skipped.
//
// E, the dot engine, decides what is packed and how the two matmuls multiply: F32Engine<V> below
// (fp32 everywhere, on every ISA), or an ISA's bf16 pair engine (AVX512_BF16: bf16 keys, values,
// queries and probabilities, fp32 sums), which provides the same three functions.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "prefill_attention.h"

namespace cpk {
namespace prefill_blocks {

constexpr int64_t kKeys = 64;      // keys per block
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kQueryRows = 32;  // rows a job aims for (tokens x query heads of the group)

// Register blocking: a matmul step keeps rows_at_once() x vectors_at_once() accumulators in registers
// (4 x 4 of 32 registers; 6 x 2 of AVX2's 16, so 12 FMAs share 8 loads and broadcasts).
template <typename V>
constexpr int64_t rows_at_once() {
  return sizeof(typename V::Vec) == 32 ? 6 : 4;
}
template <typename V>
constexpr int vectors_at_once() {
  return sizeof(typename V::Vec) == 32 ? 2 : 4;
}

// The shapes the blocks take; others run the portable loops.
template <typename V>
constexpr bool fits(int64_t d) {
  return d % V::kLanes == 0 && d <= kMaxHeadDim;
}

// fp32 keys, values, queries and probabilities: packed keys [d][kKeys], packed values [kKeys][d].
template <typename V>
struct F32Engine {
  using Elem = float;
  static constexpr int64_t kStep = 1;  // head-dimension elements per packed key element

  template <typename T>
  static void pack(const PrefillArgs& a, int64_t seq, int64_t head, int64_t first, int64_t count, float* keys,
                   float* values) {
    for (int64_t j = 0; j < kKeys; ++j) {
      float* vrow = values + j * a.d;
      if (j >= count) {  // past the context: zeros (masked; 0 * a stale NaN would not be)
        for (int64_t x = 0; x < a.d; ++x) keys[x * kKeys + j] = 0.f, vrow[x] = 0.f;
        continue;
      }
      const T* k = prefill_row<T>(a, a.k, seq, head, first + j);
      const T* v = prefill_row<T>(a, a.v, seq, head, first + j);
      const float ks = prefill_scale<T>(a, a.k_scale, seq, head, first + j);
      const float vs = prefill_scale<T>(a, a.v_scale, seq, head, first + j);
      for (int64_t x = 0; x < a.d; ++x) keys[x * kKeys + j] = to_float(k[x]) * ks;
      for (int64_t x = 0; x < a.d; ++x) vrow[x] = to_float(v[x]) * vs;
    }
  }

  // The job's query rows as the score matmul reads them (rows beyond `rows` repeat row 0).
  static void queries(const float* const* q, int64_t rows, int64_t padded, int64_t d, float* dst) {
    for (int64_t r = 0; r < padded; ++r) std::memcpy(dst + r * d, q[r < rows ? r : 0], sizeof(float) * d);
  }

  // scores [padded][kKeys] = queries [padded][d] x keys [d][kKeys].
  static void scores(const float* q, int64_t padded, int64_t d, const float* keys, float* s) {
    using Vec = typename V::Vec;
    constexpr int64_t R = rows_at_once<V>(), L = V::kLanes;
    constexpr int NV = vectors_at_once<V>();
    static_assert(kKeys % (NV * L) == 0, "a key block is whole steps");
    for (int64_t r0 = 0; r0 < padded; r0 += R)
      for (int64_t c0 = 0; c0 < kKeys; c0 += NV * L) {
        Vec acc[R][NV];
        for (int64_t r = 0; r < R; ++r)
          for (int c = 0; c < NV; ++c) acc[r][c] = V::zero();
        for (int64_t x = 0; x < d; ++x) {
          const float* kx = keys + x * kKeys + c0;
          Vec kv[NV];
          for (int c = 0; c < NV; ++c) kv[c] = V::load(kx + c * L);
          for (int64_t r = 0; r < R; ++r) {
            const Vec qb = V::set1(q[(r0 + r) * d + x]);
            for (int c = 0; c < NV; ++c) acc[r][c] = V::fma(qb, kv[c], acc[r][c]);
          }
        }
        for (int64_t r = 0; r < R; ++r)
          for (int c = 0; c < NV; ++c) V::store(s + (r0 + r) * kKeys + c0 + c * L, acc[r][c]);
      }
  }

  // out [padded][d] += p [padded][kKeys] x values [kKeys][d]: NC vectors of the head dimension from
  // column c0 (a compile-time count, so the accumulators stay in registers).
  template <int NC>
  static void add_value_columns(const float* p, int64_t padded, int64_t d, const float* values, float* out,
                                int64_t c0) {
    using Vec = typename V::Vec;
    constexpr int64_t R = rows_at_once<V>(), L = V::kLanes;
    for (int64_t r0 = 0; r0 < padded; r0 += R) {
      Vec acc[R][NC];
      for (int64_t r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) acc[r][c] = V::load(out + (r0 + r) * d + c0 + c * L);
      for (int64_t j = 0; j < kKeys; ++j) {
        const float* vj = values + j * d + c0;
        Vec vv[NC];
        for (int c = 0; c < NC; ++c) vv[c] = V::load(vj + c * L);
        for (int64_t r = 0; r < R; ++r) {
          const Vec pb = V::set1(p[(r0 + r) * kKeys + j]);
          for (int c = 0; c < NC; ++c) acc[r][c] = V::fma(pb, vv[c], acc[r][c]);
        }
      }
      for (int64_t r = 0; r < R; ++r)
        for (int c = 0; c < NC; ++c) V::store(out + (r0 + r) * d + c0 + c * L, acc[r][c]);
    }
  }

  static void add_values(const float* p, int64_t padded, int64_t d, const float* values, float* out) {
    constexpr int64_t L = V::kLanes;
    constexpr int NV = vectors_at_once<V>();
    int64_t c0 = 0;
    for (; c0 + NV * L <= d; c0 += NV * L) add_value_columns<NV>(p, padded, d, values, out, c0);
    switch ((d - c0) / L) {  // fewer than NV vectors left
      case 3: return add_value_columns<3>(p, padded, d, values, out, c0);
      case 2: return add_value_columns<2>(p, padded, d, values, out, c0);
      case 1: return add_value_columns<1>(p, padded, d, values, out, c0);
      default: return;
    }
  }
};

// Query blocks of one (sequence, KV head) in an order that gives each thread's contiguous share
// both early (few keys) and late (many keys) blocks: 0, n-1, 1, n-2, ...
static inline int64_t balanced(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

// Keys and values of every (sequence, KV head), packed by E: blocks [B * Hkv][blocks][...].
template <typename E, typename T>
void pack_all(const PrefillArgs& a, const Parallel& par, int64_t blocks, typename E::Elem* keys,
              typename E::Elem* values) {
  const int64_t per_block = kKeys * a.d / E::kStep;
  par.for_range(0, a.b * a.hkv * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t blk = i % blocks, sh = i / blocks, k0 = blk * kKeys;
      E::template pack<T>(a, sh / a.hkv, sh % a.hkv, k0, std::min(kKeys, a.context - k0), keys + i * per_block,
                          values + i * per_block);
    }
  });
}

template <typename V, typename E, typename T>
void run(const PrefillArgs& a, const Parallel& par) {
  using Vec = typename V::Vec;
  constexpr int64_t R = rows_at_once<V>(), L = V::kLanes;
  using Elem = typename E::Elem;
  const int64_t group = a.hq / a.hkv, d = a.d;
  const int64_t blocks = (a.context + kKeys - 1) / kKeys, per_block = kKeys * d / E::kStep;
  // Uninitialised (pack writes every element, the zero padding too): no serial memset of megabytes.
  const size_t packed = static_cast<size_t>(a.b * a.hkv * blocks * per_block);
  std::unique_ptr<Elem[]> keys(new Elem[packed]), values(new Elem[packed]);
  pack_all<E, T>(a, par, blocks, keys.get(), values.get());
  const int64_t tokens = std::max<int64_t>(1, std::min(a.t, kQueryRows / group));  // query tokens a job
  const int64_t qblocks = (a.t + tokens - 1) / tokens;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  par.for_range(0, a.b * a.hkv * qblocks, 1, [&](int64_t begin, int64_t end) {
    const int64_t most = tokens * group, padded = (most + R - 1) / R * R;
    std::vector<float> s(static_cast<size_t>(padded * kKeys)), o(static_cast<size_t>(padded * d));
    std::vector<float> top(static_cast<size_t>(padded)), sum(static_cast<size_t>(padded));
    std::vector<uint8_t> nan(static_cast<size_t>(padded));  // a NaN score: the row's output is NaN
    std::vector<Elem> q(static_cast<size_t>(padded * d / E::kStep));
    std::vector<const float*> qrows(static_cast<size_t>(padded));
    for (int64_t job = begin; job < end; ++job) {
      const int64_t sh = job / qblocks, seq = sh / a.hkv, head = sh % a.hkv;
      const int64_t i0 = balanced(job % qblocks, qblocks) * tokens, i1 = std::min(a.t, i0 + tokens);
      const int64_t rows = (i1 - i0) * group;
      for (int64_t r = 0; r < rows; ++r)
        qrows[r] = a.q + ((seq * a.t + i0 + r / group) * a.hq + head * group + r % group) * d;
      E::queries(qrows.data(), rows, padded, d, q.data());
      std::fill(o.begin(), o.end(), 0.f);
      std::fill(top.begin(), top.end(), minus_inf);
      std::fill(sum.begin(), sum.end(), 0.f);
      std::fill(nan.begin(), nan.end(), uint8_t(0));
      const int64_t first = prefill_first_key(a, i0), last = prefill_last_key(a, i1 - 1);
      for (int64_t blk = first / kKeys; blk * kKeys <= last; ++blk) {
        const int64_t k0 = blk * kKeys;
        const Elem* kb = keys.get() + (sh * blocks + blk) * per_block;
        E::scores(q.data(), padded, d, kb, s.data());
        for (int64_t r = 0; r < rows; ++r) {
          float* sr = s.data() + r * kKeys;
          const int64_t i = i0 + r / group;
          const int64_t lo = prefill_first_key(a, i) - k0, hi = prefill_last_key(a, i) - k0;  // in the block
          if (lo > 0 || hi < kKeys - 1)  // the mask cuts this block: keys outside [lo, hi] drop out
            for (int64_t j = 0; j < kKeys; ++j)
              if (j < lo || j > hi) sr[j] = minus_inf;
          Vec mx = V::set1(minus_inf), any = V::zero();
          const Vec scale = V::set1(a.scale);
          for (int64_t j = 0; j < kKeys; j += L) {
            const Vec x = V::mul(V::load(sr + j), scale);
            V::store(sr + j, x);
            mx = V::max(mx, x);
            any = V::add(any, x);  // NaN if a score is (max drops NaN lanes, and exp gives them 0)
          }
          if (std::isnan(V::reduce_add(any))) nan[r] = 1;
          const float grown = std::max(top[r], V::reduce_max(mx));
          if (grown == minus_inf) {  // nothing seen yet (a window's start): no weight, nothing to rescale
            for (int64_t j = 0; j < kKeys; ++j) sr[j] = 0.f;
            continue;
          }
          if (grown > top[r]) {  // the running sum and output were relative to a smaller max
            const float shrink = std::exp(top[r] - grown);
            sum[r] *= shrink;
            const Vec f = V::set1(shrink);
            for (int64_t x = 0; x < d; x += L) V::store(o.data() + r * d + x, V::mul(V::load(o.data() + r * d + x), f));
            top[r] = grown;
          }
          const Vec shift = V::set1(grown);
          Vec total = V::zero();
          for (int64_t j = 0; j < kKeys; j += L) {
            const Vec e = V::exp(V::sub(V::load(sr + j), shift));
            V::store(sr + j, e);
            total = V::add(total, e);
          }
          sum[r] += V::reduce_add(total);
        }
        for (int64_t r = rows; r < padded; ++r) std::fill(s.begin() + r * kKeys, s.begin() + (r + 1) * kKeys, 0.f);
        E::add_values(s.data(), padded, d, values.get() + (sh * blocks + blk) * per_block, o.data());
      }
      for (int64_t r = 0; r < rows; ++r) {
        const Vec inv = V::set1(nan[r] ? std::numeric_limits<float>::quiet_NaN() : 1.f / sum[r]);
        float* out = a.out + ((seq * a.t + i0 + r / group) * a.hq + head * group + r % group) * d;
        for (int64_t x = 0; x < d; x += L) V::store(out + x, V::mul(V::load(o.data() + r * d + x), inv));
      }
    }
  });
}

// A variant's prefill attention with the fp32 engine where the shape fits it (the cache's element
// type picks the instance), else `portable`.
template <typename V>
void dispatch(const PrefillArgs& a, const Parallel& par, void (*portable)(const PrefillArgs&, const Parallel&)) {
  if (!fits<V>(a.d)) return portable(a, par);
  if (a.k_scale) return run<V, F32Engine<V>, int8_t>(a, par);
  if (a.dtype == DType::F32) return run<V, F32Engine<V>, float>(a, par);
  if (a.dtype == DType::Bf16) return run<V, F32Engine<V>, Bf16>(a, par);
  run<V, F32Engine<V>, F16>(a, par);
}

}  // namespace prefill_blocks
}  // namespace cpk
