// The global-norm protocol on explicit tensors and a fingerprint, for callers without a
// NormLayout (the full-offload manager: ManagerConfig::layout_fingerprint and its counted
// accumulators). comm::global_norm(comm, layout, local) is this with the layout's.
#pragma once

#include <cstdint>
#include <span>

#include "stepcore/comm.hpp"
#include "stepcore/norm.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::comm::detail {

/// Collective: local(tensors, NormMode::fast) on every rank, reduced exactly in one
/// collective with the layout check of `fingerprint`, finalised alike everywhere; when
/// that cannot be certified, local(tensors, NormMode::exact) and a second reduction. A
/// rank whose `local` throws still joins each reduction (its failure word reaches every
/// peer, which throws the same code naming "rank N") and then rethrows its own error.
/// Contract and determinism: comm::global_norm (stepcore/comm.hpp).
NormResult global_norm(Communicator& comm, std::uint64_t fingerprint,
                       std::span<const ConstTensorView> tensors, const LocalPartialFn& local);

}  // namespace stepcore::comm::detail
