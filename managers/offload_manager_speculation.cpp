// OffloadGradientManager's speculation (managers/offload_manager.hpp), overlapped steps: a
// chunk whose final gradients are in is stepped out of place, reading its live state and
// writing the new state into its spare (rollback space from
// ManagerConfig::speculation_bytes, a chunk's spare kept once given), compute weights into
// the pinned upload buffers, nothing uploaded to the model's weights (with
// ManagerConfig::speculation_device_bytes, they are uploaded into device staging at once,
// and a commit copies them device-to-device). The decision then commits (the spare
// becomes the live state: a pointer swap, then the uploads) or rolls back (the live state
// was never written: it is stepped again in place with the coefficient, or left alone when
// the step is skipped). No formula is ever inverted.
#include <algorithm>
#include <mutex>
#include <string>

#include "managers/common.hpp"
#include "managers/offload_manager.hpp"
#include "stepcore/comm.hpp"
#include "stepcore/error.hpp"

namespace stepcore::detail {

using device::Event;

bool OffloadGradientManager::admit(std::size_t k) {
  if (has_spare_[k]) return true;
  // The chunk's state spares and its compute weights' pinned space, each within its share
  // of the budget.
  if (chunk_state_bytes_[k] > spare_cap_ - spare_used_ ||
      chunk_compute_bytes_[k] > out_cap_ - out_used_)
    return false;
  // The chunk keeps this space from now on (a commit swaps its spares with the live state).
  for (std::size_t i = chunks()[k].first; i < chunks()[k].last; ++i) {
    Param& p = params_[i];
    auto take = [&](std::size_t bytes) {
      char* at = static_cast<char*>(spare_space_.data()) + spare_used_;
      spare_used_ += aligned_bytes(bytes);
      return at;
    };
    const std::size_t numel = config().params[i].numel;
    for (std::size_t s = 0; s < slots(); ++s) {
      if (s != 0 && p.q8[s - 1].codes != nullptr) {  // an 8-bit slot: codes, then maxima
        Q8Slot& q = p.q8_spare[s - 1];
        if (numel == 0) {  // no bytes: the live slot's pointers (the space may be empty)
          q = p.q8[s - 1];
          continue;
        }
        q.codes = reinterpret_cast<std::uint8_t*>(take(numel));
        q.absmax = reinterpret_cast<float*>(take(q8_blocks(numel) * sizeof(float)));
        continue;
      }
      p.spare[s] = f32_view(reinterpret_cast<float*>(take(numel * sizeof(float))), numel);
    }
    if (p.compute.numel != 0) {
      p.out = {static_cast<char*>(out_space_) + out_used_, p.compute.numel, p.compute.dtype};
      out_used_ += aligned_bytes(p.compute.bytes());
    }
  }
  has_spare_[k] = 1;
  // Device staging, when the chunk's compute weights fit what is left of it.
  if (chunk_compute_bytes_[k] != 0 && chunk_compute_bytes_[k] <= stage_bytes_ - stage_used_) {
    for (std::size_t i = chunks()[k].first; i < chunks()[k].last; ++i) {
      Param& p = params_[i];
      if (p.compute.numel == 0) continue;
      p.staged = {static_cast<char*>(stage_space_) + stage_used_, p.compute.numel, p.compute.dtype};
      stage_used_ += aligned_bytes(p.compute.bytes());
    }
    has_stage_[k] = 1;
  }
  return true;
}

void OffloadGradientManager::do_reserve_speculation() {
  const std::int64_t device_budget = config().speculation_device_bytes;
  if (stage_space_ == nullptr && device_budget != 0) {
    std::size_t need = 0;
    for (std::size_t bytes : chunk_compute_bytes_) need += bytes;
    const std::size_t bytes = device_budget == ManagerConfig::kAllChunks
                                  ? need
                                  : std::min(need, static_cast<std::size_t>(device_budget));
    if (bytes != 0) {
      try {
        const std::lock_guard lock(dev_mu_);  // not on_device: a refusal fails nothing
        stage_space_ = dev_.allocate(bytes);
      } catch (const Error& e) {
        throw Error(
            Errc::out_of_range, "speculation_device_bytes",
            "cannot reserve " + std::to_string(bytes) + " bytes of device staging: " + e.what());
      }
      stage_bytes_ = bytes;
      ledger().set("speculation_device", true, bytes);
    }
  }
  if (spare_space_.data() != nullptr || out_space_ != nullptr) return;
  std::size_t state = 0, out = 0;
  for (std::size_t bytes : chunk_state_bytes_) state += bytes;
  for (std::size_t bytes : chunk_compute_bytes_) out += bytes;
  const std::size_t bytes = std::min(state + out, speculation_budget());
  if (bytes == 0) return;
  // The budget split between the two parts as the model's bytes are (every chunk needs
  // both in about that ratio).
  const std::size_t state_cap =
      bytes == state + out
          ? state
          : static_cast<std::size_t>(static_cast<unsigned __int128>(bytes) * state / (state + out));
  const std::size_t out_cap = bytes - state_cap;
  try {
    if (state_cap != 0) spare_space_ = numa::HostBuffer(state_cap, config().numa_node);
    if (out_cap != 0) {
      const std::lock_guard lock(dev_mu_);  // not on_device: a refusal fails nothing
      out_space_ = dev_.allocate_host(out_cap, config().numa_node);
    }
  } catch (const Error& e) {
    spare_space_ = numa::HostBuffer{};
    throw Error(
        Errc::out_of_range, "speculation_bytes",
        "cannot reserve " + std::to_string(bytes) + " bytes of rollback space: " + e.what());
  }
  spare_cap_ = state_cap;
  out_cap_ = out_cap;
  ledger().set("speculation", false, bytes);
}

void OffloadGradientManager::do_step_chunk(std::size_t chunk) {
  raise_if_failed();
  const float scale = gradient_scale();
  const bool speculate = speculating() && admit(chunk);
  speculated_[chunk] = speculate ? 1 : 0;
  // The chunk's part of the global norm (exact integer partials merge in any order); a
  // holding step made it piece by piece as the gradients arrived.
  if (!holding_)
    post(
        [this, chunk, scale] {
          chunk_partial_[chunk] = engine_.norm_partial(chunk_counted_[chunk],
                                                       GradientRead{scale, 1.0f}, NormMode::fast);
        },
        main);
  // Speculating: its step as if the coefficient were 1 and the step finite, unless the
  // decision (a rollback or skip) came first.
  if (speculate)
    post([this, chunk, scale, gen = generation_, configs = group_configs()] {
      if (cancelled_.load(std::memory_order_acquire) == gen) return;
      run_chunk(chunk, GradientRead{scale, 1.0f}, configs,
                has_stage_[chunk] ? Target::spare_staged : Target::spare, Event{}, gen);
    });
}

bool OffloadGradientManager::keeps_speculation() const {
  // Speculated chunks stay as they are when the coefficient is 1 (an optimizer that does
  // not read it, SignSGD: any coefficient) and the step is finite.
  return norm_.finite && (clip_ == 1.0f || !shape().reads_scaled);
}

void OffloadGradientManager::cancel_speculation() {
  cancelled_.store(generation_, std::memory_order_release);
}

}  // namespace stepcore::detail
