// fuzz_driver.cc: seeded fuzzing of the native launchers (csrc/cpu_launchers.h) with malformed data.
//
// Every case builds exact-size heap buffers (so AddressSanitizer flags any byte read or written
// outside them), fills them with malformed values (negative and huge slots, seeds, predecessors, LUT
// entries, table and pool values; non-monotonic and overlong offsets; negative and huge counts;
// ring capacity 1; canary and KV buffers of random bytes; real-KV sources with offsets up to the
// largest allowed, too few rows or insane geometry), runs one launcher, and compares EVERY output
// byte with an independent oracle written here from docs/format.md §4-§9 (it shares no code with
// canary_core.h except the constants). On top of the byte equality it checks the format's
// per-launch invariants explicitly:
//   Δkernel_run == 1; verify never changes the canary; Δslot_run == active (verify) or the number of
//   non-skipped entries (write); verify rows <= 3 x active; the ring is fill-once (rows go to
//   base + k only while inside the ring, nothing else moves); write_index saturates at 2^31 - 1;
//   every INDEX_OUT_OF_RANGE row has fail bits exactly 64, a valid IndexKind and its bound.
// A "cycle" op runs a small well-formed serving loop (plan -> verify -> write per step through the
// real launchers) and requires zero violations, then injects a req_to_token swap and requires rows.
// Half of the launches (chosen by the seed) run on the parallel launchers: a pool of std::threads,
// chunks of 1..5 entries, so that small cases cross chunk boundaries (cpu_parallel.h).
//
// A "checks" op fuzzes the handlers' argument checks (csrc/call_args.h) and launches what they accept.
//
// usage: fuzz_driver [cases_per_op=10000] [seed=1] [op=all|verify|write|plan|scatter|cycle|checks] [case]
// Exit status 0 when nothing was found, 1 on any failure (each failure prints a rerun command).
#include <cinttypes>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "call_args.h"
#include "cpu_launchers.h"

using namespace kvcanary;

namespace {

// ---- bookkeeping ---------------------------------------------------------------------------------
long g_failures = 0;
const char* g_op = "";
uint64_t g_seed = 0;
int64_t g_case = 0;

#define CHECK(cond, ...)                                                                                   \
  do {                                                                                                     \
    if (!(cond)) {                                                                                         \
      ++g_failures;                                                                                        \
      std::fprintf(stderr, "FAIL [%s case %" PRId64 "] %s:%d: %s: ", g_op, g_case, __FILE__, __LINE__,     \
                   #cond);                                                                                 \
      std::fprintf(stderr, __VA_ARGS__);                                                                   \
      std::fprintf(stderr, "\n  rerun: fuzz_driver 1 %" PRIu64 " %s %" PRId64 "\n", g_seed, g_op, g_case); \
      if (g_failures >= 20) {                                                                              \
        std::fprintf(stderr, "too many failures; stopping\n");                                            \
        std::exit(1);                                                                                      \
      }                                                                                                    \
    }                                                                                                      \
  } while (0)

struct Coverage {
  uint64_t kinds_seen = 0;  // bit k: IndexKind code k appeared in an actual ring row
  long rows = 0, oob_rows = 0, dropped = 0, saturated = 0, disabled = 0, zero_row_cases = 0, wrapped = 0;
  long launches = 0;
  long row_starts = 0;  // plan launches that read a flat table through row_starts
};
Coverage g_cov[7];

// A fixed pool of worker threads for the parallel launchers (cpu_parallel.h's Pool: schedule(F&&)).
class ThreadPool {
 public:
  explicit ThreadPool(int n) {
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& th : threads_) th.join();
  }
  template <class F>
  void schedule(F&& f) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.emplace_back(std::forward<F>(f));
    }
    cv_.notify_one();
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }
  std::vector<std::thread> threads_;
  std::deque<std::function<void()>> tasks_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
};
ThreadPool& g_pool() {
  static ThreadPool pool(3);
  return pool;
}
long g_parallel_launches = 0;
int g_opi = 0;

// ---- rng and value pickers -----------------------------------------------------------------------
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int64_t range(int64_t lo, int64_t hi) {  // inclusive; small spans only
    const uint64_t span = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) + 1;
    return static_cast<int64_t>(static_cast<uint64_t>(lo) + next() % span);
  }
  bool pct(int p) { return static_cast<int>(next() % 100) < p; }
};

// Runs launch(executor): the sequential one, or for half the launches the parallel launchers on the
// thread pool with chunks of 1..5 entries.
template <class Launch>
void with_executor(Rng& g, Launch&& launch) {
  if (g.pct(50)) return launch(Sequential{});
  ++g_parallel_launches;
  launch(PoolExecutor<ThreadPool>(g_pool(), 4, g.range(1, 5)));
}

constexpr int64_t I64MIN = INT64_MIN, I64MAX = INT64_MAX;
const int64_t kHuge[] = {I64MIN, I64MAX, INT32_MIN, INT32_MAX, int64_t(INT32_MAX) + 1, int64_t(INT32_MIN) - 1,
                         int64_t(1) << 40, -(int64_t(1) << 40), 0xFFFFFFFFll, I64MAX - 1, I64MIN + 1,
                         int64_t(1) << 62, -(int64_t(1) << 62), int64_t(1) << 32};

// A value that is usually in [lo, hi] (a small range), often at its edges, sometimes huge or random.
int64_t pick(Rng& g, int64_t lo, int64_t hi) {
  const int k = static_cast<int>(g.next() % 100);
  if (k < 62) return g.range(lo, hi);
  if (k < 80) {
    const int64_t edge[] = {lo - 1, lo, hi, hi + 1, -1, 0, 1, -2};
    return edge[g.next() % 8];
  }
  if (k < 92) return kHuge[g.next() % (sizeof(kHuge) / sizeof(kHuge[0]))];
  if (k < 96) return static_cast<int64_t>(g.next());
  return static_cast<int64_t>(static_cast<int32_t>(g.next()));
}

// ---- exact-size buffers --------------------------------------------------------------------------
template <class T>
struct Heap {  // exactly n elements on the heap (n may be 0): ASan sees every overrun
  std::unique_ptr<T[]> p;
  int64_t n = 0;
  Heap() : p(new T[0]) {}
  explicit Heap(int64_t n_) : p(new T[n_ > 0 ? n_ : 0]), n(n_ > 0 ? n_ : 0) {}
  Heap(const Heap& o) : Heap(o.n) { if (n) std::memcpy(p.get(), o.p.get(), n * sizeof(T)); }
  Heap& operator=(const Heap& o) {
    Heap t(o);
    std::swap(p, t.p);
    std::swap(n, t.n);
    return *this;
  }
  T* data() { return p.get(); }
  const T* data() const { return p.get(); }
  T& operator[](int64_t i) { return p[i]; }
  const T& operator[](int64_t i) const { return p[i]; }
  bool same(const Heap& o) const { return n == o.n && (n == 0 || std::memcmp(p.get(), o.p.get(), n * sizeof(T)) == 0); }
};

void fill_random(Rng& g, uint8_t* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(g.next());
}

struct Idx {  // an int32 or int64 index array, exact size; values narrowed when int32
  bool is64 = false;
  Heap<int32_t> a32;
  Heap<int64_t> a64;
  int64_t n = 0;
  Idx() = default;
  Idx(int64_t n_, bool w) : is64(w), a32(w ? 0 : n_), a64(w ? n_ : 0), n(n_ > 0 ? n_ : 0) {}
  void set(int64_t i, int64_t v) {
    if (is64) a64[i] = v;
    else a32[i] = static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(v)));
  }
  int64_t get(int64_t i) const { return is64 ? a64[i] : static_cast<int64_t>(a32[i]); }
  IndexView view() const {
    return IndexView{is64 ? static_cast<const void*>(a64.data()) : static_cast<const void*>(a32.data()), is64};
  }
};

// ---- independent arithmetic (no canary_core.h functions) ----------------------------------------
int64_t wadd(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b)); }
int64_t wsub(int64_t a, int64_t b) { return static_cast<int64_t>(static_cast<uint64_t>(a) - static_cast<uint64_t>(b)); }
int64_t clampi(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }
int32_t low32(int64_t v) { return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint64_t>(v))); }
uint64_t sm64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
uint64_t m3(uint64_t a, uint64_t b, uint64_t c) { return sm64(sm64(sm64(a) ^ b) ^ c); }
const uint64_t kAnchorHash = 0xDE7FAE23A9A1B716ull;
int64_t rd64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];  // explicit little-endian
  return static_cast<int64_t>(v);
}
void wr64(uint8_t* p, int64_t v) {
  uint64_t u = static_cast<uint64_t>(v);
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(u >> (8 * i));
}

using OracleRow = std::vector<int64_t>;  // 8 columns
OracleRow row8(int64_t a, int64_t b, int64_t c, int64_t d, int64_t e, int64_t f, int64_t g, int64_t h) {
  return OracleRow{a, b, c, d, e, f, g, h};
}

// ---- canary --------------------------------------------------------------------------------------
struct Canary {
  int64_t S, stride;
  Heap<uint8_t> bytes;
  Canary(int64_t s, int64_t st) : S(s), stride(st), bytes(s * st) {}
  CanaryView view() { return CanaryView{bytes.data(), S, stride}; }
  int64_t f(int64_t s, int k) const { return rd64(bytes.data() + s * stride + 8 * k); }
  void set(int64_t s, int64_t tok, int64_t pos, int64_t prev, int64_t rkv) {
    uint8_t* p = bytes.data() + s * stride;
    wr64(p, tok), wr64(p + 8, pos), wr64(p + 16, prev), wr64(p + 24, rkv);
  }
  uint64_t succ(int64_t s) const {  // s < S
    if (s < 0) return kAnchorHash;
    return m3(static_cast<uint64_t>(f(s, 2)), static_cast<uint64_t>(f(s, 0)), static_cast<uint64_t>(f(s, 1)));
  }
};

Canary random_canary(Rng& g) {
  const int64_t S = g.pct(10) ? 1 : g.range(1, 40);
  const int64_t strides[] = {32, 32, 32, 40, 48, 64};
  Canary c(S, strides[g.next() % 6]);
  const int k = static_cast<int>(g.next() % 3);
  if (k == 0) fill_random(g, c.bytes.data(), c.bytes.n);
  else std::memset(c.bytes.data(), 0, c.bytes.n);
  if (k == 2) fill_random(g, c.bytes.data(), c.bytes.n / 4);  // partly garbage
  return c;
}

// ---- log -----------------------------------------------------------------------------------------
struct Log {
  int64_t cap, T;
  Heap<uint8_t> ring, kc, sc;
  Heap<int32_t> wi;
  Log(int64_t c, int64_t t) : cap(c), T(t), ring(c * 64), kc(t * 8), sc(t * 8), wi(1) {}
  LogView view() { return LogView{ring.data(), cap, wi.data(), kc.data(), sc.data()}; }
};

Log random_log(Rng& g) {
  const int64_t caps[] = {1, 1, 2, 3, 4, 8, 64};
  Log L(caps[g.next() % 7], g.range(1, NUM_LAUNCH_TAGS));
  fill_random(g, L.ring.data(), L.ring.n);
  if (g.pct(50)) {
    std::memset(L.kc.data(), 0, L.kc.n);
    std::memset(L.sc.data(), 0, L.sc.n);
  } else {
    fill_random(g, L.kc.data(), L.kc.n);  // wrap-around adds from any value
    fill_random(g, L.sc.data(), L.sc.n);
  }
  const int k = static_cast<int>(g.next() % 10);
  if (k < 4) L.wi[0] = 0;
  else if (k < 6) L.wi[0] = static_cast<int32_t>(g.range(0, L.cap + 2));
  else if (k < 8) L.wi[0] = static_cast<int32_t>(WRITE_INDEX_MAX - g.range(0, 3));  // near saturation
  else L.wi[0] = static_cast<int32_t>(pick(g, -3, L.cap + 3));                     // negative / garbage
  return L;
}

// Expected log after a launch: rows placed fill-once, saturating index, counter deltas at `tag`.
void check_log(const Log& before, const Log& after, int64_t tag, int64_t dslot, const std::vector<OracleRow>& rows,
               bool allow_rows, int64_t max_rows) {
  Coverage& cov = g_cov[g_opi];
  ++cov.launches;
  // counters: only row `tag` moves, by exactly +1 / +dslot (wrap-around)
  for (int64_t t = 0; t < before.T; ++t) {
    const int64_t k0 = rd64(before.kc.data() + 8 * t), k1 = rd64(after.kc.data() + 8 * t);
    const int64_t s0 = rd64(before.sc.data() + 8 * t), s1 = rd64(after.sc.data() + 8 * t);
    CHECK(wsub(k1, k0) == (t == tag ? 1 : 0), "kernel_run[%" PRId64 "] moved by %" PRId64, t, wsub(k1, k0));
    CHECK(wsub(s1, s0) == (t == tag ? dslot : 0), "slot_run[%" PRId64 "] moved by %" PRId64 ", want %" PRId64, t,
          wsub(s1, s0), t == tag ? dslot : 0);
  }
  const int64_t n = static_cast<int64_t>(rows.size());
  CHECK(allow_rows || n == 0, "oracle produced %" PRId64 " rows where none are allowed", n);
  CHECK(n <= max_rows, "%" PRId64 " rows > bound %" PRId64, n, max_rows);
  const int64_t base = before.wi[0];
  const int64_t want_wi = n == 0 ? base : (base + n > WRITE_INDEX_MAX ? WRITE_INDEX_MAX : base + n);
  CHECK(after.wi[0] == want_wi, "write_index %d, want %" PRId64 " (base %" PRId64 ", %" PRId64 " rows)", after.wi[0],
        want_wi, base, n);
  if (n == 0) ++cov.zero_row_cases;
  if (n > 0 && base + n > WRITE_INDEX_MAX) ++cov.saturated;
  for (int64_t r = 0; r < before.cap; ++r) {
    const uint8_t* a = after.ring.data() + 64 * r;
    const int64_t k = r - base;
    if (k >= 0 && k < n) {  // a row of this launch
      for (int c = 0; c < 8; ++c)
        CHECK(rd64(a + 8 * c) == rows[k][c], "ring[%" PRId64 "][%d] = %" PRId64 ", want %" PRId64, r, c,
              rd64(a + 8 * c), rows[k][c]);
      const int64_t bits = rd64(a + 56);
      CHECK(rd64(a) == tag, "row tag %" PRId64 " != %" PRId64, rd64(a), tag);
      if (bits & 64) {
        const int64_t code = rd64(a + 40);
        CHECK(bits == 64, "OOB row with bits %" PRId64 " (must be exactly 64)", bits);
        CHECK((code >= 1 && code <= 4) || (code >= 16 && code <= 19), "OOB row with IndexKind %" PRId64, code);
        ++cov.oob_rows;
        if (code >= 0 && code < 64) cov.kinds_seen |= uint64_t(1) << code;
      }
      ++cov.rows;
    } else {
      CHECK(std::memcmp(a, before.ring.data() + 64 * r, 64) == 0, "ring row %" PRId64 " changed outside [base, base+n)",
            r);
    }
  }
  if (n > 0 && (base < 0 || base + n > before.cap)) ++cov.dropped;
}

// ---- real-KV sources -----------------------------------------------------------------------------
struct Src {
  Heap<uint8_t> data;
  int64_t rows, row_bytes, page_size, bpt, read_bytes;
  int64_t offset = 0;  // offset_bytes: the strip's start inside the slot
};

struct Sources {
  std::vector<Src> v;
  int32_t mode = 0;
  // What the launcher sees (built with the core's make_source_view, as the FFI glue does).
  RealKvSources core() const {
    RealKvSources out{};
    out.mode = mode;
    out.count = 0;
    for (const Src& s : v)
      out.src[out.count++] =
          make_source_view(s.data.data(), s.rows, s.row_bytes, s.page_size, s.bpt, s.read_bytes, s.offset, mode);
    if (out.count == 0 || out.mode == 0) out.count = 0, out.mode = 0;
    return out;
  }
  // ---- independent model of §4.4 ----
  bool active() const { return mode != 0 && !v.empty(); }
  int64_t eff(const Src& s) const { return mode == 1 ? 16 : s.read_bytes; }
  int64_t ps(const Src& s) const { return s.page_size >= 1 ? s.page_size : 1; }
  bool sane(const Src& s) const {  // geometry the Python checks guarantee; anything else has no rows
    const int64_t e = eff(s);
    return s.page_size >= 1 && s.bpt > 0 && e > 0 && e % 16 == 0 && e <= s.bpt && s.offset >= 0 &&
           s.offset % 16 == 0 && static_cast<__int128>(s.offset) + e <= s.bpt && s.row_bytes >= 0 &&
           static_cast<__int128>(s.page_size) * s.bpt <= s.row_bytes;
  }
  int64_t rows(const Src& s) const { return sane(s) && s.rows > 0 ? s.rows : 0; }
  int first_bad(int64_t slot) const {
    for (size_t k = 0; k < v.size(); ++k)
      if (slot / ps(v[k]) >= rows(v[k])) return static_cast<int>(k);
    return -1;
  }
  uint64_t fold(int k, int64_t slot) const {  // consecutive LE words of the strip
    const Src& s = v[k];
    const int64_t row = slot / s.page_size, col = (slot % s.page_size) * s.bpt + s.offset;
    const uint8_t* p = s.data.data() + row * s.row_bytes + col;
    uint64_t acc = 0;
    for (int64_t off = 0; off < eff(s); off += 8) acc = sm64(acc ^ static_cast<uint64_t>(rd64(p + off)));
    return acc;
  }
  uint64_t hash(int64_t slot) const {
    uint64_t acc = 0;
    for (size_t k = 0; k < v.size(); ++k) acc = sm64(acc ^ fold(static_cast<int>(k), slot));
    return acc;
  }
  OracleRow oob(int64_t tag, int64_t slot, int64_t pos, int64_t tok, int k) const {
    return row8(tag, slot, pos, tok, slot / ps(v[k]), 16 + k, rows(v[k]), 64);
  }
};

Sources random_sources(Rng& g, int64_t S) {
  Sources out;
  const int k = static_cast<int>(g.next() % 10);
  out.mode = k < 3 ? 0 : (k < 6 ? 1 : 2);
  const int count = g.pct(15) ? 0 : static_cast<int>(g.range(1, MAX_REAL_KV_SOURCES));
  for (int i = 0; i < count; ++i) {
    Src s;
    const int64_t pss[] = {1, 1, 2, 3, 4, 8};
    s.page_size = pss[g.next() % 6];
    s.bpt = 16 * g.range(1, 4);
    s.read_bytes = 16 * g.range(1, s.bpt / 16);
    // offset_bytes as Python allows it (offset + read_bytes <= bpt), often the largest such
    const int64_t max_offset = s.bpt - s.read_bytes;
    s.offset = g.pct(40) ? 0 : (g.pct(40) ? max_offset : 16 * g.range(0, max_offset / 16));
    s.row_bytes = s.page_size * s.bpt + 16 * g.range(0, 2);  // with a hole at the end sometimes
    const int64_t need = (S + s.page_size - 1) / s.page_size;
    s.rows = g.pct(60) ? need + g.range(0, 1) : g.range(0, need);  // often too few rows
    if (g.pct(8)) {  // insane geometry (never produced by Python): must read nothing
      switch (g.next() % 10) {
        case 0: s.page_size = pick(g, -2, 0); break;
        case 1: s.bpt = pick(g, -16, 8); break;
        case 2: s.read_bytes = s.bpt + 16; break;
        case 3: s.read_bytes = pick(g, -16, 15); break;
        case 4: s.row_bytes = s.page_size * s.bpt - 16; break;
        case 5: s.offset = g.pct(50) ? -16 : 8; break;                              // negative / misaligned
        case 6: s.offset = s.bpt - (out.mode == 1 ? 16 : s.read_bytes) + 16; break;  // strip past the slot
        case 7: s.offset = g.pct(50) ? I64MAX - 15 : I64MIN; break;                 // offset + eff overflows
        case 8: s.offset = s.bpt; break;                                            // strip starts past it
        default: s.page_size = I64MAX / 2; break;  // page_size * bpt overflows int64
      }
      if (s.row_bytes < 0) s.row_bytes = 0;
    }
    s.data = Heap<uint8_t>(s.rows * s.row_bytes);
    fill_random(g, s.data.data(), s.data.n);
    if (g.pct(10)) std::memset(s.data.data(), 0, s.data.n);
    out.v.push_back(std::move(s));
  }
  return out;
}

// ======================================== VERIFY ==================================================
std::vector<OracleRow> oracle_verify(const Canary& c, const Idx& slots, const Idx& toks, const Idx& poss, const Idx& prevs,
                                     bool check, const Sources& src, int64_t tag, int64_t active) {
  std::vector<OracleRow> rows;
  const int64_t S = c.S;
  for (int64_t e = 0; e < active; ++e) {
    const int64_t slot = slots.get(e), epos = poss.get(e), prev = prevs.get(e);
    const int64_t etok = check ? toks.get(e) : -1;
    if (slot == 0) continue;
    if (slot < 0 || slot >= S) {
      rows.push_back(row8(tag, slot, epos, -1, slot, 3, S, 64));
      continue;
    }
    const int64_t st_tok = c.f(slot, 0), st_pos = c.f(slot, 1), st_chain = c.f(slot, 2), st_rkv = c.f(slot, 3);
    bool chain_checked = prev != 0;
    if (prev >= S) {
      rows.push_back(row8(tag, slot, epos, -1, prev, 4, S, 64));
      chain_checked = false;
    }
    const int64_t exp_chain = chain_checked ? static_cast<int64_t>(c.succ(prev)) : st_chain;
    bool rkv_checked = true;
    int64_t exp_rkv = 0;
    if (src.active()) {
      const int k = src.first_bad(slot);
      if (k < 0) exp_rkv = static_cast<int64_t>(src.hash(slot));
      else rows.push_back(src.oob(tag, slot, epos, -1, k)), rkv_checked = false;
    }
    int64_t bits = 0;
    if (chain_checked && st_chain != exp_chain) bits |= 1;
    if (check && etok != -1 && st_tok != etok) bits |= 32;
    if (st_pos != epos) bits |= 2;
    if (rkv_checked && st_rkv != exp_rkv) bits |= 4;
    if (bits) rows.push_back(row8(tag, slot, st_pos, st_tok, etok, st_chain, exp_chain, bits));
  }
  return rows;
}

void fuzz_verify(Rng& g) {
  Canary c = random_canary(g);
  const int64_t S = c.S;
  Log L = random_log(g);
  const int64_t tag = g.range(0, L.T - 1);
  const int64_t V = g.range(1, 24);
  auto w = [&]() { return g.pct(50); };
  Idx slots(V, w()), toks(V, w()), poss(V, w()), prevs(V, w());
  Sources src = random_sources(g, S);
  // A well-formed chain over a random permutation of slots, stamped into the canary, so that many
  // entries pass; then malformed values and corruptions on top.
  std::vector<int64_t> perm;
  for (int64_t s = 1; s < S; ++s) perm.push_back(s);
  for (size_t i = perm.size(); i > 1; --i) std::swap(perm[i - 1], perm[g.next() % i]);
  uint64_t h = kAnchorHash;
  const bool chain_mode = g.pct(60);
  const int64_t pos0 = g.pct(70) ? 0 : pick(g, 0, 100);
  for (int64_t e = 0; e < V; ++e) {
    if (chain_mode && e < static_cast<int64_t>(perm.size())) {
      const int64_t slot = perm[e], tok = g.range(-3, 50000), pos = wadd(pos0, e);
      const bool rkv_ok = src.active() && src.first_bad(slot) < 0;
      c.set(slot, tok, pos, static_cast<int64_t>(h), rkv_ok ? static_cast<int64_t>(src.hash(slot)) : 0);
      slots.set(e, slot), toks.set(e, g.pct(80) ? tok : -1), poss.set(e, pos);
      prevs.set(e, e == 0 ? (pos0 == 0 ? -1 : 0) : perm[e - 1]);
      h = m3(h, static_cast<uint64_t>(tok), static_cast<uint64_t>(pos));
    } else {
      slots.set(e, pick(g, -2, S + 1)), toks.set(e, pick(g, -2, 50)), poss.set(e, pick(g, -1, 40));
      prevs.set(e, pick(g, -2, S + 1));
    }
    if (g.pct(10)) slots.set(e, pick(g, -2, S + 1));
    if (g.pct(10)) prevs.set(e, pick(g, -2, S + 1));
    if (g.pct(5)) poss.set(e, pick(g, -1, 40));
  }
  if (g.pct(20) && S > 1) fill_random(g, c.bytes.data() + g.range(1, S - 1) * c.stride, 32);  // corrupt a record
  const int32_t nv = static_cast<int32_t>(g.pct(70) ? g.range(0, V) : pick(g, -2, V + 2));
  const int32_t en = static_cast<int32_t>(g.pct(85) ? 1 : pick(g, -1, 1));
  const bool check = g.pct(50);

  const Canary c0 = c;
  const Log L0 = L;
  VerifyArgs a{};
  a.canary = c.view();
  a.slots = slots.view(), a.tokens = toks.view(), a.positions = poss.view(), a.prevs = prevs.view();
  a.check_token = check;
  a.sources = src.core();
  a.tag = tag;
  with_executor(g, [&](const auto& exec) { verify_launch(a, V, nv, en, L.view(), exec); });

  CHECK(c.bytes.same(c0.bytes), "verify changed the canary");
  if (en == 0) {
    ++g_cov[g_opi].disabled;
    check_log(L0, L, tag, 0, {}, false, 0);
    return;
  }
  const int64_t active = clampi(nv, 0, V);
  const auto rows = oracle_verify(c0, slots, toks, poss, prevs, check, src, tag, active);
  check_log(L0, L, tag, active, rows, true, 3 * active);
  // The per-entry path of the CUDA kernels (verify_entry hashing each predecessor itself, no hashes
  // taken a block ahead): the same ring bytes from the same base.
  Log L2 = L0;
  RingAppender emit{L2.ring.data(), L2.cap, L0.wi[0]};
  for (int64_t e = 0; e < active; ++e) verify_entry(a, e, emit);
  CHECK(L2.ring.same(L.ring), "verify_entry without hashes taken ahead: ring differs from the launcher's");
}

// ======================================== WRITE ===================================================
struct WriteCase {
  int64_t C, N;
  Idx offsets, seeds, ids, poss, locs, et, ep;
  int32_t nvr;
  bool input_assert, chain_assert;
  int64_t tag;
};

// §7.3 on a copy of the canary; returns rows, sets dslot.
std::vector<OracleRow> oracle_write(Canary& c, const WriteCase& w, const Sources& src, int64_t& dslot) {
  std::vector<OracleRow> rows;
  const int64_t S = c.S, tag = w.tag;
  const int64_t active = clampi(w.nvr, 0, w.C);
  std::vector<int64_t> o(active + 1);
  o[0] = clampi(w.offsets.get(0), 0, w.N);
  for (int64_t k = 1; k <= active; ++k) o[k] = clampi(w.offsets.get(k), o[k - 1], w.N);
  dslot = 0;
  for (int64_t r = 0; r < active; ++r) {
    const int64_t lo = o[r], hi = o[r + 1];
    if (hi == lo) continue;
    int64_t seed = w.seeds.get(r);
    if (seed >= S) {
      rows.push_back(row8(tag, seed, -1, -1, seed, 2, S, 64));
      seed = -1;
    }
    uint64_t running = c.succ(seed);
    const bool do_pos = seed >= 0 && w.chain_assert;
    int64_t last_pos = do_pos ? c.f(seed, 1) : 0;
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t slot = w.locs.get(i);
      if (slot < 0) continue;
      ++dslot;
      const int64_t tok = w.ids.get(i), pos = w.poss.get(i);
      const bool in_range = slot < S;
      int64_t rkv = 0;
      if (!in_range) {
        rows.push_back(row8(tag, slot, pos, tok, slot, 1, S, 64));
      } else if (src.active()) {
        const int k = src.first_bad(slot);
        if (k < 0) rkv = static_cast<int64_t>(src.hash(slot));
        else rows.push_back(src.oob(tag, slot, pos, tok, k));
      }
      if (w.input_assert) {
        const int64_t et = w.et.get(i), ep = w.ep.get(i);
        const int64_t bits = (tok != et ? 8 : 0) | (pos != ep ? 16 : 0);
        if (bits) rows.push_back(row8(tag, slot, pos, tok, et, static_cast<int64_t>(running), ep, bits));
      }
      if (do_pos) {
        const int64_t exp = wadd(last_pos, 1);
        if (pos != exp) rows.push_back(row8(tag, slot, pos, tok, tok, static_cast<int64_t>(running), exp, 16));
        last_pos = pos;
      }
      if (in_range) c.set(slot, tok, pos, static_cast<int64_t>(running), rkv);
      running = m3(running, static_cast<uint64_t>(tok), static_cast<uint64_t>(pos));
    }
  }
  return rows;
}

void fuzz_write(Rng& g) {
  Canary c = random_canary(g);
  const int64_t S = c.S;
  Log L = random_log(g);
  WriteCase w;
  w.tag = g.range(0, L.T - 1);
  w.C = g.range(1, 6);
  w.N = g.pct(10) ? 0 : g.range(0, 24);
  auto wide = [&]() { return g.pct(50); };
  w.offsets = Idx(w.C + 1, wide());
  w.seeds = Idx(w.C, wide());
  w.ids = Idx(w.N, wide()), w.poss = Idx(w.N, wide()), w.locs = Idx(w.N, wide());
  w.input_assert = g.pct(40);
  w.et = Idx(w.input_assert ? w.N : 0, wide()), w.ep = Idx(w.input_assert ? w.N : 0, wide());
  w.chain_assert = g.pct(75);
  // offsets: well-formed cumulative lengths, or malformed values
  if (g.pct(60)) {
    int64_t acc = 0;
    for (int64_t r = 0; r <= w.C; ++r) {
      w.offsets.set(r, acc);
      acc += g.range(0, 5);
    }
    if (g.pct(30)) w.offsets.set(g.range(0, w.C), pick(g, -2, w.N + 2));
  } else {
    for (int64_t r = 0; r <= w.C; ++r) w.offsets.set(r, pick(g, -2, w.N + 3));
  }
  for (int64_t r = 0; r < w.C; ++r) w.seeds.set(r, pick(g, -2, S + 1));
  const int64_t p0 = g.range(0, 8);
  for (int64_t i = 0; i < w.N; ++i) {
    w.ids.set(i, g.pct(85) ? g.range(-2, 1000) : pick(g, 0, 10));
    w.poss.set(i, g.pct(70) ? p0 + i : pick(g, -1, 30));
    w.locs.set(i, g.pct(70) ? g.range(0, S - 1) : pick(g, -2, S + 1));
    if (w.input_assert) {
      w.et.set(i, g.pct(85) ? w.ids.get(i) : pick(g, -1, 1000));
      w.ep.set(i, g.pct(85) ? w.poss.get(i) : pick(g, -1, 30));
    }
  }
  w.nvr = static_cast<int32_t>(g.pct(70) ? g.range(0, w.C) : pick(g, -2, w.C + 2));
  Sources src = random_sources(g, S);

  Canary expect = c;
  const Log L0 = L;
  WriteArgs a{};
  a.canary = c.view();
  a.seeds = w.seeds.view(), a.input_ids = w.ids.view(), a.positions = w.poss.view(), a.locs = w.locs.view();
  a.exp_tokens = w.et.view(), a.exp_positions = w.ep.view();
  a.input_assert = w.input_assert;
  a.chain_assert = w.chain_assert;
  a.sources = src.core();
  a.tag = w.tag;
  with_executor(g, [&](const auto& exec) { write_launch(a, w.offsets.view(), w.C, w.nvr, w.N, L.view(), exec); });

  int64_t dslot = 0;
  const auto rows = oracle_write(expect, w, src, dslot);
  for (int64_t s = 0; s < S; ++s)
    CHECK(std::memcmp(c.bytes.data() + s * c.stride, expect.bytes.data() + s * c.stride, c.stride) == 0,
          "canary slot %" PRId64 " differs: got tok=%" PRId64 " pos=%" PRId64 " prev=%" PRId64 " rkv=%" PRId64
          ", want tok=%" PRId64 " pos=%" PRId64 " prev=%" PRId64 " rkv=%" PRId64,
          s, c.f(s, 0), c.f(s, 1), c.f(s, 2), c.f(s, 3), expect.f(s, 0), expect.f(s, 1), expect.f(s, 2), expect.f(s, 3));
  const int64_t active = clampi(w.nvr, 0, w.C);
  check_log(L0, L, w.tag, dslot, rows, true, active + 3 * w.N);
}

// ======================================== PLAN ====================================================
struct PlanCase {
  int64_t bs, vcap, wcap, R, L, lut_len, Rp, Cp, window, token_offset;
  bool has_lut, has_pool, report_evicted;
  Idx rpi, P, E, r2t, lut, pool, vl;
  bool has_rs = false;  // row_starts: the slots are read from the flat table [N] instead of r2t
  int64_t N = 0;
  Idx flat, rs;
};

struct PlanExpect {
  std::vector<int32_t> slots, toks, poss, prevs, offsets, seeds;
  int32_t num_valid, enable, nvr;
  int64_t total;  // the int64 (wrap-around) sum of vlen
};

PlanExpect oracle_plan(const PlanCase& p) {  // §9.3, written out independently
  auto rt = [&](int64_t r, int64_t rp, int64_t pos) -> int64_t {
    if (p.has_rs) {
      // The exact sum: with pos >= 0 the int64 wrap of §9.3 only ever turns a sum >= 2^63 into a
      // negative index, so both read the same slots.
      const __int128 idx = static_cast<__int128>(p.rs.get(r)) + pos;
      return (pos >= 0 && idx >= 0 && idx < p.N) ? p.flat.get(static_cast<int64_t>(idx)) : -1;
    }
    return (rp >= 0 && rp < p.R && pos >= 0 && pos < p.L) ? p.r2t.get(rp * p.L + pos) : -1;
  };
  auto T = [&](int64_t x) -> int64_t {
    if (!p.has_lut) return x;
    return (x >= 0 && x < p.lut_len) ? p.lut.get(x) : -1;
  };
  auto pool_tok = [&](int64_t r, int64_t rp, int64_t s) -> int64_t {
    if (p.has_pool && s >= 0 && s < p.vl.get(r) && s < p.Cp && rp >= 0 && rp < p.Rp) return p.pool.get(rp * p.Cp + s);
    return -1;
  };
  PlanExpect x;
  x.slots.assign(p.vcap, 0), x.toks.assign(p.vcap, 0), x.poss.assign(p.vcap, 0), x.prevs.assign(p.vcap, 0);
  x.offsets.assign(p.wcap + 1, 0), x.seeds.assign(p.wcap, 0);
  std::vector<int64_t> ws(p.bs), vlen(p.bs), wlen(p.bs);
  int64_t total = 0, off = 0;
  for (int64_t r = 0; r < p.bs; ++r) {
    const int64_t rp = p.rpi.get(r), P = p.P.get(r), E = p.E.get(r);
    const bool live = rp != 0;
    ws[r] = p.window > 0 ? (wsub(P, p.window) > 0 ? wsub(P, p.window) : 0) : 0;
    vlen[r] = live ? (wsub(P, ws[r]) > 0 ? wsub(P, ws[r]) : 0) : 0;
    wlen[r] = live && E > 0 ? E : 0;
    total = wadd(total, vlen[r]);
    off = wadd(off, wlen[r]);
    x.offsets[r + 1] = low32(off);
    x.seeds[r] = low32((live && P > 0 && wlen[r] > 0) ? T(rt(r, rp, P - 1)) : -1);
  }
  x.total = total;
  x.num_valid = low32(total < p.vcap ? total : p.vcap);
  x.enable = total <= p.vcap ? 1 : 0;
  x.nvr = low32(p.bs);
  if (x.enable) {
    int64_t flat = 0;
    for (int64_t r = 0; r < p.bs && flat < total; ++r)
      for (int64_t j = 0; j < vlen[r] && flat < total; ++j, ++flat) {
        const int64_t rp = p.rpi.get(r), pos = wadd(ws[r], j);
        const int64_t full = rt(r, rp, pos), slot = T(full);
        x.slots[flat] = low32(p.report_evicted && slot == 0 && full > 0 ? -1 : slot);
        x.prevs[flat] = low32(pos > 0 ? T(rt(r, rp, pos - 1)) : -1);
        x.toks[flat] = low32(pool_tok(r, rp, wadd(pos, p.token_offset)));
        x.poss[flat] = low32(pos);
      }
  }
  return x;
}

void fuzz_plan(Rng& g) {
  PlanCase p;
  auto wide = [&]() { return g.pct(50); };
  p.bs = g.pct(5) ? 0 : g.range(0, 6);
  p.wcap = p.bs + g.range(p.bs == 0 ? 1 : 0, 3);
  p.vcap = g.pct(10) ? 1 : g.range(1, 40);
  p.R = g.pct(5) ? 0 : g.range(1, 5);
  p.L = g.pct(5) ? 0 : g.range(1, 12);
  const int64_t S = g.range(1, 40);  // the slot space the table points into
  const int k = static_cast<int>(g.next() % 10);
  p.window = k < 5 ? 0 : (k < 9 ? g.range(1, 6) : pick(g, 1, 6));
  if (p.window < 0) p.window = wsub(0, p.window) < 0 ? I64MAX : wsub(0, p.window);  // Python: >= 0
  p.has_lut = p.window > 0 || g.pct(15);
  p.lut_len = p.has_lut ? g.range(1, S + 3) : 0;
  p.report_evicted = p.has_lut && g.pct(50);
  p.has_pool = g.pct(40);
  p.Rp = p.has_pool ? g.range(0, 5) : 0;
  p.Cp = p.has_pool ? g.range(0, 12) : 0;
  const int64_t offs[] = {0, 0, 0, 1, 1, -1, 2, INT32_MIN, INT32_MAX};
  p.token_offset = g.pct(90) ? offs[g.next() % 9] : static_cast<int32_t>(g.next());
  p.rpi = Idx(p.bs, wide()), p.P = Idx(p.bs, wide()), p.E = Idx(p.bs, wide());
  p.r2t = Idx(p.R * p.L, wide());
  p.lut = Idx(p.lut_len, wide());
  p.pool = Idx(p.Rp * p.Cp, wide());
  p.vl = Idx(p.has_pool ? p.bs : 0, wide());
  for (int64_t r = 0; r < p.bs; ++r) {
    p.rpi.set(r, g.pct(75) ? g.range(0, p.R - 1 < 0 ? 0 : p.R - 1) : pick(g, -1, p.R));
    p.P.set(r, g.pct(70) ? g.range(0, p.L) : pick(g, -1, p.L + 2));
    p.E.set(r, g.pct(70) ? g.range(0, 4) : pick(g, -1, 5));
    if (p.has_pool) p.vl.set(r, g.pct(60) ? g.range(0, p.Cp) : pick(g, -1, p.Cp + 2));
  }
  for (int64_t i = 0; i < p.r2t.n; ++i) p.r2t.set(i, g.pct(80) ? g.range(0, S - 1) : pick(g, -1, S));
  for (int64_t i = 0; i < p.lut.n; ++i) p.lut.set(i, g.pct(80) ? g.range(0, S - 1) : pick(g, -1, S));
  for (int64_t i = 0; i < p.pool.n; ++i) p.pool.set(i, g.pct(85) ? g.range(-1, 1000) : pick(g, -1, 5));
  p.has_rs = g.pct(35);
  if (p.has_rs) {  // a flat page table; starts: segments in order, or before / across / past it, near the wrap
    p.N = g.pct(5) ? 0 : g.range(1, 40);
    p.flat = Idx(p.N, wide()), p.rs = Idx(p.bs, wide());
    for (int64_t i = 0; i < p.flat.n; ++i) p.flat.set(i, g.pct(80) ? g.range(0, S - 1) : pick(g, -1, S));
    int64_t cursor = 0;
    for (int64_t r = 0; r < p.bs; ++r) {
      const int k = static_cast<int>(g.next() % 100);
      if (k < 50) {
        p.rs.set(r, cursor);
        cursor += clampi(p.P.get(r), 0, p.L) + g.range(0, 3);
      } else if (k < 80) {
        p.rs.set(r, pick(g, -p.L, p.N + p.L));
      } else if (k < 90) {
        p.rs.set(r, I64MAX - g.range(0, p.L));  // sums wrap to the most negative indices
      } else if (k < 95) {
        p.rs.set(r, INT32_MAX - g.range(0, p.L));  // sums pass 2^31 (an int32 sum would wrap)
      } else {
        p.rs.set(r, (int64_t(1) << 32) + g.range(0, p.N));  // in the table if narrowed to 32 bits
      }
    }
  }

  PlanArgs a{};
  a.req_pool_indices = p.rpi.view(), a.prefix_lens = p.P.view(), a.extend_seq_lens = p.E.view();
  a.req_to_token = p.r2t.view(), a.R = p.R, a.L = p.L;
  if (p.has_rs) {  // R and L stay set: the flat read must not use them
    a.has_row_starts = true, a.row_starts = p.rs.view(), a.N = p.N;
    a.req_to_token = p.flat.view();
  }
  a.has_lut = p.has_lut, a.lut = p.lut.view(), a.lut_len = p.lut_len;
  a.has_pool = p.has_pool, a.pool = p.pool.view(), a.Rp = p.Rp, a.Cp = p.Cp, a.valid_lens = p.vl.view();
  a.window = p.window, a.token_offset = p.token_offset, a.report_evicted = p.report_evicted;
  Heap<int32_t> slots(p.vcap), toks(p.vcap), poss(p.vcap), prevs(p.vcap), nv(1), en(1), offsets(p.wcap + 1),
      seeds(p.wcap), nvr(1);
  for (Heap<int32_t>* h : {&slots, &toks, &poss, &prevs, &nv, &en, &offsets, &seeds, &nvr})
    std::memset(h->data(), 0xA5, h->n * sizeof(int32_t));  // stale garbage: every element must be written
  const PlanOut out{slots.data(), toks.data(), poss.data(), prevs.data(), nv.data(), en.data(),
                    offsets.data(), seeds.data(), nvr.data()};
  with_executor(g, [&](const auto& exec) { plan_launch(a, p.bs, p.vcap, p.wcap, out, exec); });

  const PlanExpect x = oracle_plan(p);
  if (std::getenv("KVC_FUZZ_DUMP")) {  // the case's inputs, for turning a failure into a regression test
    std::printf("plan bs=%" PRId64 " vcap=%" PRId64 " wcap=%" PRId64 " R=%" PRId64 " L=%" PRId64 " window=%" PRId64
                " lut=%d pool=%d row_starts=%d N=%" PRId64 "\n", p.bs, p.vcap, p.wcap, p.R, p.L, p.window, p.has_lut,
                p.has_pool, p.has_rs, p.N);
    for (int64_t r = 0; r < p.bs; ++r)
      std::printf("  row %" PRId64 ": rp=%" PRId64 " P=%" PRId64 " E=%" PRId64 " start=%" PRId64 "\n", r, p.rpi.get(r),
                  p.P.get(r), p.E.get(r), p.has_rs ? p.rs.get(r) : 0);
  }
  ++g_cov[g_opi].launches;
  if (p.has_rs) ++g_cov[g_opi].row_starts;
  if (!x.enable) ++g_cov[g_opi].disabled;
  if (x.total < 0) ++g_cov[g_opi].wrapped;
  CHECK(nv[0] == x.num_valid, "num_valid %d, want %d", nv[0], x.num_valid);
  CHECK(en[0] == x.enable, "enable %d, want %d", en[0], x.enable);
  CHECK(nvr[0] == x.nvr, "num_valid_reqs %d, want %d", nvr[0], x.nvr);
  for (int64_t e = 0; e < p.vcap; ++e) {
    CHECK(slots[e] == x.slots[e], "slot_indices[%" PRId64 "] %d, want %d", e, slots[e], x.slots[e]);
    CHECK(toks[e] == x.toks[e], "expected_tokens[%" PRId64 "] %d, want %d", e, toks[e], x.toks[e]);
    CHECK(poss[e] == x.poss[e], "expected_positions[%" PRId64 "] %d, want %d", e, poss[e], x.poss[e]);
    CHECK(prevs[e] == x.prevs[e], "prev_slot_indices[%" PRId64 "] %d, want %d", e, prevs[e], x.prevs[e]);
  }
  for (int64_t r = 0; r <= p.wcap; ++r)
    CHECK(offsets[r] == x.offsets[r], "offsets[%" PRId64 "] %d, want %d", r, offsets[r], x.offsets[r]);
  for (int64_t r = 0; r < p.wcap; ++r)
    CHECK(seeds[r] == x.seeds[r], "seed_slot_indices[%" PRId64 "] %d, want %d", r, seeds[r], x.seeds[r]);
}

// ======================================== SCATTER =================================================
template <class T>
void scatter_case(Rng& g, int64_t Rp, int64_t Cp) {
  const int64_t bs = g.range(0, 6), total = g.pct(10) ? 0 : g.range(0, 20);
  auto wide = [&]() { return g.pct(50); };
  Idx flat(total, wide()), offsets(bs + 1, wide()), rpi(bs, wide());
  for (int64_t i = 0; i < total; ++i) flat.set(i, pick(g, -1, 100000));
  if (g.pct(50)) {
    int64_t acc = g.pct(80) ? 0 : g.range(0, 3);
    for (int64_t r = 0; r <= bs; ++r) offsets.set(r, acc), acc += g.range(0, 6);
    if (g.pct(30)) offsets.set(g.range(0, bs), pick(g, -3, total + 3));
  } else {
    for (int64_t r = 0; r <= bs; ++r) offsets.set(r, pick(g, -3, total + 3));
  }
  for (int64_t r = 0; r < bs; ++r) rpi.set(r, g.pct(75) ? g.range(0, Rp) : pick(g, -1, Rp));
  Heap<T> pool(Rp * Cp);
  for (int64_t i = 0; i < pool.n; ++i) pool[i] = static_cast<T>(g.next());
  Heap<T> expect = pool;
  for (int64_t r = 0; r < bs; ++r) {  // §9.5
    const int64_t start = offsets.get(r), end = offsets.get(r + 1), rp = rpi.get(r);
    const int64_t n0 = wsub(end, start), n = n0 < Cp ? n0 : Cp;
    if (n <= 0 || rp < 0 || rp >= Rp) continue;
    for (int64_t c = 0; c < n; ++c) {
      const __int128 src = static_cast<__int128>(start) + c;  // no wrap: out of [0, total) either way
      if (src >= 0 && src < total) expect[rp * Cp + c] = static_cast<T>(flat.get(static_cast<int64_t>(src)));
    }
  }
  scatter_launch(pool.data(), Rp, Cp, flat.view(), total, offsets.view(), rpi.view(), bs);
  ++g_cov[g_opi].launches;
  for (int64_t i = 0; i < pool.n; ++i)
    CHECK(pool[i] == expect[i], "pool[%" PRId64 "] = %" PRId64 ", want %" PRId64, i, static_cast<int64_t>(pool[i]),
          static_cast<int64_t>(expect[i]));
}

void fuzz_scatter(Rng& g) {
  const int64_t Rp = g.pct(5) ? 0 : g.range(1, 5), Cp = g.pct(5) ? 0 : g.range(1, 10);
  if (g.pct(50)) scatter_case<int32_t>(g, Rp, Cp);
  else scatter_case<int64_t>(g, Rp, Cp);
}

// ======================================== CYCLE ===================================================
// A tiny well-formed serving loop through all launchers: requests extend by 1..3 tokens per step into
// fresh slots; plan -> verify (previous records) -> write (new records) with real-KV sources; a clean
// run must record nothing. Then one req_to_token swap must be reported by the next verify. Half of the
// runs plan from a flat per-step page table instead (each row's segment, with gaps, and row_starts),
// as an engine's attention reads it.
void fuzz_cycle(Rng& g) {
  const int64_t R = 4, Lmax = 16, S = 1 + (R - 1) * Lmax + 1;
  const int64_t bs = R - 1, vcap = (R - 1) * Lmax, wcap = bs + g.range(0, 2);
  Canary c(S, 32);
  std::memset(c.bytes.data(), 0, c.bytes.n);
  Log L(g.pct(30) ? 1 : 16, NUM_LAUNCH_TAGS);
  std::memset(L.ring.data(), 0, L.ring.n), std::memset(L.kc.data(), 0, L.kc.n), std::memset(L.sc.data(), 0, L.sc.n);
  L.wi[0] = 0;
  Sources src;
  src.mode = static_cast<int32_t>(g.range(0, 2));
  Src kv;
  // a fused slot [K 32 B, V 32 B]; the fingerprint reads K, or V through offset_bytes
  kv.page_size = g.pct(50) ? 1 : 2, kv.bpt = 64, kv.read_bytes = 32, kv.row_bytes = kv.page_size * 64;
  kv.offset = g.pct(50) ? 0 : 32;
  kv.rows = (S + kv.page_size - 1) / kv.page_size;
  kv.data = Heap<uint8_t>(kv.rows * kv.row_bytes);
  fill_random(g, kv.data.data(), kv.data.n);
  src.v.push_back(std::move(kv));
  Idx r2t(R * Lmax, g.pct(50));
  std::vector<int64_t> free_slots;
  for (int64_t s = S - 1; s >= 1; --s) free_slots.push_back(s);
  for (size_t i = free_slots.size(); i > 1; --i) std::swap(free_slots[i - 1], free_slots[g.next() % i]);
  for (int64_t i = 0; i < r2t.n; ++i) r2t.set(i, 0);
  std::vector<int64_t> len(R, 0);
  const int64_t tag = g.range(0, NUM_LAUNCH_TAGS - 1);
  int64_t verify_slots = 0, write_slots = 0, steps = 0;
  const bool inject = g.pct(50);
  const bool flat_table = g.pct(50);
  bool injected = false;
  for (int step = 0; step < 8; ++step) {
    Idx rpi(bs, true), P(bs, true), E(bs, true);
    std::vector<int64_t> ids, poss, locs;
    for (int64_t r = 0; r < bs; ++r) {
      const int64_t rp = r + 1, e = (len[rp] + 3 <= Lmax) ? g.range(1, 3) : 0;
      rpi.set(r, rp), P.set(r, len[rp]), E.set(r, e);
      for (int64_t j = 0; j < e; ++j) {
        const int64_t slot = free_slots.back();
        free_slots.pop_back();
        r2t.set(rp * Lmax + len[rp] + j, slot);
        ids.push_back(g.range(0, 30000)), poss.push_back(len[rp] + j), locs.push_back(slot);
      }
    }
    if (inject && step == 6 && len[1] >= 2) {  // a wrong-slot bug: swap two prefix entries of request 1
      const int64_t a0 = r2t.get(1 * Lmax + 0), a1 = r2t.get(1 * Lmax + 1);
      r2t.set(1 * Lmax + 0, a1), r2t.set(1 * Lmax + 1, a0);
      injected = true;
    }
    PlanArgs pa{};
    Idx nolut(0, false), nopool(0, false), novl(0, false);
    pa.req_pool_indices = rpi.view(), pa.prefix_lens = P.view(), pa.extend_seq_lens = E.view();
    pa.req_to_token = r2t.view(), pa.R = R, pa.L = Lmax, pa.lut = nolut.view(), pa.pool = nopool.view();
    pa.valid_lens = novl.view();
    Idx flat, starts(bs, g.pct(50));
    if (flat_table) {  // segments of P + E slots in batch order, each start rounded up to a page of 4
      std::vector<int64_t> cells;
      for (int64_t r = 0; r < bs; ++r) {
        cells.resize(cells.size() + g.range(0, 2));
        while (cells.size() % 4) cells.push_back(0);
        starts.set(r, static_cast<int64_t>(cells.size()));
        for (int64_t pos = 0; pos < P.get(r) + E.get(r); ++pos) cells.push_back(r2t.get((r + 1) * Lmax + pos));
      }
      flat = Idx(static_cast<int64_t>(cells.size()), g.pct(50));
      for (int64_t i = 0; i < flat.n; ++i) flat.set(i, cells[i]);
      pa.req_to_token = flat.view(), pa.has_row_starts = true, pa.row_starts = starts.view(), pa.N = flat.n;
      pa.R = pa.L = 0;
      ++g_cov[g_opi].row_starts;
    }
    Heap<int32_t> vs(vcap), vt(vcap), vp(vcap), vq(vcap), vn(1), ve(1), wo(wcap + 1), wsd(wcap), wn(1);
    with_executor(g, [&](const auto& exec) {
      plan_launch(pa, bs, vcap, wcap, PlanOut{vs.data(), vt.data(), vp.data(), vq.data(), vn.data(), ve.data(),
                                              wo.data(), wsd.data(), wn.data()}, exec);
    });
    CHECK(ve[0] == 1, "plan overflowed in the cycle");
    Idx v_slots(vcap, false), v_toks(vcap, false), v_pos(vcap, false), v_prev(vcap, false);
    for (int64_t e = 0; e < vcap; ++e) v_slots.set(e, vs[e]), v_toks.set(e, vt[e]), v_pos.set(e, vp[e]), v_prev.set(e, vq[e]);
    const int32_t before = L.wi[0];
    VerifyArgs va{};
    va.canary = c.view(), va.slots = v_slots.view(), va.tokens = v_toks.view(), va.positions = v_pos.view();
    va.prevs = v_prev.view(), va.sources = src.core(), va.tag = tag;
    with_executor(g, [&](const auto& exec) { verify_launch(va, vcap, vn[0], ve[0], L.view(), exec); });
    verify_slots += vn[0];
    if (!injected) CHECK(L.wi[0] == before, "clean verify recorded %d rows at step %d", L.wi[0] - before, step);
    else CHECK(L.wi[0] > before, "the req_to_token swap was not reported at step %d", step);
    const int64_t N = static_cast<int64_t>(ids.size());
    Idx wi(N, false), wp(N, false), wl(N, false), woff(wcap + 1, false), wseed(wcap, false), empty(0, false);
    for (int64_t i = 0; i < N; ++i) wi.set(i, ids[i]), wp.set(i, poss[i]), wl.set(i, locs[i]);
    for (int64_t r = 0; r <= wcap; ++r) woff.set(r, wo[r]);
    for (int64_t r = 0; r < wcap; ++r) wseed.set(r, wsd[r]);
    const int32_t before_w = L.wi[0];
    WriteArgs wa{};
    wa.canary = c.view(), wa.seeds = wseed.view(), wa.input_ids = wi.view(), wa.positions = wp.view();
    wa.locs = wl.view(), wa.exp_tokens = empty.view(), wa.exp_positions = empty.view();
    wa.chain_assert = !injected, wa.sources = src.core(), wa.tag = tag;
    with_executor(g, [&](const auto& exec) { write_launch(wa, woff.view(), wcap, wn[0], N, L.view(), exec); });
    write_slots += N;
    if (!injected) CHECK(L.wi[0] == before_w, "clean write recorded %d rows at step %d", L.wi[0] - before_w, step);
    for (int64_t r = 0; r < bs; ++r) len[r + 1] += E.get(r);
    ++steps;
    if (injected) break;
  }
  CHECK(rd64(L.kc.data() + 8 * tag) == 2 * steps, "kernel_run %" PRId64 ", want %" PRId64, rd64(L.kc.data() + 8 * tag),
        2 * steps);
  CHECK(rd64(L.sc.data() + 8 * tag) == verify_slots + write_slots, "slot_run %" PRId64 ", want %" PRId64,
        rd64(L.sc.data() + 8 * tag), verify_slots + write_slots);
  ++g_cov[g_opi].launches;
}

// ---- argument checks (csrc/call_args.h): what a handler accepts never faults -------------------------
// A call is built as the handlers see it: array descriptions and attributes. Most calls are valid and
// get one malformation from the op's list (a tag outside the counters, a slot stride below 32, a ring
// row that is not 64 bytes, a short index array, a float index array, a real-KV strip past its row,
// ...): the check must refuse those and accept the untouched ones. A quarter of the calls draw every
// field at random instead. Whatever the check accepts is launched, like a handler would, on buffers of
// exactly the described sizes holding random bytes, so ASan/UBSan flag any access the check let through.
struct CallBuffers {
  std::deque<Heap<uint8_t>> held;  // emplace_back keeps earlier buffers in place
  // Backs `a` with `a.bytes` random bytes.
  void back(Rng& g, Array& a) {
    held.emplace_back(a.bytes);
    fill_random(g, held.back().data(), a.bytes);
    a.data = held.back().data();
  }
};

int64_t elem_size(ElemType t) {
  switch (t) {
    case ElemType::U8: return 1;
    case ElemType::S32: return 4;
    case ElemType::S64: return 8;
    default: return 2;  // e.g. int16 / float16
  }
}

// An array of type t, rank 1 or 2 (dims d0 x d1), or rank 0 (a scalar).
Array described(ElemType t, int64_t rank, int64_t d0, int64_t d1 = 1) {
  Array a;
  a.type = t;
  a.rank = rank;
  a.dim0 = rank >= 1 ? d0 : 0;
  a.dim1 = rank >= 2 ? d1 : 0;
  a.elements = rank == 0 ? 1 : (rank == 1 ? d0 : d0 * d1);
  a.bytes = a.elements * elem_size(t);
  return a;
}
Array index_array(Rng& g, int64_t n) { return described(g.pct(50) ? ElemType::S64 : ElemType::S32, 1, n); }
Array i32_scalar() { return described(ElemType::S32, 1, 1); }
ElemType random_type(Rng& g) {
  const ElemType t[] = {ElemType::S32, ElemType::S64, ElemType::U8, ElemType::OTHER};
  return t[g.next() % 4];
}
// Every field at random: any type, rank 0..3, small dims.
Array random_array(Rng& g) {
  Array a = described(random_type(g), g.range(0, 3), g.range(0, 9), g.range(0, 9));
  if (a.rank == 3) a.elements *= 2, a.bytes *= 2;  // a third dimension of 2
  return a;
}

// A malformation of a call: applying it makes the call one the check must refuse.
template <class Call>
using Breaker = void (*)(Rng&, Call&);

LogCall valid_log(Rng& g) {
  LogCall c;
  c.canary = described(ElemType::U8, 2, g.range(1, 40), g.pct(70) ? 32 : 8 * g.range(4, 8));
  c.ring = described(ElemType::U8, 2, g.range(1, 6), VIOLATION_ROW_BYTES);
  c.write_index = i32_scalar();
  const int64_t tags = g.range(1, NUM_LAUNCH_TAGS);
  c.kernel_counters = described(ElemType::U8, 2, tags, COUNTER_BYTES);
  c.slot_counters = described(ElemType::U8, 2, tags, COUNTER_BYTES);
  c.tag = g.range(0, tags - 1);
  return c;
}
void break_log(Rng& g, LogCall& c) {
  const int64_t tags = c.kernel_counters.dim0;
  switch (g.range(0, 8)) {
    case 0: c.tag = g.pct(50) ? tags + g.range(0, 3) : (g.pct(50) ? -1 : int64_t(1) << 40); break;
    case 1: c.canary = described(ElemType::U8, 2, c.canary.dim0, g.pct(50) ? 8 * g.range(0, 3) : 32 + g.range(1, 7)); break;
    case 2: c.canary = described(ElemType::U8, 2, 0, 32); break;
    case 3: c.ring = described(ElemType::U8, 2, c.ring.dim0, g.pct(50) ? 32 : 65); break;
    case 4: c.ring = described(ElemType::U8, 2, 0, VIOLATION_ROW_BYTES); break;
    case 5: c.write_index = described(ElemType::S32, 1, g.pct(50) ? 0 : 2); break;
    case 6: c.slot_counters = described(ElemType::U8, 2, tags + 1, COUNTER_BYTES); break;
    case 7: c.kernel_counters = described(ElemType::U8, 2, tags, 4); break;
    default: c.results_match_inputs = false; break;
  }
}

// Real-KV sources that fit (mode NONE: none or some, unread).
SourcesCall valid_sources(Rng& g) {
  SourcesCall c;
  c.attrs.mode = static_cast<int32_t>(g.range(0, 2));
  c.count = g.pct(60) ? 0 : g.range(1, MAX_REAL_KV_SOURCES);
  c.attrs.entries = MAX_REAL_KV_SOURCES;
  for (int64_t k = 0; k < c.count; ++k) {
    const int64_t bpt = REAL_KV_CHUNK_BYTES * g.range(1, 4), ps = g.range(1, 3);
    const int64_t eff = c.attrs.mode == 1 ? REAL_KV_PARTIAL_BYTES : REAL_KV_CHUNK_BYTES * g.range(1, bpt / REAL_KV_CHUNK_BYTES);
    c.attrs.page_size[k] = ps;
    c.attrs.bytes_per_token[k] = bpt;
    c.attrs.read_bytes[k] = eff;
    c.attrs.offset_bytes[k] = REAL_KV_CHUNK_BYTES * g.range(0, (bpt - eff) / REAL_KV_CHUNK_BYTES);
    c.src[k] = described(ElemType::U8, 2, g.range(0, 8), ps * bpt + (g.pct(30) ? REAL_KV_CHUNK_BYTES : 0));
  }
  return c;
}
void break_sources(Rng& g, SourcesCall& c) {
  if (c.count == 0 || g.pct(30)) {
    if (g.pct(50)) c.attrs.mode = g.pct(50) ? 3 : -1;
    else c.count = MAX_REAL_KV_SOURCES + g.range(1, 2);
    return;
  }
  c.attrs.mode = static_cast<int32_t>(g.range(1, 2));
  const int64_t k = g.range(0, c.count - 1);
  Array& src = c.src[k];
  src = described(ElemType::U8, 2, g.range(1, 8), src.dim1 > 0 ? src.dim1 : REAL_KV_CHUNK_BYTES);
  const int64_t row = src.dim1;
  switch (g.range(0, 4)) {
    case 0: c.attrs.page_size[k] = g.pct(50) ? 0 : row + 1; c.attrs.bytes_per_token[k] = REAL_KV_CHUNK_BYTES; break;
    case 1: c.attrs.bytes_per_token[k] = g.pct(50) ? 0 : REAL_KV_CHUNK_BYTES + 8; break;
    case 2: c.attrs.offset_bytes[k] = c.attrs.bytes_per_token[k]; break;  // the strip starts past the token
    case 3: c.attrs.offset_bytes[k] = 8; break;
    default: c.attrs.entries = k; break;  // the geometry arrays are too short
  }
}

VerifyCall valid_verify(Rng& g) {
  VerifyCall c;
  c.log = valid_log(g);
  const int64_t cap = g.range(1, 12);
  c.slots = index_array(g, cap);
  c.tokens = index_array(g, cap);
  c.positions = index_array(g, cap);
  c.prevs = index_array(g, cap);
  c.num_valid = i32_scalar();
  c.enable = i32_scalar();
  c.check_token = g.pct(50);
  c.sources = valid_sources(g);
  return c;
}
const Breaker<VerifyCall> kVerifyBreakers[] = {
    [](Rng& g, VerifyCall& c) { break_log(g, c.log); },
    [](Rng& g, VerifyCall& c) { break_sources(g, c.sources); },
    [](Rng&, VerifyCall& c) { c.slots = described(ElemType::S32, 1, 0); },
    [](Rng& g, VerifyCall& c) { c.tokens = index_array(g, c.slots.dim0 + (g.pct(50) ? 1 : -1)); },
    [](Rng& g, VerifyCall& c) { c.prevs = described(g.pct(50) ? ElemType::U8 : ElemType::OTHER, 1, c.slots.dim0); },
    [](Rng& g, VerifyCall& c) { c.positions = described(ElemType::S64, 2, c.slots.dim0, g.range(1, 2)); },
    [](Rng& g, VerifyCall& c) { c.num_valid = described(ElemType::S32, 1, g.pct(50) ? 0 : 2); },
    [](Rng&, VerifyCall& c) { c.enable = described(ElemType::S64, 1, 1); },
};

WriteCall valid_write(Rng& g) {
  WriteCall c;
  c.log = valid_log(g);
  const int64_t reqs = g.range(0, 6), n = g.range(0, 16);
  c.chain_flag = i32_scalar();
  c.seeds = index_array(g, reqs);
  c.offsets = index_array(g, reqs + 1);
  c.num_valid_reqs = i32_scalar();
  c.input_ids = index_array(g, n);
  c.positions = index_array(g, n);
  c.locs = index_array(g, n);
  c.input_assert = g.pct(50);
  c.exp_tokens = index_array(g, c.input_assert ? n : (g.pct(50) ? 0 : g.range(0, 9)));
  c.exp_positions = index_array(g, c.input_assert ? n : 0);
  c.sources = valid_sources(g);
  return c;
}
const Breaker<WriteCall> kWriteBreakers[] = {
    [](Rng& g, WriteCall& c) { break_log(g, c.log); },
    [](Rng& g, WriteCall& c) { break_sources(g, c.sources); },
    [](Rng& g, WriteCall& c) { c.offsets = index_array(g, c.seeds.dim0 + (g.pct(50) ? 2 : 0)); },
    [](Rng& g, WriteCall& c) { c.positions = index_array(g, c.input_ids.dim0 + 1); },
    [](Rng& g, WriteCall& c) { c.locs = described(ElemType::U8, 1, c.input_ids.dim0 * (g.pct(50) ? 1 : 8)); },
    [](Rng& g, WriteCall& c) { c.chain_flag = described(ElemType::S32, 1, g.pct(50) ? 0 : 2); },
    [](Rng& g, WriteCall& c) {
      c.input_assert = true;
      c.exp_tokens = index_array(g, c.input_ids.dim0 + g.range(1, 3));
    },
    [](Rng& g, WriteCall& c) { c.seeds = described(ElemType::S64, 2, c.seeds.dim0, g.range(1, 2)); },
};

PlanCall valid_plan(Rng& g) {
  PlanCall c;
  const int64_t bs = g.range(0, 6), vcap = g.range(1, 24), wcap = bs + g.range(0, 3);
  c.rpi = index_array(g, bs);
  c.prefix = index_array(g, bs);
  c.extend = index_array(g, bs);
  c.has_row_starts = g.pct(30);
  c.r2t = c.has_row_starts ? index_array(g, g.range(0, 30)) : described(g.pct(50) ? ElemType::S64 : ElemType::S32, 2, g.range(0, 5), g.range(0, 8));
  c.row_starts = c.has_row_starts ? index_array(g, bs) : index_array(g, 0);
  c.has_lut = g.pct(40);
  c.lut = index_array(g, c.has_lut ? g.range(1, 20) : 0);
  c.window = c.has_lut && g.pct(50) ? g.range(1, 6) : 0;
  c.report_evicted = c.has_lut && g.pct(50);
  c.has_pool = g.pct(40);
  c.pool = c.has_pool ? described(g.pct(50) ? ElemType::S64 : ElemType::S32, 2, g.range(0, 5), g.range(0, 8)) : described(ElemType::S32, 2, 0, 0);
  c.valid_lens = index_array(g, c.has_pool ? bs : 0);
  c.token_offset = g.range(-2, 2);
  for (Array* out : {&c.slots, &c.tokens, &c.positions, &c.prevs}) *out = described(ElemType::S32, 1, vcap);
  c.num_valid = i32_scalar();
  c.enable = i32_scalar();
  c.offsets = described(ElemType::S32, 1, wcap + 1);
  c.seeds = described(ElemType::S32, 1, wcap);
  c.num_valid_reqs = i32_scalar();
  return c;
}
const Breaker<PlanCall> kPlanBreakers[] = {
    [](Rng& g, PlanCall& c) { c.prefix = index_array(g, c.rpi.dim0 + 1); },
    [](Rng& g, PlanCall& c) { c.extend = described(ElemType::OTHER, 1, c.rpi.dim0 + g.range(0, 1)); },
    [](Rng& g, PlanCall& c) { c.has_row_starts = false; c.r2t = index_array(g, g.range(0, 9)); },
    [](Rng& g, PlanCall& c) { c.has_row_starts = true; c.r2t = index_array(g, 9); c.row_starts = index_array(g, c.rpi.dim0 + 1); },
    [](Rng&, PlanCall& c) { c.has_lut = true; c.lut = described(ElemType::S32, 1, 0); },
    [](Rng& g, PlanCall& c) { c.has_lut = false; c.window = g.range(1, 5); },
    [](Rng& g, PlanCall& c) { c.window = -g.range(1, 5); },
    [](Rng& g, PlanCall& c) { c.has_lut = false; c.window = 0; c.lut = index_array(g, 0); c.report_evicted = true; },
    [](Rng& g, PlanCall& c) { c.token_offset = g.pct(50) ? int64_t(1) << 40 : int64_t(INT32_MIN) - 1; },
    [](Rng& g, PlanCall& c) { c.has_pool = true; c.pool = index_array(g, 4); c.valid_lens = index_array(g, c.rpi.dim0); },
    [](Rng& g, PlanCall& c) { c.has_pool = true; c.pool = described(ElemType::S32, 2, 2, 2); c.valid_lens = index_array(g, c.rpi.dim0 + 1); },
    [](Rng& g, PlanCall& c) { c.tokens = described(ElemType::S32, 1, c.slots.elements + g.range(1, 2)); },
    [](Rng&, PlanCall& c) { for (Array* out : {&c.slots, &c.tokens, &c.positions, &c.prevs}) *out = described(ElemType::S32, 1, 0); },
    [](Rng&, PlanCall& c) { c.seeds = described(ElemType::S32, 1, c.rpi.dim0 - 1); c.offsets = described(ElemType::S32, 1, c.rpi.dim0); },
    [](Rng&, PlanCall& c) { c.offsets = described(ElemType::S32, 1, c.seeds.elements); },
    [](Rng&, PlanCall& c) { c.enable = described(ElemType::S32, 1, 2); },
};

ScatterCall valid_scatter(Rng& g) {
  ScatterCall c;
  const int64_t bs = g.range(0, 5);
  c.pool = described(g.pct(50) ? ElemType::S64 : ElemType::S32, 2, g.range(0, 5), g.range(0, 8));
  c.flat_ids = index_array(g, g.range(0, 20));
  c.offsets = index_array(g, bs + 1);
  c.rpi = index_array(g, bs);
  c.result = c.pool;
  return c;
}
const Breaker<ScatterCall> kScatterBreakers[] = {
    [](Rng& g, ScatterCall& c) { c.pool = index_array(g, 6); c.result = c.pool; },
    [](Rng& g, ScatterCall& c) { c.offsets = index_array(g, c.rpi.dim0 + (g.pct(50) ? 2 : 0)); },
    [](Rng&, ScatterCall& c) { c.flat_ids = described(ElemType::OTHER, 1, 4); },
    [](Rng&, ScatterCall& c) { c.result = described(c.pool.type == ElemType::S32 ? ElemType::S64 : ElemType::S32, 2, c.pool.dim0, c.pool.dim1); },
};

// Random fields, any of which may be valid.
template <class Call>
void randomize(Rng& g, Call& c);
void randomize_sources(Rng& g, SourcesCall& s) {
  s.attrs.mode = static_cast<int32_t>(g.range(-1, 3));
  s.count = g.range(0, MAX_REAL_KV_SOURCES + 1);
  s.attrs.entries = g.range(0, MAX_REAL_KV_SOURCES);
  for (int64_t k = 0; k < MAX_REAL_KV_SOURCES; ++k) {
    s.src[k] = random_array(g);
    s.attrs.page_size[k] = pick(g, 0, 4);
    s.attrs.bytes_per_token[k] = pick(g, 0, 64);
    s.attrs.read_bytes[k] = pick(g, 0, 64);
    s.attrs.offset_bytes[k] = pick(g, 0, 64);
  }
}
void randomize_log(Rng& g, LogCall& c) {
  for (Array* a : {&c.canary, &c.ring, &c.write_index, &c.kernel_counters, &c.slot_counters}) *a = random_array(g);
  c.tag = pick(g, 0, 12);
  c.results_match_inputs = g.pct(90);
}

template <class Call, class Check, class Launch, size_t K>
void fuzz_call(Rng& g, Call (*valid)(Rng&), const Breaker<Call> (&breakers)[K], void (*random)(Rng&, Call&),
               Check check, Launch launch) {
  int broken = -1;  // -1: untouched, K: random fields
  Call c;
  if (g.pct(25)) {
    random(g, c);
    broken = static_cast<int>(K);
  } else {
    c = valid(g);
    if (g.pct(70)) {
      broken = static_cast<int>(g.next() % K);
      breakers[broken](g, c);
    }
  }
  const std::string error = check(c);
  Coverage& cov = g_cov[g_opi];
  ++cov.launches;
  if (broken == -1) CHECK(error.empty(), "a valid call was refused: %s", error.c_str());
  if (broken >= 0 && broken < static_cast<int>(K))
    CHECK(!error.empty(), "malformation %d was accepted", broken);
  if (!error.empty()) {
    CHECK(error.rfind("kv-canary: kvcanary_", 0) == 0, "message without the kv-canary: prefix: %s", error.c_str());
    ++cov.rows;  // refused calls
    return;
  }
  ++cov.zero_row_cases;  // accepted calls, launched
  launch(g, c);
}

void random_verify(Rng& g, VerifyCall& c) {
  randomize_log(g, c.log);
  for (Array* a : {&c.slots, &c.tokens, &c.positions, &c.prevs, &c.num_valid, &c.enable}) *a = random_array(g);
  c.check_token = g.pct(50);
  randomize_sources(g, c.sources);
}
void random_write(Rng& g, WriteCall& c) {
  randomize_log(g, c.log);
  for (Array* a : {&c.chain_flag, &c.offsets, &c.seeds, &c.num_valid_reqs, &c.input_ids, &c.positions, &c.locs,
                   &c.exp_tokens, &c.exp_positions})
    *a = random_array(g);
  c.input_assert = g.pct(50);
  randomize_sources(g, c.sources);
}
void random_plan(Rng& g, PlanCall& c) {
  for (Array* a : {&c.rpi, &c.prefix, &c.extend, &c.r2t, &c.lut, &c.pool, &c.valid_lens, &c.row_starts, &c.slots,
                   &c.tokens, &c.positions, &c.prevs, &c.num_valid, &c.enable, &c.offsets, &c.seeds, &c.num_valid_reqs})
    *a = random_array(g);
  c.window = pick(g, 0, 4);
  c.token_offset = pick(g, -2, 2);
  c.has_lut = g.pct(50);
  c.has_pool = g.pct(50);
  c.has_row_starts = g.pct(50);
  c.report_evicted = g.pct(50);
}
void random_scatter(Rng& g, ScatterCall& c) {
  for (Array* a : {&c.pool, &c.flat_ids, &c.offsets, &c.rpi, &c.result}) *a = random_array(g);
}

void back_log(Rng& g, CallBuffers& b, LogCall& c) {
  for (Array* a : {&c.canary, &c.ring, &c.write_index, &c.kernel_counters, &c.slot_counters}) b.back(g, *a);
}
void back_sources(Rng& g, CallBuffers& b, SourcesCall& s) {
  for (int64_t k = 0; k < s.count && k < MAX_REAL_KV_SOURCES; ++k) b.back(g, s.src[k]);
}
int32_t first_i32(const Array& a) { int32_t v; std::memcpy(&v, a.data, 4); return v; }

void fuzz_checks(Rng& g) {
  switch (g.range(0, 3)) {
    case 0:
      fuzz_call(g, valid_verify, kVerifyBreakers, random_verify, check_verify, [](Rng& r, VerifyCall c) {
        CallBuffers b;
        back_log(r, b, c.log);
        for (Array* a : {&c.slots, &c.tokens, &c.positions, &c.prevs, &c.num_valid, &c.enable}) b.back(r, *a);
        back_sources(r, b, c.sources);
        with_executor(r, [&](auto exec) {
          verify_launch(verify_args(c), c.slots.dim0, first_i32(c.num_valid), first_i32(c.enable), log_view(c.log), exec);
        });
      });
      break;
    case 1:
      fuzz_call(g, valid_write, kWriteBreakers, random_write, check_write, [](Rng& r, WriteCall c) {
        CallBuffers b;
        back_log(r, b, c.log);
        for (Array* a : {&c.chain_flag, &c.offsets, &c.seeds, &c.num_valid_reqs, &c.input_ids, &c.positions, &c.locs,
                         &c.exp_tokens, &c.exp_positions})
          b.back(r, *a);
        back_sources(r, b, c.sources);
        WriteArgs a = write_args(c);
        a.chain_assert = first_i32(c.chain_flag) != 0;
        with_executor(r, [&](auto exec) {
          write_launch(a, index_view(c.offsets), c.seeds.dim0, first_i32(c.num_valid_reqs), c.input_ids.dim0,
                       log_view(c.log), exec);
        });
      });
      break;
    case 2:
      fuzz_call(g, valid_plan, kPlanBreakers, random_plan, check_plan, [](Rng& r, PlanCall c) {
        CallBuffers b;
        for (Array* a : {&c.rpi, &c.prefix, &c.extend, &c.r2t, &c.lut, &c.pool, &c.valid_lens, &c.row_starts,
                         &c.slots, &c.tokens, &c.positions, &c.prevs, &c.num_valid, &c.enable, &c.offsets, &c.seeds,
                         &c.num_valid_reqs})
          b.back(r, *a);
        with_executor(r, [&](auto exec) {
          plan_launch(plan_args(c), c.rpi.dim0, c.slots.elements, c.seeds.elements, plan_out(c), exec);
        });
      });
      break;
    default:
      fuzz_call(g, valid_scatter, kScatterBreakers, random_scatter, check_scatter, [](Rng& r, ScatterCall c) {
        CallBuffers b;
        for (Array* a : {&c.pool, &c.flat_ids, &c.offsets, &c.rpi}) b.back(r, *a);
        if (c.pool.type == ElemType::S64)
          scatter_launch(static_cast<int64_t*>(c.pool.data), c.pool.dim0, c.pool.dim1, index_view(c.flat_ids),
                         c.flat_ids.dim0, index_view(c.offsets), index_view(c.rpi), c.rpi.dim0);
        else
          scatter_launch(static_cast<int32_t*>(c.pool.data), c.pool.dim0, c.pool.dim1, index_view(c.flat_ids),
                         c.flat_ids.dim0, index_view(c.offsets), index_view(c.rpi), c.rpi.dim0);
      });
  }
}

struct Op {
  const char* name;
  void (*fn)(Rng&);
};
const Op kOps[] = {{"verify", fuzz_verify}, {"write", fuzz_write}, {"plan", fuzz_plan},
                   {"scatter", fuzz_scatter}, {"cycle", fuzz_cycle}, {"checks", fuzz_checks}};

uint64_t case_seed(uint64_t seed, int op, int64_t i) {
  return sm64(sm64(seed ^ (0x1234567ull * (op + 1))) ^ static_cast<uint64_t>(i));
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t cases = argc > 1 ? std::strtoll(argv[1], nullptr, 10) : 10000;
  g_seed = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1;
  const std::string only = argc > 3 ? argv[3] : "all";
  const int64_t single = argc > 4 ? std::strtoll(argv[4], nullptr, 10) : -1;
  if (sm64(CANARY_CHAIN_ANCHOR) != kAnchorHash || CANARY_ANCHOR_HASH != kAnchorHash) {
    std::fprintf(stderr, "FAIL: splitmix64 pin\n");
    return 1;
  }
  // The launchers' block hash (successor_hashes: the AVX-512 copy where the CPU has it) and its
  // portable loop, against the oracle's mix3 on random lanes.
  {
    Rng g(g_seed);
    uint64_t a[kHashBlock], b[kHashBlock], c[kHashBlock], fast[kHashBlock], portable[kHashBlock];
    for (int rep = 0; rep < 2000; ++rep) {
      for (int64_t j = 0; j < kHashBlock; ++j) {
        a[j] = g.next();
        b[j] = g.next();
        c[j] = g.next();
      }
      successor_hashes(a, b, c, fast);
      successor_hashes_loop(a, b, c, portable);
      for (int64_t j = 0; j < kHashBlock; ++j) {
        if (fast[j] != m3(a[j], b[j], c[j]) || portable[j] != m3(a[j], b[j], c[j])) {
          std::fprintf(stderr, "FAIL: successor_hashes lane %" PRId64 " of block %d\n", j, rep);
          return 1;
        }
      }
    }
  }
  bool ran = false;
  for (int op = 0; op < static_cast<int>(sizeof(kOps) / sizeof(kOps[0])); ++op) {
    if (only != "all" && only != kOps[op].name) continue;
    ran = true;
    g_op = kOps[op].name;
    g_opi = op;
    const int64_t n = std::string(g_op) == "cycle" ? (cases + 9) / 10 : cases;
    for (int64_t i = single >= 0 ? single : 0; i < (single >= 0 ? single + 1 : n); ++i) {
      g_case = i;
      Rng g(case_seed(g_seed, op, i));
      kOps[op].fn(g);
    }
    const Coverage& cv = g_cov[op];
    if (std::string(g_op) == "checks") {
      std::printf("%-8s cases=%-7" PRId64 " refused=%-7ld accepted and launched=%ld\n", g_op, single >= 0 ? 1 : n,
                  cv.rows, cv.zero_row_cases);
      continue;
    }
    std::printf("%-8s cases=%-7" PRId64 " launches=%-7ld rows=%-8ld oob_rows=%-7ld zero_row=%-6ld dropped=%-6ld "
                "saturated=%-6ld disabled=%-6ld wrapped=%-5ld kinds=0x%" PRIx64 "\n",
                g_op, single >= 0 ? 1 : n, cv.launches, cv.rows, cv.oob_rows, cv.zero_row_cases, cv.dropped,
                cv.saturated, cv.disabled, cv.wrapped, cv.kinds_seen);
  }
  if (!ran) {
    std::fprintf(stderr, "unknown op '%s'\n", only.c_str());
    return 2;
  }
  // Coverage guard: a generator that stopped reaching the malformed paths would pass vacuously.
  if (only == "all" && single < 0 && cases >= 2000) {
    g_op = "coverage";
    g_case = -1;
    const uint64_t want = (1u << 1) | (1u << 2) | (1u << 3) | (1u << 4) | (1u << 16) | (1u << 17) | (1u << 18) | (1u << 19);
    const uint64_t seen = g_cov[0].kinds_seen | g_cov[1].kinds_seen;
    CHECK((seen & want) == want, "IndexKinds never produced: 0x%" PRIx64, want & ~seen);
    for (int op = 0; op < 2; ++op) {
      CHECK(g_cov[op].dropped > 0 && g_cov[op].saturated > 0 && g_cov[op].zero_row_cases > 0,
            "%s never dropped/saturated/clean", kOps[op].name);
    }
    CHECK(g_cov[0].disabled > 0 && g_cov[2].disabled > 0 && g_cov[2].wrapped > 0, "plan/verify edge paths unreached");
    CHECK(g_cov[2].row_starts > 0 && g_cov[4].row_starts > 0, "plan never read a flat table through row_starts");
    CHECK(g_cov[5].rows > 0 && g_cov[5].zero_row_cases > 0, "the argument checks never refused or never accepted");
  }
  if (g_failures) {
    std::fprintf(stderr, "fuzz_driver: %ld failure(s)\n", g_failures);
    return 1;
  }
  std::printf("fuzz_driver: OK (seed %" PRIu64 "; %ld launches on the parallel launchers)\n", g_seed, g_parallel_launches);
  return 0;
}
