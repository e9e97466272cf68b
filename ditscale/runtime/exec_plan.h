// How one rank runs a sequence-parallel schedule on a GPU: the host-side plan of the GPU executor.
//
// Everything here is plain C++ (no CUDA), so the decisions of the executor are tested on the CPU:
//  - memory: every buffer of the rank's program gets a 256-byte aligned offset in one device
//    arena, allocated once per (schedule, dtype) and reused by every call; the layer's inputs and
//    outputs are bound to the caller's tensors instead (no copy) unless a peer Puts into them
//    (one-sided transfers need the destination in NVSHMEM's symmetric heap; a Recv target may stay
//    in the caller's tensor). One-sided plans also reserve one uint64 signal word per counter name
//    (and one scratch word) at the end of the arena; counter indices are global (the sorted union
//    of every rank's names), so a sender knows the word of its peer's counter. A schedule may mix
//    both transports (SpConfig::one_sided_inter = false: puts within machines, Send/Recv between
//    them): the plan then uses NCCL and NVSHMEM, and the arena is symmetric as for one-sided.
//  - issue order: the ops of a stream run in schedule order; consecutive ops of one stream with
//    the same group >= 0 are one unit (ncclGroupStart/End). Units are issued from the host in a
//    topological order of their dependencies (the unit before on the same stream, and each
//    dependency's unit), lowest op index first among the ready ones, so the order is
//    deterministic. A dependency on another stream becomes a CUDA event recorded after the
//    producing unit and waited on by the consuming stream.
//  - NCCL matching: NCCL has no tags; a Send and a Recv match by their order on one
//    communicator. CheckNcclOrder verifies for the whole schedule that, for every ordered pair of
//    ranks and every communicator (one per comm stream), the tags of the sender's Sends in its
//    issue order equal the tags of the receiver's Recvs in its issue order.
//  - counters: NVSHMEM signal words are never reset (a reset would need a barrier); they grow
//    by the same amount every layer, so a Wait for `count` in the L-th call waits for
//    L * per_layer_total + count. The signal area holds counters * ranks + 1 words: one per
//    counter (NVSHMEM's atomic adds) or one per (counter, sender) (SlotSignals below), and a
//    scratch word.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ditscale/core/result.h"
#include "ditscale/sp/schedule.h"

namespace ditscale::runtime {

inline constexpr int64_t kArenaAlignment = 256;

// Which buffers live in the caller's tensors (the layer's inputs and outputs).
enum class UserBinding {
  kNone = 0,
  kQ,
  kK,
  kV,
  kOut,
  kTextQ,
  kTextK,
  kTextV,
  kTextOut,
};
const char* ToString(UserBinding b);

struct IssueUnit {
  sp::Stream stream = sp::Stream::kCompute;
  std::vector<int> ops;         // op indices, stream order; more than one = an NCCL group
  std::vector<int> wait_units;  // units on OTHER streams whose completion event this one waits for
  bool record_event = false;    // another stream waits for this unit
};

struct ExecPlan {
  int rank = 0;
  int64_t element_bytes = 2;  // dtype bytes of q/k/v/out (lse buffers are fp32)
  // Per buffer of the rank program: byte offset in the arena (-1 when bound to a user tensor)
  // and the binding.
  std::vector<int64_t> offset;
  std::vector<int64_t> bytes;
  std::vector<UserBinding> binding;
  int64_t buffers_bytes = 0;  // arena bytes used by this rank's buffers
  // One-sided only: the arena size every rank allocates (max of buffers_bytes over ranks,
  // aligned) and where the signal words start in it.
  int64_t arena_bytes = 0;
  int64_t signal_offset = -1;
  std::vector<IssueUnit> units;  // host issue order
  std::vector<int> unit_of_op;   // op index -> index into units
  bool uses_nccl = false;        // Send/Recv present (any rank)
  bool uses_nvshmem = false;     // Put/Signal/Wait present (any rank); both in mixed schedules
};

// Counter names of the whole schedule (sorted, global index = position) and, per rank, how much
// every counter of that rank grows in one layer.
struct CounterTable {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> per_layer_total;  // [rank][counter]
  int index(const std::string& name) const;           // -1 if absent
};
CounterTable BuildCounterTable(const sp::Schedule& schedule);

// Signalling without SMs (the GPU executor's copy-engine engine). A stream memory operation
// (cuStreamWriteValue64) can set a word on a peer but not add to it, so a counter that several
// ranks signal cannot be one word. Each (counter, sender) pair gets its own word on the receiver,
// slot = counter * ranks + sender; the sender SETS it to its running total of the adds it has
// sent to that counter there (a signal of a later layer L: L * per_layer + running total, as for
// the counters above). A Wait becomes one stream wait per sender (>= its threshold): for a
// counter with one sender the Wait's count; for several, the Wait must count all of them (its
// count = the counter's per-layer total: every phase and sync-round Wait of our strategies), and
// each sender's threshold is its whole per-layer total. Setting a word is only monotone when one
// stream issues every signal of a (sender, counter, receiver): checked.
struct SlotWrite {
  int64_t slot = -1;      // word on the peer; -1 = no signal (a put without a counter)
  int64_t value = 0;      // running total within the layer after this op
  int64_t per_layer = 0;  // growth of the word per layer
};
struct SlotWait {
  int64_t slot = 0;   // own word
  int64_t value = 0;  // threshold within the layer
  int64_t per_layer = 0;
};
struct SlotSignals {
  int64_t words = 0;                                      // counters * ranks
  std::vector<std::vector<SlotWrite>> writes;             // [rank][op]: Put / Signal
  std::vector<std::vector<std::vector<SlotWait>>> waits;  // [rank][op]: Wait
};
// Fails, naming the rank, op and counter, when a multi-sender Wait counts part of its senders'
// signals or a sender signals one counter from two streams.
Result<SlotSignals> BuildSlotSignals(const sp::Schedule& schedule);

struct PlanOptions {
  int64_t element_bytes = 2;
  // Bind the layer's inputs/outputs to the caller's tensors when possible (false: every buffer
  // in the arena; the executor then copies the inputs in and the outputs out).
  bool bind_user_tensors = true;
};

// Plans of every rank (one-sided plans depend on the other ranks' layouts). Fails, naming the
// rank, op and field, when a transfer's region is not contiguous, when an op kind cannot run on
// its stream, or when the units cannot be ordered.
Result<std::vector<ExecPlan>> BuildExecPlans(const sp::Schedule& schedule,
                                             const PlanOptions& options);

// The NCCL matching check described above (an empty string when consistent).
std::string CheckNcclOrder(const sp::Schedule& schedule, const std::vector<ExecPlan>& plans);

// Byte offset of the first element of a contiguous region inside its buffer.
int64_t RegionByteOffset(const sp::Region& region, const sp::BufferDecl& decl);

// One line per unit: stream, ops (kind, label), waits; for logs and tests.
std::string PrintPlan(const sp::Schedule& schedule, const ExecPlan& plan);

// When one unit of a traced layer ran on the GPU, in ms after the layer's start on this rank:
// begin = the unit could start (its stream's earlier work and the events it waits for were
// done), end = its last op completed.
struct UnitTiming {
  int unit = 0;
  double begin_ms = 0, end_ms = 0;
};

// The timeline of one traced layer (GpuExecutor::SetTrace / LastTimeline) as text: the units in
// start order with stream, begin, end, duration and their ops (kind and label), then per stream
// the busy time, the idle time inside the layer and the longest unit. Units with no timing are
// left out. Where a layer is slower than its compute, this shows which stream waited for what.
std::string PrintTimeline(const sp::Schedule& schedule, const ExecPlan& plan,
                          const std::vector<UnitTiming>& timings);

}  // namespace ditscale::runtime
