// Decode attention in key blocks of one vector's lanes, for any vector width: each ISA's file gives a
// lane type V (below) and includes this header under its target pragma, as float_kernel.h is used.
// Scores: each key row is converted to fp32 once for the query heads sharing it (fp32 rows read in place); each (head, key)
// leaves a V::kLanes-lane partial, and the partials of a key block are summed lane-wise by one
// transpose tree (V::sum_lanes) into the block's scores, with no horizontal sum per dot product.
// Softmax with a vector exp. Values: up to 4 vectors of the head dimension at a time (value_sums).
// Key and value rows are prefetched kAhead keys on while the keys are scored (a paged cache's blocks
// are scattered). Long contexts with few (sequence, KV head) jobs are split into parts over the
// threads and merged (the flash-decoding reduction).
//
// V provides: Vec, Mask, kLanes, kRegisters; zero, set1, add, sub, mul, max, fma(a, b, c) = a * b + c; load from
// float / Bf16 / F16 / int8 (kLanes values widened to fp32), store; first(n) (the lanes below n),
// load_first(p, m, fill) (p's lanes under m, fill elsewhere), store_first(p, m, v), keep(m, v) (v
// under m, 0 elsewhere); reduce_max, reduce_add; sum_lanes(rows) (kLanes rows of kLanes floats: lane l = the sum of
// row l); exp (e^x, 0 below fp32's normal range).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention.h"

namespace cpk {
namespace attention_blocks {

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGroup = 16;  // query heads per KV head
constexpr int64_t kMaxParts = 16;  // key parts per (sequence, KV head)

// The shapes the blocks take; others run the portable loops.
template <typename V>
constexpr bool fits(int64_t d, int64_t group) {
  return d % V::kLanes == 0 && d <= kMaxHeadDim && group <= kMaxGroup;
}

// kLanes values of a cache row as the attention reads them: an int8 row times its scale, a float row as stored.
template <typename V, typename T>
inline typename V::Vec load_scaled(const T* p, float scale) {
  if constexpr (kInt8Cache<T>) return V::mul(V::load(p), V::set1(scale));
  return V::load(p);
}

// Keys ahead whose K and V rows are requested while a key is scored. A paged cache's rows come in
// blocks (of --block-size slots, 16 by default) scattered over the cache, so the hardware
// prefetchers lose the stream at every block: decode attention over long contexts stalled on each
// block's first rows (perf: the key and value loads took most of the kernel's time, at a fraction of
// the read bandwidth). The value rows are requested with the keys, although the values' pass reads
// them only after the part's scores (from L2, where L1 has let them go): requesting them in that
// pass instead, or into L2 only, measured slower (docs/benchmarks.md).
constexpr int64_t kAhead = 16;

// Where one job's cached rows are: (seq, head)'s K and V rows at key l of the sequence, through its
// slots in a paged cache, and the position its int8 row scales are indexed by.
template <typename T>
struct JobRows {
  const T* k;
  const T* v;
  const int64_t* slot;  // null: the contiguous cache, key l at position l
  int64_t stride;       // elements from one position to the next
  JobRows(const AttentionArgs& a, int64_t seq, int64_t head)
      : k(static_cast<const T*>(a.k) + (a.slots ? 0 : seq * a.kb) + head * a.kh),
        v(static_cast<const T*>(a.v) + (a.slots ? 0 : seq * a.kb) + head * a.kh),
        slot(a.slots ? a.slots + seq * a.slot_stride : nullptr),
        stride(a.ks) {}
  int64_t position(int64_t l) const { return slot ? slot[l] : l; }
  const T* key(int64_t l) const { return k + position(l) * stride; }
  const T* value(int64_t l) const { return v + position(l) * stride; }
};

// Every 64-byte line of [p, p + bytes), wherever the row starts.
inline void prefetch_row(const void* p, int64_t bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t(63);
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes);
  for (uintptr_t line = first; line < end; line += 64) __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 3);
}

// Chunks of the head dimension summed together in value_sums: as many as keep group x chunks
// accumulators within half the vector registers (a chunk at a time left `group` dependent FMA chains per
// key, bound by the FMA's latency, and read every value row chunks times).
template <typename V>
constexpr int64_t value_width(int64_t chunks, int64_t group) {
  for (int64_t w : {int64_t(4), int64_t(2)})
    if (chunks % w == 0 && group * w <= V::kRegisters / 2) return w;
  return 1;
}

// o[g] = sum over the part's keys of e^(score - mx) * value, W chunks of the head dimension at a time;
// each output element sums the keys in order, whatever W.
template <typename V, typename T, int64_t W>
void value_sums(const AttentionArgs& a, int64_t seq, int64_t head, int64_t l0, int64_t count, const float* scores,
                int64_t stride, float* o) {
  using Vec = typename V::Vec;
  constexpr int64_t L = V::kLanes;
  const int64_t group = a.hq / a.hkv, d = a.d;
  const JobRows<T> rows(a, seq, head);
  for (int64_t c = 0; c < d / L; c += W) {
    Vec acc[kMaxGroup][W];
    for (int64_t g = 0; g < group; ++g)
      for (int64_t w = 0; w < W; ++w) acc[g][w] = V::zero();
    for (int64_t l = 0; l < count; ++l) {
      const T* value = rows.value(l0 + l) + L * c;
      const float vs = row_scale<T>(a.v_scale, a, seq, rows.position(l0 + l), head);
      Vec v[W];
      for (int64_t w = 0; w < W; ++w) v[w] = load_scaled<V>(value + L * w, vs);
      for (int64_t g = 0; g < group; ++g) {
        const Vec s = V::set1(scores[g * stride + l]);
        for (int64_t w = 0; w < W; ++w) acc[g][w] = V::fma(s, v[w], acc[g][w]);
      }
    }
    for (int64_t g = 0; g < group; ++g)
      for (int64_t w = 0; w < W; ++w) V::store(o + g * d + L * (c + w), acc[g][w]);
  }
}

// One part of a job: keys [l0, l1) of (seq, head) for its `group` query heads. Leaves, per head, the
// part's largest score (mx), the sum of e^(score - mx) (total) and the unnormalized output
// sum e^(score - mx) v (o, [group, d]); an empty part leaves -inf, 0, 0. run() merges.
template <typename V, typename T>
void part(const AttentionArgs& a, int64_t seq, int64_t head, int64_t l0, int64_t l1, float* scores, float* mx,
          float* total, float* o) {
  using Vec = typename V::Vec;
  constexpr int64_t L = V::kLanes;
  const int64_t group = a.hq / a.hkv, d = a.d, chunks = d / L, count = l1 - l0;
  const int64_t stride = (count + L - 1) / L * L;
  const JobRows<T> rows(a, seq, head);
  const float* qs = a.q + (seq * a.hq + head * group) * d;
  alignas(64) float partial[kMaxGroup][L][L];
  for (int64_t b0 = 0; b0 < count; b0 += L) {
    const int64_t nb = std::min<int64_t>(L, count - b0);
    for (int64_t j = 0; j < L; ++j) {
      if (j >= nb) {  // past the end of the part: zero partials, not stored below
        for (int64_t g = 0; g < group; ++g) V::store(partial[g][j], V::zero());
        continue;
      }
      const T* key = rows.key(l0 + b0 + j);
      if (l0 + b0 + j + kAhead < l1) {  // the rows kAhead keys on, K and V
        prefetch_row(rows.key(l0 + b0 + j + kAhead), d * int64_t(sizeof(T)));
        prefetch_row(rows.value(l0 + b0 + j + kAhead), d * int64_t(sizeof(T)));
      }
      auto dots = [&](auto chunk) {  // each head's partial over the key row, chunk(c) its c-th vector
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qs + g * d;
          Vec acc = V::mul(V::load(qg), chunk(0));
          for (int64_t c = 1; c < chunks; ++c) acc = V::fma(V::load(qg + L * c), chunk(c), acc);
          V::store(partial[g][j], acc);
        }
      };
      if constexpr (std::is_same<T, float>::value) {
        // read in place (converting it into an array first compiled to a memcpy a key)
        dots([&](int64_t c) { return V::load(key + L * c); });
      } else {  // converted once for the heads sharing it
        const float ks = row_scale<T>(a.k_scale, a, seq, rows.position(l0 + b0 + j), head);
        Vec kv[kMaxHeadDim / L];
        for (int64_t c = 0; c < chunks; ++c) kv[c] = load_scaled<V>(key + L * c, ks);
        dots([&](int64_t c) { return kv[c]; });
      }
    }
    const auto live = V::first(nb);
    for (int64_t g = 0; g < group; ++g)
      V::store_first(scores + g * stride + b0, live, V::mul(V::sum_lanes(partial[g]), V::set1(a.scale)));
  }
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores + g * stride;
    Vec top = V::set1(minus_inf);
    for (int64_t l = 0; l < count; l += L) top = V::max(top, V::load_first(sc + l, V::first(count - l), minus_inf));
    mx[g] = V::reduce_max(top);
    const Vec shift = V::set1(mx[g]);
    Vec sum = V::zero();
    for (int64_t l = 0; l < count; l += L) {
      const auto m = V::first(count - l);
      const Vec e = V::exp(V::sub(V::load_first(sc + l, m, 0.f), shift));
      V::store_first(sc + l, m, e);
      sum = V::add(sum, V::keep(m, e));
    }
    total[g] = V::reduce_add(sum);
  }
  const auto values = [&](auto width) {
    value_sums<V, T, decltype(width)::value>(a, seq, head, l0, count, scores, stride, o);
  };
  const int64_t across = value_width<V>(chunks, group);
  if (across == 4) return values(std::integral_constant<int64_t, 4>{});
  if (across == 2) return values(std::integral_constant<int64_t, 2>{});
  values(std::integral_constant<int64_t, 1>{});
}

// Jobs [begin, end): the weighted sum of their parts' outputs over the weighted sum of their totals,
// each part weighted by e^(its max - the job's max).
template <typename V>
void merge_parts(const AttentionArgs& a, int64_t split, const float* mx, const float* total, const float* o,
                 int64_t begin, int64_t end) {
  using Vec = typename V::Vec;
  const int64_t group = a.hq / a.hkv, d = a.d;
  for (int64_t job = begin; job < end; ++job)
    for (int64_t g = 0; g < group; ++g) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < split; ++p) top = std::max(top, mx[(job * split + p) * group + g]);
      float weight[kMaxParts], sum = 0.f;
      for (int64_t p = 0; p < split; ++p) {
        const int64_t i = (job * split + p) * group + g;
        weight[p] = total[i] > 0.f ? std::exp(mx[i] - top) : 0.f;
        sum += weight[p] * total[i];
      }
      const Vec inv = V::set1(1.f / sum);
      float* out = a.out + ((job / a.hkv) * a.hq + (job % a.hkv) * group + g) * d;
      for (int64_t c = 0; c < d; c += V::kLanes) {
        Vec acc = V::zero();
        for (int64_t p = 0; p < split; ++p)
          acc = V::fma(V::set1(weight[p]), V::load(o + ((job * split + p) * group + g) * d + c), acc);
        V::store(out + c, V::mul(acc, inv));
      }
    }
}

// Splits each (sequence, KV head)'s keys into parts when there are too few of those to give every
// thread work (SmolLM2: 3 KV heads on 2 threads left one thread idle a third of the time), then merges
// the parts' softmax statistics. dispatch checks fits<V> first.
template <typename V, typename T>
void run(const AttentionArgs& a, const Parallel& par) {
  const int64_t group = a.hq / a.hkv, d = a.d, jobs = a.n * a.hkv;
  const int64_t threads = par.threads;
  int64_t split = jobs >= 2 * threads ? 1 : (2 * threads + jobs - 1) / jobs;
  split = std::max<int64_t>(1, std::min({split, a.longest / 64, kMaxParts}));  // at least 64 keys a part
  const int64_t parts = jobs * split;
  std::vector<float> mx(parts * group), total(parts * group), o(parts * group * d);
  par.for_range(0, parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(group * ((a.longest + split - 1) / split + V::kLanes)));
    for (int64_t p = begin; p < end; ++p) {
      const int64_t job = p / split, i = p % split, length = a.lengths[job / a.hkv];
      part<V, T>(a, job / a.hkv, job % a.hkv, i * length / split, (i + 1) * length / split, scores.data(),
                 mx.data() + p * group, total.data() + p * group, o.data() + p * group * d);
    }
  });
  // The merge is a few microseconds: on the calling thread unless there are many jobs.
  par.for_range(0, jobs, 64, [&](int64_t begin, int64_t end) {
    merge_parts<V>(a, split, mx.data(), total.data(), o.data(), begin, end);
  });
}

// A variant's decode attention: the blocks where the shape fits them (the cache's element type
// picks the instance), else `portable` (its ISA's compilation of the portable loops).
template <typename V>
void dispatch(const AttentionArgs& a, const Parallel& par, void (*portable)(const AttentionArgs&, const Parallel&)) {
  if (!fits<V>(a.d, a.hq / a.hkv)) return portable(a, par);
  if (a.k_scale) return run<V, int8_t>(a, par);
  if (a.dtype == DType::F32) return run<V, float>(a, par);
  if (a.dtype == DType::Bf16) return run<V, Bf16>(a, par);
  run<V, F16>(a, par);
}

}  // namespace attention_blocks
}  // namespace cpk
