// Transfers: staging decisions, and the ops each side of a phase's transfers runs.
//
// Two-sided: per link stream one group holding the rank's Sends and Recvs of the phase
// (ncclGroupStart/End), Packs before it on the same stream, Unpacks where the data is consumed.
// One-sided: Packs, then per link stream one group of puts-with-signal into the peer's buffer
// (phase counter += 1 each); the receiver Waits for the phase counter only where it consumes.
// The choice is per link (SpConfig::one_sided_inter): a phase may mix both forms, the Wait then
// counts only the transfers that arrive by put.
#include <algorithm>
#include <map>

#include "ditscale/sp/internal/hybrid.h"

namespace ditscale::sp::internal {

Transfer HybridBuilder::MakeTransfer(const std::string& phase, const std::string& tensor,
                                     int src_rank, const Region& src, int dst_rank,
                                     const Region& dst) {
  Transfer t;
  t.src_rank = src_rank;
  t.dst_rank = dst_rank;
  t.src = src;
  t.dst = dst;
  t.tag = next_tag_++;
  t.label = phase + " " + tensor + " " + std::to_string(src_rank) + "->" + std::to_string(dst_rank);
  ProgramBuilder& sb = b_[src_rank];
  ProgramBuilder& db = b_[dst_rank];
  t.send_from = src;
  if (!sb.Contiguous(src)) {
    const BufferDecl& d = sb.decl(src.buffer);
    const int buf = sb.AddBuffer("stage." + phase + "." + tensor + ".to" + std::to_string(dst_rank),
                                 BufferRole::kStaging, BufferInit::kUndefined, src.tokens,
                                 src.heads, d.width, d.element_bytes);
    t.send_from = sb.Whole(buf);
  }
  t.land = dst;
  if (!db.Contiguous(dst)) {
    const BufferDecl& d = db.decl(dst.buffer);
    const int buf = db.AddBuffer(
        "stage." + phase + "." + tensor + ".from" + std::to_string(src_rank), BufferRole::kStaging,
        BufferInit::kUndefined, dst.tokens, dst.heads, d.width, d.element_bytes);
    t.land = db.Whole(buf);
  }
  return t;
}

std::vector<int> HybridBuilder::Issue(const Phase& phase, int r, bool packs, bool transfers) {
  ProgramBuilder& b = b_[r];
  std::vector<const Transfer*> out, in;
  for (const Transfer& t : phase.transfers) {
    if (t.src_rank == r) out.push_back(&t);
    if (t.dst_rank == r) in.push_back(&t);
  }
  std::vector<int> pack_ops;
  if (out.empty() && in.empty()) return pack_ops;
  for (const Transfer* t : out) {
    if (packs && t->send_from.buffer != t->src.buffer) {
      pack_ops.push_back(b.Copy(OpKind::kPack, StreamOf(LinkOf(r, t->dst_rank)), t->src,
                                t->send_from, "pack " + t->label));
    }
  }
  if (!transfers) return pack_ops;
  for (LinkKind link : {LinkKind::kIntraMachine, LinkKind::kInterMachine}) {
    const Stream st = StreamOf(link);
    if (OneSidedOn(cfg_, link)) {
      int64_t free_wait = 0;
      for (const Transfer* t : out) {
        if (LinkOf(r, t->dst_rank) == link) free_wait = std::max(free_wait, t->free_wait);
      }
      if (free_wait > 0) b.Wait(st, "ring.free", free_wait, {}, phase.name + " wait buffer free");
      int group = -1;
      for (const Transfer* t : out) {
        if (LinkOf(r, t->dst_rank) != link) continue;
        if (group < 0) group = b.NewGroup();
        b.Put(st, group, t->dst_rank, link, t->send_from, t->land, phase.name, 1,
              "put " + t->label);
      }
    } else {
      int group = -1;
      for (const Transfer* t : out) {
        if (LinkOf(r, t->dst_rank) != link) continue;
        if (group < 0) group = b.NewGroup();
        b.Send(st, group, t->dst_rank, link, t->tag, t->send_from, "send " + t->label);
      }
      for (const Transfer* t : in) {
        if (LinkOf(r, t->src_rank) != link) continue;
        if (group < 0) group = b.NewGroup();
        b.Recv(st, group, t->src_rank, link, t->tag, t->land, "recv " + t->label);
      }
    }
  }
  return pack_ops;
}

void HybridBuilder::Consume(const Phase& phase, int r, bool on_link_stream) {
  Stream st = Stream::kCompute;
  for (const Transfer& t : phase.transfers) {
    if (t.dst_rank == r && on_link_stream) {
      st = StreamOf(LinkOf(t.src_rank, r));
      break;
    }
  }
  Consume(phase, r, st);
}

void HybridBuilder::Consume(const Phase& phase, int r, Stream st) {
  ProgramBuilder& b = b_[r];
  std::vector<const Transfer*> in;
  for (const Transfer& t : phase.transfers) {
    if (t.dst_rank == r) in.push_back(&t);
  }
  if (in.empty()) return;
  // The phase counter counts put arrivals only; a Recv has completed the data of its transfer
  // (the local deps on the landing region order the consumers after it).
  std::vector<Region> landed;
  for (const Transfer* t : in) {
    if (OneSidedBetween(t->src_rank, r)) landed.push_back(t->land);
  }
  if (!landed.empty()) {
    b.Wait(st, phase.name, static_cast<int64_t>(landed.size()), landed, phase.name + " arrived");
  }
  for (const Transfer* t : in) {
    if (t->land.buffer != t->dst.buffer) {
      b.Copy(OpKind::kUnpack, st, t->land, t->dst, "unpack " + t->label);
    }
  }
}

}  // namespace ditscale::sp::internal
