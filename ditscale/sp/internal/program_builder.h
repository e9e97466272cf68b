// ProgramBuilder: appends ops to one rank's program and derives their dependencies from the
// buffer regions they read and write (read-after-write, write-after-read, write-after-write).
// Dependencies on earlier ops of the same stream are left implicit (streams run in order).
// Remote effects are declared explicitly: a Wait "writes" the regions that peers' puts filled,
// a flow-control Signal "writes" the region it hands back to a peer.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ditscale/sp/schedule.h"

namespace ditscale::sp::internal {

// Thrown by ProgramBuilder::Add when the ops of all ranks sharing one counter exceed its limit
// (BuildSchedule turns it into a Failure naming "schedule").
struct ScheduleTooLarge : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Ops built so far across the ranks of one schedule, and the most allowed.
struct OpBudget {
  int64_t built = 0;
  int64_t limit = 0;  // 0 = none
};

class ProgramBuilder {
 public:
  ProgramBuilder(RankProgram* prog, const AttentionShape& shape, OpBudget* budget = nullptr)
      : prog_(prog), shape_(shape), budget_(budget) {}

  int AddBuffer(const std::string& name, BufferRole role, BufferInit init, int64_t tokens,
                int64_t heads, int64_t width, int element_bytes);
  Region Whole(int buffer) const;
  Region Sub(int buffer, int64_t token_begin, int64_t tokens, int64_t head_begin,
             int64_t heads) const;
  const BufferDecl& decl(int buffer) const { return prog_->buffers[buffer]; }
  int rank() const { return prog_->rank; }
  int64_t RegionBytesOf(const Region& r) const;
  bool Contiguous(const Region& r) const;

  // Appends `op`, adding deps on earlier conflicting accesses plus `extra_deps`.
  int Add(Op op, const std::vector<Region>& reads, const std::vector<Region>& writes,
          const std::vector<int>& extra_deps = {});

  int Copy(OpKind kind, Stream stream, const Region& src, const Region& dst,
           const std::string& label);
  int Attention(const Region& q, const Region& k, const Region& v, const Region& out,
                const Region& lse, const std::string& label);
  int Merge(const Region& part, const Region& part_lse, const Region& acc, const Region& acc_lse,
            const std::string& label);
  int Send(Stream stream, int group, int peer, LinkKind link, int64_t tag, const Region& src,
           const std::string& label);
  int Recv(Stream stream, int group, int peer, LinkKind link, int64_t tag, const Region& dst,
           const std::string& label);
  // `bytes` = size of src; the destination lies in the peer's buffers (no local hazard).
  int Put(Stream stream, int group, int peer, LinkKind link, const Region& src, const Region& dst,
          const std::string& counter, int64_t value, const std::string& label);
  // `group` >= 0: part of a group of concurrently issued ops (e.g. the signals of a sync round).
  int Signal(Stream stream, int peer, LinkKind link, const std::string& counter, int64_t value,
             const std::vector<Region>& releases, const std::vector<int>& extra_deps,
             const std::string& label, int group = -1);
  int Wait(Stream stream, const std::string& counter, int64_t value,
           const std::vector<Region>& makes_valid, const std::string& label);

  // Adds dependencies (earlier ops of this rank) to op `op`.
  void AddDeps(int op, const std::vector<int>& deps);

  int NewGroup() { return next_group_++; }
  int last_op() const { return static_cast<int>(prog_->ops.size()) - 1; }
  int LastOnStream(Stream s) const;

 private:
  struct Access {
    int op;
    Region region;
    Stream stream;  // the op's (a copy: the scan need not touch the op)
    int group;
  };
  RankProgram* prog_;
  AttentionShape shape_;
  OpBudget* budget_;
  std::vector<std::vector<Access>> accesses_;  // per buffer: every read and write
  std::vector<std::vector<Access>> writes_;    // per buffer: the writes alone
  int next_group_ = 0;
};

}  // namespace ditscale::sp::internal
