// A minimal static parallel-for over [0, n) for the CPU kernels.
#pragma once
#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace jaxcp::cpu {

template <typename F>
void parallel_for(int64_t n, F&& body) {
  const int64_t hw = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t workers = std::min<int64_t>(hw, n);
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(workers);
  for (int64_t w = 0; w < workers; ++w) {
    pool.emplace_back([&, w] {
      for (int64_t i = w; i < n; i += workers) body(i);
    });
  }
  for (auto& t : pool) t.join();
}

}  // namespace jaxcp::cpu
