// avx512_vnni's batched linears on AMX tiles, where the CPU has AMX-INT8 and the OS grants its tile
// state (amx_usable). The offset panels are already what a tile multiply reads: a full panel's 16
// quads of inputs are 16 rows of 64 bytes (16 columns x 4 inputs), the B operand of TDPBSUD (signed
// activation bytes x unsigned weight bytes), and activation rows are its A operand as they are. One
// tile multiply does 16 x 16 x 64 multiply-adds, the work of 256 zmm VNNI instructions.
//
// Blocks of 32 rows x 2 panels: four int32 accumulator tiles, two activation tiles, two weight
// tiles (the 8 tiles). W8A8 per channel reads its panels as stored. Grouped linears (every W4A8, W8A8
// in groups) first turn a thread's pair of panels into signed bytes (int4 widened), so a group's
// tile sums are the twin's integers with its offset correction already in them, and fold a batch
// of groups at a time with the float sums in registers. The integer sums are exact and the float
// operations the panel twin's, in its order: bit-identical to the twin, as the VNNI blocks are.
// Cases the tiles do not take (fewer than kAmxRows rows, a narrow last panel, K or a group not whole
// 64-input chunks, e.g. groups of 32; the integer fold, scales read in place, int6) stay on VNNI.
#if defined(__x86_64__)

#include <cpuid.h>
#include <immintrin.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <vector>

#include "../../panel_layout.h"
#include "kernels.h"

#define CPK_AMX_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8"

namespace cpk {
namespace {

constexpr int64_t kBlockRows = 32;  // two activation tiles of 16 rows
constexpr int64_t kChunk = 64;      // inputs a tile multiply takes
constexpr int64_t kBatch = 16;      // groups whose int32 sums are stored before they are folded

// The tile configuration (palette 1): tiles 0-3 the int32 sums (16 rows x 16 columns), 4-5 the
// activations (16 rows x kChunk inputs), 6-7 the weights (kChunk / 4 quads x 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC's intrinsics tell the compiler that ldtilecfg reads 8 bytes of the configuration and that tile
// loads and stores touch no memory: it dropped the stores that fill a configuration (the probe then
// faulted) and could move a scratch buffer's writes past the tile loads that read them, or its reads
// before the tile stores. These say what each instruction reads and writes.
#define CPK_TILE_LOAD(tile, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #tile ::"r"(base), "r"(int64_t(stride)) : "memory")
#define CPK_TILE_STORE(tile, base, stride) \
  __asm__ volatile("tilestored %%tmm" #tile ", (%0,%1,1)" ::"r"(base), "r"(int64_t(stride)) : "memory")
// Tile dst += a x b: signed weights (TDPBSSD) or offset bytes (TDPBSUD); tile numbers are literals.
#define CPK_TILE_DOT(Signed, dst, a, b) \
  do {                                  \
    if constexpr (Signed)               \
      _tile_dpbssd(dst, a, b);          \
    else                                \
      _tile_dpbsud(dst, a, b);          \
  } while (0)

TileConfig tile_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  return c;
}

__attribute__((target(CPK_AMX_TARGET), always_inline)) inline void load_config(const TileConfig& c) {
  __asm__ volatile("ldtilecfg %0" ::"m"(c) : "memory");
}

__attribute__((target(CPK_AMX_TARGET))) void tile_probe() {
  load_config(tile_config());
  _tile_zero(0);
  _tile_release();
}

// cpuid's AMX-TILE and AMX-INT8, the OS's XCR0 tile bits, the process's permission for the tile data
// (ARCH_REQ_XCOMP_PERM) and one tile instruction run in a child process: some VMs list AMX and fault
// on its first instruction, and that fault must not be this process's.
bool detect_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE: xgetbv is there
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG and XTILEDATA enabled by the OS
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  const pid_t pid = fork();
  if (pid < 0) return false;
  if (pid == 0) {
    const rlimit none{0, 0};
    setrlimit(RLIMIT_CORE, &none);  // a faulting probe leaves no core file
    tile_probe();
    _exit(0);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

std::atomic<bool> amx_on{true};
std::atomic<uint64_t> tile_calls{0};  // kernel calls that ran panels on the tiles (tests read it)

// One thread's scratch: activation rows of a last, short block (zero-padded to 32), a pair of panels
// as signed bytes (grouped linears), a batch of groups' stored sums, the float sums between batches.
struct Scratch {
  std::vector<int8_t> rows;
  std::vector<int8_t> wide;
  std::vector<int32_t> c;  // [kBatch][4 tiles][16][16]
  alignas(64) float f[4][16][16];
};

// Panel i's weights as signed bytes w in the int8 panel layout, so the tiles' sums are the twin's
// integers without its offset correction (sum(a * stored) - offset * sum(a) = sum(a * w)): int4
// offset nibbles (w + 8; per 8 inputs, the low nibbles are quad 2j and the high nibbles quad 2j + 1)
// or int8 offset bytes (w + 128).
__attribute__((target(CPK_AMX_TARGET))) void signed_panel(const uint8_t* panel, int64_t k, bool int4, int8_t* dst) {
  if (!int4) {
    const __m512i flip = _mm512_set1_epi8(char(0x80));
    for (int64_t j = 0; j < k / 4; ++j)
      _mm512_storeu_si512(dst + j * 4 * kPanel, _mm512_xor_si512(_mm512_loadu_si512(panel + j * 4 * kPanel), flip));
    return;
  }
  const __m512i low = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  for (int64_t j = 0; j < k / kInt4StepInputs; ++j) {
    const __m512i v = _mm512_loadu_si512(panel + j * 4 * kPanel);
    _mm512_storeu_si512(dst + j * 8 * kPanel, _mm512_sub_epi8(_mm512_and_si512(v, low), eight));
    _mm512_storeu_si512(dst + j * 8 * kPanel + 4 * kPanel,
                        _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), eight));
  }
}

// The sums of one block (32 rows from `act`, row stride k; NP panels from w[i], 64 bytes a quad) over
// inputs [k0, k1), in chunks, added to tiles 0-3 (tile 2 * row tile + panel). Signed: the weights are
// signed bytes (TDPBSSD), else offset bytes (TDPBSUD).
template <int NP, bool Signed>
__attribute__((target(CPK_AMX_TARGET), always_inline)) inline void block_sums(const int8_t* act, int64_t k,
                                                                             const uint8_t* const* w, int64_t k0,
                                                                             int64_t k1) {
  for (int64_t x = k0; x < k1; x += kChunk) {
    CPK_TILE_LOAD(4, act + x, k);
    CPK_TILE_LOAD(5, act + 16 * k + x, k);
    CPK_TILE_LOAD(6, w[0] + x * kPanel, 64);
    CPK_TILE_DOT(Signed, 0, 4, 6);
    CPK_TILE_DOT(Signed, 2, 5, 6);
    if constexpr (NP == 2) {
      CPK_TILE_LOAD(7, w[1] + x * kPanel, 64);
      CPK_TILE_DOT(Signed, 1, 4, 7);
      CPK_TILE_DOT(Signed, 3, 5, 7);
    }
  }
}

template <int NP>
__attribute__((target(CPK_AMX_TARGET), always_inline)) inline void store_sums(int32_t* c) {
  CPK_TILE_STORE(0, c, 64);
  CPK_TILE_STORE(2, c + 2 * 256, 64);
  if constexpr (NP == 2) {
    CPK_TILE_STORE(1, c + 256, 64);
    CPK_TILE_STORE(3, c + 3 * 256, 64);
  }
}

template <int NP>
__attribute__((target(CPK_AMX_TARGET), always_inline)) inline void zero_sums() {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (NP == 2) {
    _tile_zero(1);
    _tile_zero(3);
  }
}

// W8A8 per channel, rows [r0, r0 + rows) x panels [p, p + NP), read as stored (offset bytes): the
// twin's int32 (-128 * sum(a) + the sum), then (float(sum) * sw[c]) * sa[r].
template <int NP>
__attribute__((target(CPK_AMX_TARGET))) void channel_block(const LinearArgs& a, const int8_t* act, int64_t r0,
                                                           int64_t rows, const uint8_t* const* w, int64_t p,
                                                           Scratch& s) {
  const int64_t k = a.k, n = a.n;
  zero_sums<NP>();
  block_sums<NP, false>(act, k, w, 0, k);
  store_sums<NP>(s.c.data());
  for (int i = 0; i < NP; ++i) {
    const __m512 sw = _mm512_loadu_ps(a.sw + (p + i) * kPanel);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i acc = _mm512_add_epi32(_mm512_loadu_si512(s.c.data() + (2 * (r / 16) + i) * 256 + (r % 16) * 16),
                                           _mm512_set1_epi32(-128 * a.sums[r0 + r]));
      const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc), sw), _mm512_set1_ps(a.sa[r0 + r]));
      _mm512_storeu_ps(a.out + (r0 + r) * n + (p + i) * kPanel, y);
    }
  }
}

// In groups, rows [r0, r0 + rows) x panels [p, p + NP) of signed panels: a batch of groups' sums
// stored, then folded a row tile and panel at a time with its 16 rows' float sums in registers:
// y = fma(float(sum_g), s_g (times the row's group scale with sa_groups), y) in group order, the
// twin's; at the end times the row scale unless sa_groups.
template <int NP>
__attribute__((target(CPK_AMX_TARGET))) void group_block(const LinearArgs& a, const int8_t* act, int64_t r0,
                                                         int64_t rows, const uint8_t* const* w, int64_t p,
                                                         Scratch& s) {
  const int64_t k = a.k, n = a.n, groups = a.groups, per_group = k / groups;
  const bool pg = a.sa_groups;
  for (int64_t g0 = 0; g0 < groups; g0 += kBatch) {
    const int64_t g1 = std::min(groups, g0 + kBatch);
    for (int64_t g = g0; g < g1; ++g) {
      zero_sums<NP>();
      block_sums<NP, true>(act, k, w, g * per_group, (g + 1) * per_group);
      store_sums<NP>(s.c.data() + (g - g0) * 4 * 256);
    }
    for (int64_t rt = 0; rt * 16 < rows; ++rt) {
      const int64_t live = std::min<int64_t>(16, rows - rt * 16);  // rows past it are padding
      for (int i = 0; i < NP; ++i) {
        const int tile = int(2 * rt + i);
        __m512 f[16];
        #pragma GCC unroll 16
        for (int r = 0; r < 16; ++r) f[r] = g0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(s.f[tile][r]);
        for (int64_t g = g0; g < g1; ++g) {
          const int32_t* c = s.c.data() + ((g - g0) * 4 + tile) * 256;
          const __m512 sg = _mm512_loadu_ps(a.sw + (p + i) * kPanel * groups + g * kPanel);
          #pragma GCC unroll 16
          for (int r = 0; r < 16; ++r) {
            const int64_t row = r0 + rt * 16 + std::min<int64_t>(r, live - 1);  // padding reads a live row's scale
            const __m512 scale = pg ? _mm512_mul_ps(sg, _mm512_set1_ps(a.sa[row * groups + g])) : sg;
            f[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c + r * 16)), scale, f[r]);
          }
        }
        if (g1 < groups) {
          #pragma GCC unroll 16
          for (int r = 0; r < 16; ++r) _mm512_storeu_ps(s.f[tile][r], f[r]);
          continue;
        }
        for (int64_t r = 0; r < live; ++r) {
          const int64_t row = r0 + rt * 16 + r;
          _mm512_storeu_ps(a.out + row * n + (p + i) * kPanel, pg ? f[r] : _mm512_mul_ps(f[r], _mm512_set1_ps(a.sa[row])));
        }
      }
    }
  }
}

// Whether the tiles take this linear: enough rows, K and the groups whole chunks of 64 inputs, scales
// and activations as the batched blocks read them. Groups of 32 (GGUF's Q4_0, Q8_0, the K-quants)
// stay on VNNI: folding every 32 inputs' sums cost the tiles their gain (a build that took them, not
// kept; Intel Xeon AVX-512 VNNI + AMX, 2B shape, M = 512, alternated in one process: int4 0.99x,
// int8 1.12x against VNNI; groups of 128 1.96x; docs/benchmarks.md, session 41).
bool tiles_take(const LinearArgs& a) {
  if (!amx_on.load(std::memory_order_relaxed) || !amx_usable()) return false;  // off: never even probed
  if (a.m < kAmxRows || a.direct != nullptr || a.sa_per != 0 || a.high_bits != 0) return false;
  return a.k % a.groups == 0 && (a.k / a.groups) % kChunk == 0;
}

// Full panels [p0, p1) of a thread on the tiles; returns the first panel it did not do (a narrow last
// panel, or p0 when the tiles do not take this linear).
__attribute__((target(CPK_AMX_TARGET))) int64_t amx_panels(const LinearArgs& a, int64_t p0, int64_t p1, bool int4) {
  const int64_t end = std::min(p1, a.n / kPanel);  // full panels only
  if (p0 >= end || !tiles_take(a)) return p0;
  thread_local Scratch s;
  const int64_t k = a.k, m = a.m;
  const bool grouped = int4 || a.groups > 1;
  if (grouped && int64_t(s.wide.size()) < 2 * kPanel * k) s.wide.resize(2 * kPanel * k);
  if (s.c.size() < size_t(kBatch * 4 * 256)) s.c.resize(kBatch * 4 * 256);
  const int64_t tail = m % kBlockRows;
  if (tail != 0) {  // the last block's rows, zero-padded to a whole block (tile loads read 32 rows)
    s.rows.assign(kBlockRows * k, 0);
    std::memcpy(s.rows.data(), a.qa + (m - tail) * k, tail * k);
  }
  load_config(tile_config());
  const uint8_t* pw = static_cast<const uint8_t*>(a.w);
  const int64_t per_column = int4 ? k / 2 : k;  // K a multiple of 64: no quad padding
  for (int64_t p = p0; p < end; p += 2) {
    const int np = end - p >= 2 ? 2 : 1;
    const uint8_t* w[2];
    for (int i = 0; i < np; ++i) {
      w[i] = pw + (p + i) * kPanel * per_column;
      if (grouped) {
        int8_t* dst = s.wide.data() + i * kPanel * k;
        signed_panel(w[i], k, int4, dst);
        w[i] = reinterpret_cast<const uint8_t*>(dst);
      }
    }
    for (int64_t r0 = 0; r0 < m; r0 += kBlockRows) {
      const int64_t rows = std::min(kBlockRows, m - r0);
      const int8_t* act = rows == kBlockRows ? a.qa + r0 * k : s.rows.data();
      if (grouped && np == 2)
        group_block<2>(a, act, r0, rows, w, p, s);
      else if (grouped)
        group_block<1>(a, act, r0, rows, w, p, s);
      else if (np == 2)
        channel_block<2>(a, act, r0, rows, w, p, s);
      else
        channel_block<1>(a, act, r0, rows, w, p, s);
    }
  }
  _tile_release();
  tile_calls.fetch_add(1, std::memory_order_relaxed);
  return end;
}

}  // namespace

bool amx_usable() {
  static const bool usable = detect_amx();
  return usable;
}

bool amx_enabled() { return amx_on.load(std::memory_order_relaxed) && amx_usable(); }

bool set_amx(bool on) { return amx_on.exchange(on, std::memory_order_relaxed); }

bool amx_switched_on() { return amx_on.load(std::memory_order_relaxed); }

uint64_t amx_tile_calls() { return tile_calls.load(std::memory_order_relaxed); }

int64_t w8a8_amx(const LinearArgs& a, int64_t p0, int64_t p1) { return amx_panels(a, p0, p1, false); }

int64_t w4a8_amx(const LinearArgs& a, int64_t p0, int64_t p1) { return amx_panels(a, p0, p1, true); }

}  // namespace cpk

#endif
