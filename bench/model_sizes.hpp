// The benchmarks' tensor list: sizes of a Qwen2.5-0.5B-like decoder (hidden 896, 2 KV
// heads of 64, FFN 4864), a shortened embedding first, layers repeated to a target.
#pragma once

#include <cstddef>
#include <vector>

namespace stepcore::bench {

/// Returns the tensor sizes, at least `target` elements in all.
inline std::vector<std::size_t> model_sizes(std::size_t target) {
  const std::size_t h = 896, kv = 128, ffn = 4864;
  const std::size_t layer[] = {h * h, h,       kv * h,  kv,      kv * h, kv,
                               h * h, ffn * h, ffn * h, h * ffn, h,      h};
  std::vector<std::size_t> sizes{8192 * h};
  std::size_t total = sizes.front();
  while (total < target)
    for (std::size_t s : layer) {
      sizes.push_back(s);
      total += s;
    }
  return sizes;
}

}  // namespace stepcore::bench
