#include "ditscale/sp/internal/program_builder.h"

#include <algorithm>

#include "ditscale/core/error.h"

namespace ditscale::sp::internal {
namespace {

bool Overlap(const Region& a, const Region& b) {
  if (a.buffer != b.buffer || a.empty() || b.empty()) return false;
  return a.token_begin < b.token_begin + b.tokens && b.token_begin < a.token_begin + a.tokens &&
         a.head_begin < b.head_begin + b.heads && b.head_begin < a.head_begin + a.heads;
}

}  // namespace

int ProgramBuilder::AddBuffer(const std::string& name, BufferRole role, BufferInit init,
                              int64_t tokens, int64_t heads, int64_t width, int element_bytes) {
  DS_CHECK(prog_->FindBuffer(name) < 0, "rank ", prog_->rank, ": buffer '", name, "' twice");
  prog_->buffers.push_back(BufferDecl{name, role, init, tokens, heads, width, element_bytes});
  accesses_.emplace_back();
  writes_.emplace_back();
  return static_cast<int>(prog_->buffers.size()) - 1;
}

Region ProgramBuilder::Whole(int buffer) const {
  const BufferDecl& d = decl(buffer);
  return Region{buffer, 0, d.tokens, 0, d.heads};
}

Region ProgramBuilder::Sub(int buffer, int64_t token_begin, int64_t tokens, int64_t head_begin,
                           int64_t heads) const {
  const BufferDecl& d = decl(buffer);
  DS_CHECK(token_begin >= 0 && token_begin + tokens <= d.tokens && head_begin >= 0 &&
               head_begin + heads <= d.heads,
           "region out of buffer '", d.name, "'");
  return Region{buffer, token_begin, tokens, head_begin, heads};
}

int64_t ProgramBuilder::RegionBytesOf(const Region& r) const {
  return RegionBytes(r, decl(r.buffer), shape_.batch);
}

bool ProgramBuilder::Contiguous(const Region& r) const {
  return RegionContiguous(r, decl(r.buffer), shape_.batch);
}

int ProgramBuilder::LastOnStream(Stream s) const {
  for (int i = last_op(); i >= 0; --i) {
    if (prog_->ops[i].stream == s) return i;
  }
  return -1;
}

int ProgramBuilder::Add(Op op, const std::vector<Region>& reads, const std::vector<Region>& writes,
                        const std::vector<int>& extra_deps) {
  const int index = static_cast<int>(prog_->ops.size());
  if (budget_ != nullptr && budget_->limit > 0 && ++budget_->built > budget_->limit) {
    throw ScheduleTooLarge("more than " + std::to_string(budget_->limit) +
                           " ops built: the schedule exceeds its size limit");
  }
  // Conflicting earlier accesses on another stream become deps; those on this stream are implied
  // by stream order and skipped here, without looking at the op (the lists grow with the
  // program, so this scan is the builder's inner loop). A read conflicts only with writes.
  std::vector<int> deps;
  auto scan = [&](const Region& r, bool write) {
    if (!r.valid() || r.empty()) return;
    for (const Access& a : write ? accesses_[r.buffer] : writes_[r.buffer]) {
      if (!Overlap(a.region, r)) continue;
      if (a.stream == op.stream) {
        DS_CHECK(op.group < 0 || a.group != op.group, "rank ", prog_->rank, ": op '", op.label,
                 "' depends on '", prog_->ops[a.op].label, "' of its own group");
        continue;  // implied by stream order
      }
      deps.push_back(a.op);
    }
  };
  for (const Region& r : reads) scan(r, false);
  for (const Region& r : writes) scan(r, true);
  for (int d : extra_deps) {
    const Op& prev = prog_->ops[d];
    if (prev.stream == op.stream) {
      DS_CHECK(op.group < 0 || prev.group != op.group, "rank ", prog_->rank, ": op '", op.label,
               "' depends on '", prev.label, "' of its own group");
      continue;  // implied by stream order
    }
    deps.push_back(d);
  }
  std::sort(deps.begin(), deps.end());
  deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
  op.deps = std::move(deps);
  for (const Region& r : reads) {
    if (r.valid() && !r.empty()) accesses_[r.buffer].push_back({index, r, op.stream, op.group});
  }
  for (const Region& r : writes) {
    if (r.valid() && !r.empty()) {
      accesses_[r.buffer].push_back({index, r, op.stream, op.group});
      writes_[r.buffer].push_back({index, r, op.stream, op.group});
    }
  }
  prog_->ops.push_back(std::move(op));
  return index;
}

int ProgramBuilder::Copy(OpKind kind, Stream stream, const Region& src, const Region& dst,
                         const std::string& label) {
  Op op;
  op.kind = kind;
  op.stream = stream;
  op.src = src;
  op.dst = dst;
  op.bytes = RegionBytesOf(src);
  op.label = label;
  return Add(std::move(op), {src}, {dst});
}

void ProgramBuilder::AddDeps(int op, const std::vector<int>& deps) {
  DS_CHECK(op >= 0 && op < static_cast<int>(prog_->ops.size()), "AddDeps: no op ", op);
  std::vector<int>& d = prog_->ops[op].deps;
  for (int x : deps) {
    DS_CHECK(x >= 0 && x < op, "AddDeps: op ", op, " cannot depend on op ", x);
    d.push_back(x);
  }
  std::sort(d.begin(), d.end());
  d.erase(std::unique(d.begin(), d.end()), d.end());
}

int ProgramBuilder::Attention(const Region& q, const Region& k, const Region& v, const Region& out,
                              const Region& lse, const std::string& label) {
  Op op;
  op.kind = OpKind::kAttention;
  op.stream = Stream::kCompute;
  op.src = q;
  op.key = k;
  op.value = v;
  op.dst = out;
  op.dst_lse = lse;
  op.flops = 4.0 * shape_.batch * q.heads * q.tokens * k.tokens * shape_.head_dim;
  op.label = label;
  return Add(std::move(op), {q, k, v}, {out, lse});
}

int ProgramBuilder::Merge(const Region& part, const Region& part_lse, const Region& acc,
                          const Region& acc_lse, const std::string& label) {
  Op op;
  op.kind = OpKind::kMerge;
  op.stream = Stream::kCompute;
  op.src = part;
  op.src_lse = part_lse;
  op.dst = acc;
  op.dst_lse = acc_lse;
  op.bytes = RegionBytesOf(part);
  op.label = label;
  return Add(std::move(op), {part, part_lse, acc, acc_lse}, {acc, acc_lse});
}

namespace {

// The fields every transfer op (Send, Recv, Put, Signal) sets.
Op TransferOp(OpKind kind, Stream stream, int group, int peer, LinkKind link,
              const std::string& label) {
  Op op;
  op.kind = kind;
  op.stream = stream;
  op.group = group;
  op.peer = peer;
  op.link = link;
  op.label = label;
  return op;
}

}  // namespace

int ProgramBuilder::Send(Stream stream, int group, int peer, LinkKind link, int64_t tag,
                         const Region& src, const std::string& label) {
  Op op = TransferOp(OpKind::kSend, stream, group, peer, link, label);
  op.tag = tag;
  op.src = src;
  op.bytes = RegionBytesOf(src);
  return Add(std::move(op), {src}, {});
}

int ProgramBuilder::Recv(Stream stream, int group, int peer, LinkKind link, int64_t tag,
                         const Region& dst, const std::string& label) {
  Op op = TransferOp(OpKind::kRecv, stream, group, peer, link, label);
  op.tag = tag;
  op.dst = dst;
  op.bytes = RegionBytesOf(dst);
  return Add(std::move(op), {}, {dst});
}

int ProgramBuilder::Put(Stream stream, int group, int peer, LinkKind link, const Region& src,
                        const Region& dst, const std::string& counter, int64_t value,
                        const std::string& label) {
  Op op = TransferOp(OpKind::kPut, stream, group, peer, link, label);
  op.src = src;
  op.dst = dst;
  op.counter = counter;
  op.count = value;
  op.bytes = RegionBytesOf(src);
  return Add(std::move(op), {src}, {});
}

int ProgramBuilder::Signal(Stream stream, int peer, LinkKind link, const std::string& counter,
                           int64_t value, const std::vector<Region>& releases,
                           const std::vector<int>& extra_deps, const std::string& label,
                           int group) {
  Op op = TransferOp(OpKind::kSignal, stream, group, peer, link, label);
  op.counter = counter;
  op.count = value;
  return Add(std::move(op), {}, releases, extra_deps);
}

int ProgramBuilder::Wait(Stream stream, const std::string& counter, int64_t value,
                         const std::vector<Region>& makes_valid, const std::string& label) {
  Op op;
  op.kind = OpKind::kWait;
  op.stream = stream;
  op.counter = counter;
  op.count = value;
  if (makes_valid.size() == 1) op.dst = makes_valid[0];
  op.label = label;
  return Add(std::move(op), {}, makes_valid);
}

}  // namespace ditscale::sp::internal
