// The global norm across ranks: a small communicator interface (in-process threads,
// MPI, NCCL), the description of how gradient groups are laid out over ranks, and the
// exact reduction of norm partials. docs/numerics.md, "Global norm across ranks".
//
// Free of CUDA and MPI headers (streams are stepcore/cuda_host.hpp's opaque cudaStream_t):
// the MPI and NCCL factories live in comm_mpi.hpp and comm_nccl.hpp, and every factory
// exists in every build (throwing Errc::not_supported when the library was built
// without that transport).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "stepcore/cuda_host.hpp"
#include "stepcore/determinism.hpp"  // the levels named in "Determinism:" lines
#include "stepcore/norm.hpp"
#include "stepcore/optim.hpp"
#include "stepcore/tensor.hpp"

namespace stepcore::cpu {
class Engine;  // cpu.hpp: the overload of global_norm taking an engine
}  // namespace stepcore::cpu

namespace stepcore::comm {

/// Where a communicator's buffers live.
enum class MemorySpace : std::uint8_t { host, device };

/// The element type of a generic all-reduce.
enum class Word : std::uint8_t { u32, u64, f32, f64 };

/// The combining operation of a generic all-reduce.
enum class Op : std::uint8_t { sum, max, min };

/// How long a collective waits for its peers unless set_timeout says otherwise
/// (PyTorch's default for NCCL process groups).
inline constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::minutes(10);

/// The layout check that travels with every reduced norm partial, in the
/// communicator's memory space. Every word is combined with max: when all ranks
/// contribute the same fingerprint f, the result is {f, ~f, 0} — the record is
/// unchanged, so a device copy written once can be reused every step. Any rank
/// with another fingerprint makes fingerprint != ~inverse on every rank; a
/// non-zero `failure` is (rank + 1) << 8 | Errc of the highest rank that could not
/// compute its partial.
struct LayoutCheck {
  std::uint64_t fingerprint = 0;
  std::uint64_t inverse = ~std::uint64_t{0};
  std::uint64_t failure = 0;
};

/// Returns the record this rank contributes for a layout with `fingerprint`.
inline LayoutCheck make_layout_check(std::uint64_t fingerprint) noexcept {
  return {fingerprint, ~fingerprint, 0};
}

/// Throws unless `reduced` (a LayoutCheck after all_reduce_partial) says that every
/// rank contributed `fingerprint` and computed its partial: Errc::invalid_argument
/// naming "layout" on a disagreement; the failing rank's code naming "rank N" for a
/// failure. Every rank sees the same record, so every rank throws alike.
void check_reduced(const LayoutCheck& reduced, std::uint64_t fingerprint);

/// A group of ranks that can all-reduce. One object per rank; not thread-safe (one
/// thread per rank calls it, as with MPI and NCCL communicators).
///
/// Failure semantics: a collective that does not complete within timeout() (a peer
/// that never arrives or left), a transport error, or abort() marks the communicator
/// failed and throws stepcore::Error (Errc::timeout, mpi_error, nccl_error); every
/// later collective throws at once. A failed communicator cannot be repaired: create
/// a new one.
class Communicator {
 public:
  virtual ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  /// Returns this rank, in [0, size()).
  virtual int rank() const noexcept = 0;
  /// Returns the number of ranks.
  virtual int size() const noexcept = 0;
  /// Returns where collective buffers live (device: NCCL).
  virtual MemorySpace memory() const noexcept = 0;
  /// Returns "in_process", "mpi" or "nccl".
  virtual std::string_view name() const noexcept = 0;
  /// Returns the CUDA stream device-memory collectives are enqueued on (null for host
  /// communicators; null is also the legacy default stream of a device communicator).
  /// A device's kernels that produce or consume the reduced data must run on it.
  virtual cudaStream_t stream() const noexcept { return nullptr; }

  /// In-place all-reduce of `count` words at `data` (in memory(); the NCCL
  /// communicator also accepts host memory, staged and synchronised). Blocks until
  /// done for host memory; enqueues on the stream for device memory. Determinism:
  /// bitwise for integer words and max/min; floating-point sums are run_to_run in the
  /// in-process group (rank order) and not_guaranteed otherwise (the transport's order:
  /// the baseline the norm does not use).
  virtual void all_reduce(void* data, std::size_t count, Word word, Op op) = 0;

  /// Reduces a norm partial in place as one collective: digits, nan_count and
  /// inf_count summed as uint64 (exact: normalised digits are below 2^32 and there
  /// are fewer than 2^32 ranks), max_abs_bits and approximate combined with max, and
  /// `check` (may be null) combined with max. Both pointers are in memory(). The
  /// input digits must be normalised (every stepcore partial is); the reduced
  /// digits are not (finalize and merge normalise). Host memory: blocks. Device
  /// memory: enqueued on the stream, no host synchronisation. Determinism: bitwise:
  /// every rank receives the identical record, independent of the transport's algorithm.
  virtual void all_reduce_partial(NormPartial* partial, LayoutCheck* check) = 0;

  /// Waits (up to timeout()) until every collective this rank has issued is
  /// complete, checking for transport errors; a no-op for host communicators.
  virtual void synchronize() = 0;

  /// Marks the communicator failed and aborts the transport where it can: wakes the
  /// in-process peers with an error; ncclCommAbort (the NCCL communicator is freed);
  /// MPI only marks this rank's communicator failed (MPI cannot abort one
  /// communicator without ending the job: call MPI_Abort for that). Never throws.
  virtual void abort() noexcept = 0;

  /// Returns true once a collective failed or abort() was called.
  virtual bool failed() const noexcept = 0;

  /// Sets how long a collective may wait for its peers (> 0).
  void set_timeout(std::chrono::milliseconds timeout);
  /// Returns the collective timeout.
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }

 protected:
  explicit Communicator(std::chrono::milliseconds timeout);

 private:
  std::chrono::milliseconds timeout_;
};

/// Returns `size` communicators that talk to each other through shared memory of
/// this process, one per thread (rank i is element i). For tests and single-process
/// multi-worker setups. Host memory. Floating-point sums are combined in rank
/// order, so every result is a pure function of the inputs.
std::vector<std::unique_ptr<Communicator>> make_in_process_group(
    int size, std::chrono::milliseconds timeout = kDefaultTimeout);

/// Returns true when the library was built with the MPI communicator.
bool built_with_mpi() noexcept;
/// Returns true when the library was built with the NCCL communicator.
bool built_with_nccl() noexcept;

/// The bytes of an ncclUniqueId, handed from one rank to all others.
using NcclUniqueId = std::array<unsigned char, 128>;

// ---- layouts --------------------------------------------------------------------

/// The global description of one group of gradient tensors: identical on every rank.
struct GroupLayout {
  std::string name;                 ///< unique within a layout ("dense", "experts.3", ...)
  std::uint64_t logical_numel = 0;  ///< elements of the whole, unsharded group
  int num_shards = 1;               ///< ranks one copy is sharded over (FSDP group size)
  int num_replicas = 1;             ///< full copies (HSDP replicas, tensor-parallel replicated)
};

/// This rank's place in a group it holds.
struct GroupPlacement {
  int shard_index = 0;    ///< in [0, num_shards)
  int replica_index = 0;  ///< in [0, num_replicas); only replica 0 contributes
};

/// How every gradient group is laid out over the ranks of a communicator, and this
/// rank's tensors. Every rank adds every group, in the same order, with the same
/// GroupLayout (groups a rank does not hold — another pipeline stage's, another
/// expert group's — with add_absent). Each logical element then counts exactly once:
/// the shards of replica 0. The tensors are views: they must stay valid while the
/// layout is used.
class NormLayout {
 public:
  /// Adds a group this rank holds a shard of, with the shard's tensors (any number
  /// and sizes, possibly none or empty; f32, bf16 or f16). Throws (nothing added):
  /// invalid_argument for an empty or repeated name, out_of_range for
  /// num_shards/num_replicas < 1 or an index outside them, size_mismatch when the
  /// shard has more elements than logical_numel, and the norm's own tensor checks.
  void add(const GroupLayout& group, GroupPlacement placement,
           std::span<const ConstTensorView> local);
  /// Adds a group this rank holds no part of. Same checks on `group`.
  void add_absent(const GroupLayout& group);

  /// Returns a 64-bit hash of the global description (names, logical sizes, shard
  /// and replica counts, in order): equal on every rank of a consistent layout.
  std::uint64_t fingerprint() const noexcept { return fingerprint_; }
  /// Returns the number of groups.
  std::size_t group_count() const noexcept { return groups_.size(); }
  /// Returns the local tensors that count towards the norm (replica 0's shards).
  std::span<const ConstTensorView> counted_tensors() const noexcept { return counted_; }

 private:
  struct Group {
    GroupLayout layout;
    bool present = false;
    GroupPlacement placement;
    std::uint64_t local_numel = 0;
  };
  void add_group(const GroupLayout& group, bool present, GroupPlacement placement,
                 std::span<const ConstTensorView> local);
  friend void validate_layout(Communicator& comm, const NormLayout& layout);

  std::vector<Group> groups_;
  std::vector<ConstTensorView> counted_;
  std::uint64_t state_ = 0;
  std::uint64_t fingerprint_ = 0;
};

/// Collective (every rank calls it): checks that all ranks share the layout's global
/// description and that the shards add up: for every group, the replica-0 shards
/// hold logical_numel elements in total, all replicas num_replicas * logical_numel,
/// and num_shards * num_replicas ranks hold a part. Throws Errc::invalid_argument
/// naming "layout" on every rank otherwise (communicator errors as usual).
/// Determinism: bitwise: the verdict is the same on every rank.
void validate_layout(Communicator& comm, const NormLayout& layout);

/// Computes this rank's norm partial over `tensors`: NormMode::fast may return an
/// approximate partial, NormMode::exact must return the exact one
/// (reference::norm_partial or cpu::Engine::norm_partial(..., NormMode::exact)).
using LocalPartialFn =
    std::function<NormPartial(std::span<const ConstTensorView> tensors, NormMode mode)>;

/// Collective: the norm of every logical element of the layout, over all ranks.
/// Each rank computes the fast partial of its counted tensors, the partials and the
/// layout check are reduced exactly in one collective, and every rank finalises the
/// same reduced partial; when that cannot be certified (needs_exact) every rank
/// computes its exact partial and a second exact reduction follows. Throws
/// invalid_argument "layout" on every rank when the fingerprints disagree, and the
/// communicator's errors (timeout, mpi_error, ...). A rank whose partial throws
/// rethrows that error; its peers throw the same code naming "rank N".
/// Determinism: bitwise: every rank returns the identical NormResult, equal to
/// finalize(reference::norm_partial(...)) of all logical elements in one process —
/// for any rank count, sharding, replication, transport and collective algorithm.
/// The inf-norm (max_abs) and found-inf (!finite, nan_count, inf_count) are global.
NormResult global_norm(Communicator& comm, const NormLayout& layout, const LocalPartialFn& local);

/// global_norm with the CPU engine's partials of the values read as `read`.
NormResult global_norm(Communicator& comm, const NormLayout& layout, const cpu::Engine& engine,
                       GradientRead read = {});

}  // namespace stepcore::comm
