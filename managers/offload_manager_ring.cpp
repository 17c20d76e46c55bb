// OffloadGradientManager's rings (managers/offload_manager.hpp): gradients staged piece by
// piece as backward hands them over, the step run batch by batch (a batch: the pieces one
// ring slot holds), compute weights uploaded through the upload ring, and a holding
// step's gradients read again from the device through the fetch ring (or in place), each
// read as its exact f32 widening would be (GradientRead::as_f32): no widening pass. A piece is at
// most one slot of one parameter; every element's result is the same whatever the pieces
// (element-wise optimizers; a parameter's step counter advances once per step).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "managers/common.hpp"
#include "managers/offload_manager.hpp"
#include "stepcore/error.hpp"

namespace stepcore::detail {

using device::Event;
using device::Queue;

namespace {

// Elements [offset, offset + count) of an f32 view (the view itself when empty).
TensorView part(const TensorView& v, std::size_t offset, std::size_t count) {
  if (v.numel == 0) return v;
  return f32_view(static_cast<float*>(v.data) + offset, count);
}

// The 8-bit slot of a piece starting at element `offset` (a multiple of kQ8BlockSize: the
// ring's slots hold whole blocks, ring_geometry).
Q8Slot q8_part(const Q8Slot& q, std::size_t offset) {
  return {q.codes + offset, q.absmax + offset / kQ8BlockSize};
}

// Copies the codes and maxima of a piece of `count` elements: a speculative step of an
// 8-bit slot steps the spare in place, from a copy of the live state.
void copy_q8(const Q8Slot& dst, const Q8Slot& src, std::size_t count) {
  std::memcpy(dst.codes, src.codes, count);
  std::memcpy(dst.absmax, src.absmax, q8_blocks(count) * sizeof(float));
}

}  // namespace

std::vector<std::vector<OffloadGradientManager::Piece>> OffloadGradientManager::batches(
    std::span<const std::size_t> members, std::size_t batch_elements) const {
  std::vector<std::vector<Piece>> out;
  std::size_t slot = 0, used = 0;
  RingGeometry g = ring_;
  if (batch_elements != 0) g.slot_elements = batch_elements;
  for (std::size_t i : members)
    pack_pieces(config(), g, i, i + 1, slot, used,
                [&](std::size_t param, std::size_t offset, std::size_t count, std::size_t s,
                    std::size_t at) {
                  if (out.size() <= s) out.resize(s + 1);
                  out[s].push_back({param, offset, count, s, at});
                });
  return out;
}

void OffloadGradientManager::stage_piece(std::size_t i, bool first_in_step,
                                         const ConstTensorView& grad, const Piece& pc,
                                         bool wait_written, const Event& written) {
  const std::size_t width = dtype_size(grad.dtype);
  char* dst = staging_ring_.at(pc.slot, pc.at);
  const Event copied = on_device([&] {
    if (wait_written) {
      dev_.wait(Queue::d2h, dev_.record(Queue::compute));  // backward's writes first
      dev_.wait(Queue::d2h, written);                      // and the trainer's event
    }
    dev_.copy(Queue::d2h, dst, static_cast<const char*>(grad.data) + pc.offset * width,
              pc.count * width);
    last_d2h_param_ = i;
    return last_d2h_ = dev_.record(Queue::d2h);
  });
  released_[i] = copied;  // the last piece's copy: the d2h queue runs in order
  const bool hold = holding_;
  const float scale = gradient_scale();
  staging_task_[pc.slot] = post(
      [this, pc, copied, first_in_step, hold, scale,
       src = ConstTensorView{dst, pc.count, grad.dtype}] {
        sync_event(copied, {Awaited::gradient_copy, pc.param});
        if (!hold) {
          const AccumulatePair pair{part(params_[pc.param].acc, pc.offset, pc.count), src,
                                    first_in_step};
          engine_.accumulate({&pair, 1});
          return;
        }
        // A holding step: the piece's part of the norm.
        if (config().params[pc.param].counts_toward_norm)
          add_held_partial(chunk_partial_[chunk_of(pc.param)], src, scale);
      },
      main);
}

void OffloadGradientManager::add_held_partial(NormPartial& partial, const ConstTensorView& src,
                                              float scale) {
  if (src.numel == 0) return;
  merge(partial, engine_.norm_partial({&src, 1}, held_read(scale, 1.0f), NormMode::fast));
}

void OffloadGradientManager::hold_in_place(std::size_t i, const ConstTensorView& grad,
                                           const Event& written) {
  // Backward's writes (the compute queue so far) and the trainer's event come before any
  // read; the step reads after this task (the main lane runs first). One task and one
  // engine call for the whole gradient.
  const Event computed = on_device([&] { return dev_.record(Queue::compute); });
  post(
      [this, i, grad, computed, written, counted = config().params[i].counts_toward_norm,
       scale = gradient_scale()] {
        sync_event(computed, {Awaited::gradient_copy, i});
        sync_event(written, {Awaited::gradient_copy, i});
        if (counted) add_held_partial(chunk_partial_[chunk_of(i)], grad, scale);
      },
      main);
}

void OffloadGradientManager::do_gradient_ready(std::size_t i, bool first_in_step,
                                               ConstTensorView grad, const Event& written) {
  raise_if_failed();
  Param& p = params_[i];
  if (holding_) p.held = grad;  // read again by the step
  released_[i] = Event{};
  // A holding step on a device whose memory the CPU reads: the gradient is read where it
  // is, at arrival for the norm and by the step, never copied.
  if (holding_ && dev_.host_accessible()) {
    hold_in_place(i, grad, written);
    return;
  }
  bool first_piece = true;
  for (std::size_t off = 0; off < grad.numel;) {
    const std::size_t n = std::min(ring_.slot_elements, grad.numel - off);
    Cursor& c = staging_at_;
    if (c.used != 0 && c.used + n > ring_.slot_elements) {
      c.slot = (c.slot + 1) % ring_.slots;
      c.used = 0;
    }
    if (c.used == 0) {  // a slot is free once the worker has read what it held
      const auto t0 = std::chrono::steady_clock::now();
      wait_done(main, staging_task_[c.slot]);
      staging_wait_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      raise_if_failed();
    }
    const Piece pc{i, off, n, c.slot, c.used};
    c.used += piece_span(n);
    stage_piece(i, first_in_step, grad, pc, first_piece, written);
    first_piece = false;
    off += n;
  }
}

Event OffloadGradientManager::do_gradient_released(std::size_t i) const {
  // Only a gradient handed over in this holding step is read again.
  if (!holding_ || params_[i].held.numel == 0) return released_[i];
  if (!step_posted_)
    throw Error(Errc::invalid_argument, "gradient_released",
                "parameter " + std::to_string(i) +
                    "'s gradient is read again by step() (gradients_read_by_step()): it is "
                    "released once step() has run");
  // The step's reads are host-synchronised copies: once its tasks ran, nothing reads it.
  wait_done(late, step_end_task_);
  raise_if_failed();
  return Event{};
}

std::size_t OffloadGradientManager::next_upload_slot() {
  const std::size_t slot = upload_next_;
  upload_next_ = (upload_next_ + 1) % ring_.slots;
  Event e;
  Awaited what{};
  {
    const std::lock_guard lock(dev_mu_);
    e = upload_done_[slot];
    what = last_upload_what_;
  }
  sync_event(e, what);
  return slot;
}

void OffloadGradientManager::upload_rounded_range(std::size_t i, std::size_t offset,
                                                  std::size_t count) {
  const Param& p = params_[i];
  const std::size_t width = dtype_size(p.compute.dtype);
  for (std::size_t off = offset; off < offset + count; off += ring_.slot_elements) {
    const std::size_t n = std::min(ring_.slot_elements, offset + count - off);
    const std::size_t slot = next_upload_slot();
    round_into({static_cast<const float*>(p.master().data) + off, n},
               TensorView{upload_ring_.at(slot, 0), n, p.compute.dtype});
    on_device([&] {
      dev_.copy(Queue::h2d, static_cast<char*>(p.compute.data) + off * width,
                upload_ring_.at(slot, 0), n * width);
      upload_done_[slot] = last_upload_ = dev_.record(Queue::h2d);
      last_upload_what_ = {Awaited::upload, i};
    });
  }
}

void OffloadGradientManager::fetch_piece(const Piece& pc, std::size_t slot) {
  const ConstTensorView& g = params_[pc.param].held;
  if (pc.count == 0) return;
  if (g.numel == 0) {  // no gradient this step: zeros (of the ring's width), CPU-written
    // after every copy still bound for the slot (a cancelled speculation's prefetch)
    sync_event(fetched_[slot], {Awaited::gradient_copy, pc.param});
    std::memset(fetch_ring_.at(slot, pc.at), 0, pc.count * fetch_ring_.elem_bytes);
    return;
  }
  if (dev_.host_accessible()) return;  // read in place (held_piece)
  const std::size_t width = dtype_size(g.dtype);
  on_device([&] {
    dev_.copy(Queue::d2h, fetch_ring_.at(slot, pc.at),
              static_cast<const char*>(g.data) + pc.offset * width, pc.count * width);
    fetched_[slot] = dev_.record(Queue::d2h);
  });
}

ConstTensorView OffloadGradientManager::held_piece(const Piece& pc, std::size_t slot) const {
  const ConstTensorView& g = params_[pc.param].held;
  // Zeros in the fetch slot (fetch_piece) for a parameter without a gradient this step.
  if (g.numel == 0) {
    const DType zeros = fetch_ring_.elem_bytes == 4 ? DType::f32 : DType::bf16;
    return {fetch_ring_.at(slot, pc.at), pc.count, zeros};
  }
  // The device's memory in place where the CPU may read it (the arrival's task waited for
  // backward's writes and the trainer's event: hold_in_place), else the fetched copy.
  if (dev_.host_accessible())
    return {static_cast<const char*>(g.data) + pc.offset * dtype_size(g.dtype), pc.count, g.dtype};
  return {fetch_ring_.at(slot, pc.at), pc.count, g.dtype};
}

GradientRead OffloadGradientManager::held_read(float scale, float clip) {
  // A held 16-bit gradient read as its exact widening into an accumulator would be.
  return GradientRead{scale, clip, /*as_f32=*/true};
}

void OffloadGradientManager::run_chunk(std::size_t k, GradientRead read,
                                       const GroupConfigs& configs, Target target,
                                       const Event& after, std::uint64_t generation) {
  const Chunk& c = chunks()[k];
  const bool counts = shape().counts_steps;
  const bool into_spare = target != Target::live;
  const bool fetch = holding_;  // the gradients are read again from the device
  // An optimizer that does not read the scale and clip (SignSGD) reads them as 1, so
  // that a zero clip coefficient (max_norm = 0) is not refused.
  // A holding step reads the held 16-bit gradients rounding in f32, as the accumulator
  // an accumulating step reads would hold them.
  GradientRead r = shape().reads_scaled ? read : GradientRead{};
  if (fetch) r = held_read(r.scale, r.clip);
  // On a device the CPU reads and writes in place, a batch goes through no ring (unless
  // its compute weights go to device staging): batches of the whole ring's elements, so
  // fewer engine calls, and a cancelled speculation still stops within one of them.
  const bool ring_free = dev_.host_accessible() && target != Target::spare_staged;
  const std::size_t batch_elements = ring_free ? ring_.slots * ring_.slot_elements : 0;
  // The fetch slots a batch's pieces index (a ring-free batch spans the whole fetch ring:
  // there it holds only the zeros of parameters without a gradient, fetch_piece).
  const std::size_t fetch_slots = ring_free ? 1 : ring_.slots;
  bool waited = after.empty();
  // The counters the step starts from (a parameter's pieces in several batches each
  // advance a copy of its counter; the result is written once every batch ran).
  const std::vector<float> start(steps_.begin() + c.first, steps_.begin() + c.last);
  std::vector<float>& out_steps = into_spare ? spec_steps_ : steps_;
  // One engine call per batch of one group's pieces; out of place, the live state is
  // the source and the spare the destination.
  for_each_group(
      config().params, groups().size(), c.first, c.last,
      [&](std::size_t group, std::span<const std::size_t> members) {
        const std::vector<std::vector<Piece>> bs = batches(members, batch_elements);
        if (fetch && !bs.empty())
          for (const Piece& pc : bs[0]) fetch_piece(pc, 0);
        std::vector<OptimizerTensor> t;
        std::vector<float> counters;
        for (std::size_t b = 0; b < bs.size(); ++b) {
          if (generation != 0 && cancelled_.load(std::memory_order_acquire) == generation)
            return;  // a rollback or skip came: the rest of this speculation is discarded
          const std::vector<Piece>& batch = bs[b];
          if (fetch) {
            if (!batch.empty())
              sync_event(fetched_[b % fetch_slots], {Awaited::gradient_copy, batch.front().param});
            if (b + 1 < bs.size())  // the next batch's copies overlap this batch's step
              for (const Piece& pc : bs[b + 1]) fetch_piece(pc, (b + 1) % fetch_slots);
          }
          bool output = false;
          for (const Piece& pc : batch)
            output = output || (target != Target::spare && params_[pc.param].compute.numel != 0);
          // On a device the CPU writes in place, the model's compute weights are written
          // where they are, once backward's use of the old ones is over.
          const bool direct = output && target == Target::live && dev_.host_accessible();
          if (direct && !waited) {
            sync_event(after, {Awaited::chunk_upload, k});
            waited = true;
          }
          output = output && !direct;
          const std::size_t slot = output ? next_upload_slot() : 0;
          t.clear();
          counters.assign(batch.size(), 0.0f);
          for (std::size_t j = 0; j < batch.size(); ++j) {
            const Piece& pc = batch[j];
            const Param& p = params_[pc.param];
            auto cut = [&](const TensorView& v) { return part(v, pc.offset, pc.count); };
            OptimizerTensor o{cut(into_spare ? p.spare[0] : p.state[0])};
            for (std::size_t s = 0; s < state_slots() && s < kMaxOptimizerSlots; ++s) {
              if (p.q8[s].codes != nullptr) {  // 8-bit: stepped in place, on whole blocks
                // (An empty parameter's spare is its live slot: nothing to copy.)
                const bool spare = into_spare && pc.count != 0;
                o.q8[s] = q8_part(spare ? p.q8_spare[s] : p.q8[s], pc.offset);
                if (spare) copy_q8(o.q8[s], q8_part(p.q8[s], pc.offset), pc.count);
                continue;
              }
              o.state[s] = cut(into_spare ? p.spare[1 + s] : p.state[1 + s]);
              if (into_spare) o.state_src[s] = cut(p.state[1 + s]);
            }
            if (into_spare) o.param_src = cut(p.state[0]);
            if (counts) {  // each piece advances a copy: the parameter's counter moves once
              counters[j] = start[pc.param - c.first];
              o.step = &counters[j];
            }
            o.grad = fetch ? held_piece(pc, b % fetch_slots) : ConstTensorView(cut(p.acc));
            if (direct && p.compute.numel != 0)
              o.compute_param = {
                  static_cast<char*>(p.compute.data) + pc.offset * dtype_size(p.compute.dtype),
                  pc.count, p.compute.dtype};
            else if (output && p.compute.numel != 0)
              o.compute_param = {upload_ring_.at(slot, pc.at), pc.count, p.compute.dtype};
            else if (target == Target::spare && p.compute.numel != 0)  // its rollback space
              o.compute_param = {
                  static_cast<char*>(p.out.data) + pc.offset * dtype_size(p.compute.dtype),
                  pc.count, p.compute.dtype};
            t.push_back(o);
          }
          with_unit(configs[group], [&](auto, const auto& cfg) {
            engine_.step(std::span<const OptimizerTensor>(t), cfg, r);
          });
          if (counts)
            for (std::size_t j = 0; j < batch.size(); ++j) out_steps[batch[j].param] = counters[j];
          if (!output) continue;
          on_device([&] {
            if (!waited) dev_.wait(Queue::h2d, after);  // backward's use of the old weights
            waited = true;
            for (const Piece& pc : batch) {
              const Param& p = params_[pc.param];
              if (p.compute.numel == 0) continue;
              const std::size_t width = dtype_size(p.compute.dtype);
              char* dst =
                  static_cast<char*>(target == Target::live ? p.compute.data : p.staged.data);
              dev_.copy(Queue::h2d, dst + pc.offset * width, upload_ring_.at(slot, pc.at),
                        pc.count * width);
            }
            upload_done_[slot] = last_upload_ = dev_.record(Queue::h2d);
            last_upload_what_ = {Awaited::chunk_upload, k};
          });
        }
      });
}

NormPartial OffloadGradientManager::held_norm_partial(NormMode mode, float scale) {
  std::vector<std::size_t> members;
  for (std::size_t i = 0; i < params_.size(); ++i)
    if (config().params[i].counts_toward_norm && params_[i].held.numel != 0) members.push_back(i);
  NormPartial total{};
  const std::vector<std::vector<Piece>> bs = batches(members);
  std::vector<ConstTensorView> pieces;
  for (std::size_t b = 0; b < bs.size(); ++b) {
    for (const Piece& pc : bs[b]) fetch_piece(pc, 0);
    if (!bs[b].empty()) sync_event(fetched_[0], {Awaited::gradient_copy, bs[b].front().param});
    pieces.clear();
    for (const Piece& pc : bs[b]) pieces.push_back(held_piece(pc, 0));
    merge(total, engine_.norm_partial(pieces, held_read(scale, 1.0f), mode));
  }
  return total;
}

NormPartial OffloadGradientManager::local_partial(NormMode mode, float scale) {
  if (mode == NormMode::fast && (holding_ || overlap())) {
    // The merge of the chunks' partials (their digits are exact integers; the error
    // bounds add like threads' do), made as the gradients arrived (holding) or as each
    // chunk completed (overlap); speculative steps may still run.
    drain(main);
    NormPartial merged{};
    for (const NormPartial& p : chunk_partial_) merge(merged, p);
    return merged;
  }
  drain();  // rare (an exact pass): the engine here, so nothing else may use it
  if (holding_) return held_norm_partial(mode, scale);
  return engine_.norm_partial(counted_acc_, GradientRead{scale, 1.0f}, mode);
}

void OffloadGradientManager::commit_compute(std::size_t k, const Event& after) {
  const Chunk& c = chunks()[k];
  const bool staged = has_stage_[k] != 0;
  on_device([&] {
    dev_.wait(Queue::h2d, after);  // backward's use of the old weights comes first
    for (std::size_t i = c.first; i < c.last; ++i) {
      const Param& p = params_[i];
      if (p.compute.numel != 0)
        dev_.copy(Queue::h2d, p.compute.data, staged ? p.staged.data : p.out.data,
                  p.compute.bytes());
    }
    last_upload_ = dev_.record(Queue::h2d);
    last_upload_what_ = {Awaited::chunk_upload, k};
  });
}

}  // namespace stepcore::detail
