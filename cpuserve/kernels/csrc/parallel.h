// How the torch-free code shares work out: the caller's thread pool behind one function pointer
// (the torch binding passes at::parallel_for, kernel_check a serial split), so the kernels and the
// driver never depend on torch or on one threading runtime.
#pragma once

#include <cstdint>
#include <type_traits>

namespace cpk {

// A non-owning reference to a callable body(begin, end).
class RangeBody {
 public:
  template <typename F, typename = std::enable_if_t<!std::is_same_v<std::decay_t<F>, RangeBody>>>
  RangeBody(const F& f)  // NOLINT: implicit, like a lambda argument
      : object_(&f), call_([](const void* o, int64_t b, int64_t e) { (*static_cast<const F*>(o))(b, e); }) {}
  void operator()(int64_t begin, int64_t end) const { call_(object_, begin, end); }

 private:
  const void* object_;
  void (*call_)(const void*, int64_t, int64_t);
};

struct Parallel {
  int64_t threads;  // how many run at once (attention splits its work to keep them all busy)
  // Calls body on disjoint subranges covering [begin, end), each at least grain long where possible.
  void (*for_range)(int64_t begin, int64_t end, int64_t grain, RangeBody body);
};

}  // namespace cpk
