// Schedule queries: names, region arithmetic, communication volumes, printing and JSON.
// Validation lives in schedule_validate.cc.
#include "ditscale/sp/schedule.h"

#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

namespace ditscale::sp {

const char* ToString(OpKind kind) {
  switch (kind) {
    case OpKind::kSend:
      return "Send";
    case OpKind::kRecv:
      return "Recv";
    case OpKind::kPut:
      return "Put";
    case OpKind::kSignal:
      return "Signal";
    case OpKind::kWait:
      return "Wait";
    case OpKind::kAttention:
      return "Attention";
    case OpKind::kMerge:
      return "Merge";
    case OpKind::kPack:
      return "Pack";
    case OpKind::kUnpack:
      return "Unpack";
    case OpKind::kCopy:
      return "Copy";
  }
  return "?";
}

const char* ToString(Stream stream) {
  switch (stream) {
    case Stream::kCompute:
      return "compute";
    case Stream::kCommIntra:
      return "comm-intra";
    case Stream::kCommInter:
      return "comm-inter";
  }
  return "?";
}

const char* ToString(LinkKind link) {
  switch (link) {
    case LinkKind::kNone:
      return "none";
    case LinkKind::kIntraMachine:
      return "intra";
    case LinkKind::kInterMachine:
      return "inter";
  }
  return "?";
}

const char* ToString(BufferRole role) {
  switch (role) {
    case BufferRole::kInput:
      return "input";
    case BufferRole::kOutput:
      return "output";
    case BufferRole::kWork:
      return "work";
    case BufferRole::kScratch:
      return "scratch";
    case BufferRole::kStaging:
      return "staging";
  }
  return "?";
}

int RankProgram::FindBuffer(const std::string& name) const {
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

int64_t RegionElements(const Region& r, const BufferDecl& decl, int64_t batch) {
  return batch * r.tokens * r.heads * decl.width;
}

int64_t RegionBytes(const Region& r, const BufferDecl& decl, int64_t batch) {
  return RegionElements(r, decl, batch) * decl.element_bytes;
}

bool RegionContiguous(const Region& r, const BufferDecl& decl, int64_t batch) {
  if (r.empty()) return true;
  const bool full_heads = r.heads == decl.heads;
  const bool full_tokens = r.tokens == decl.tokens;
  // Within one batch entry: a head sub-range is contiguous only for a single token.
  const bool per_batch_contiguous = full_heads || r.tokens == 1;
  if (!per_batch_contiguous) return false;
  return batch == 1 || (full_tokens && full_heads);
}

std::vector<RankCommVolume> CommVolumePerRank(const Schedule& schedule) {
  const int n = static_cast<int>(schedule.ranks.size());
  std::vector<RankCommVolume> vol(n);
  for (const RankProgram& prog : schedule.ranks) {
    RankCommVolume& me = vol[prog.rank];
    for (const Op& op : prog.ops) {
      const bool inter = op.link == LinkKind::kInterMachine;
      switch (op.kind) {
        case OpKind::kSend:
        case OpKind::kPut:
          (inter ? me.sent_inter_bytes : me.sent_intra_bytes) += op.bytes;
          (inter ? me.messages_inter : me.messages_intra) += 1;
          if (op.kind == OpKind::kPut && op.peer >= 0 && op.peer < n) {
            (inter ? vol[op.peer].recv_inter_bytes : vol[op.peer].recv_intra_bytes) += op.bytes;
          }
          break;
        case OpKind::kRecv:
          (inter ? me.recv_inter_bytes : me.recv_intra_bytes) += op.bytes;
          break;
        case OpKind::kSignal:
          (inter ? me.signals_inter : me.signals_intra) += 1;
          break;
        case OpKind::kPack:
        case OpKind::kUnpack:
        case OpKind::kCopy:
          me.local_copy_bytes += op.bytes;
          break;
        case OpKind::kAttention:
          me.attention_flops += op.flops;
          break;
        case OpKind::kWait:
        case OpKind::kMerge:
          break;
      }
    }
  }
  return vol;
}

namespace {

std::string RegionText(const RankProgram* prog, const Region& r) {
  if (!r.valid()) return "-";
  std::ostringstream os;
  if (prog != nullptr && r.buffer < static_cast<int>(prog->buffers.size())) {
    os << prog->buffers[r.buffer].name;
  } else {
    os << "#" << r.buffer;
  }
  os << "[t" << r.token_begin << ":" << r.token_begin + r.tokens << ",h" << r.head_begin << ":"
     << r.head_begin + r.heads << "]";
  return os.str();
}

std::string BytesText(int64_t bytes) {
  char buf[64];
  if (bytes >= (int64_t{1} << 20)) {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", bytes / 1048576.0);
  } else if (bytes >= 1024) {
    std::snprintf(buf, sizeof(buf), "%.2f KiB", bytes / 1024.0);
  } else {
    std::snprintf(buf, sizeof(buf), "%lld B", static_cast<long long>(bytes));
  }
  return buf;
}

const RankProgram* ProgramOf(const Schedule& s, int rank) {
  if (rank < 0 || rank >= static_cast<int>(s.ranks.size())) return nullptr;
  return &s.ranks[rank];
}

nlohmann::json RegionJson(const Region& r) {
  if (!r.valid()) return nullptr;
  return {{"buffer", r.buffer},
          {"token_begin", r.token_begin},
          {"tokens", r.tokens},
          {"head_begin", r.head_begin},
          {"heads", r.heads}};
}

}  // namespace

bool OneSidedOn(const SpConfig& c, LinkKind link) {
  return c.one_sided && (c.one_sided_inter || link != LinkKind::kInterMachine);
}

const char* TransportDescription(const SpConfig& c) {
  if (!c.one_sided) return "two-sided";
  return c.one_sided_inter ? "one-sided" : "one-sided intra / two-sided inter";
}

const char* TransportName(const SpConfig& c) {
  if (!c.one_sided) return "nccl";
  return c.one_sided_inter ? "nvshmem" : "nvshmem-intra";
}

bool SetTransport(const std::string& name, SpConfig* c) {
  if (name == "nccl") {
    c->one_sided = false;
    c->one_sided_inter = true;
  } else if (name == "nvshmem" || name == "nvshmem-intra") {
    c->one_sided = true;
    c->one_sided_inter = name == "nvshmem";
  } else {
    return false;
  }
  return true;
}

std::string PrintSchedule(const Schedule& s) {
  std::ostringstream os;
  const SpConfig& c = s.config;
  os << "schedule " << s.strategy << ": mesh " << s.mesh.machines << "x" << s.mesh.gpus_per_machine
     << ", ulysses " << c.ulysses_degree << ", ring " << c.ring_degree << ", torus_chunks "
     << c.torus_chunks << ", ulysses_chunks " << c.ulysses_chunks << ", "
     << TransportDescription(c);
  if (c.comm_sms > 0) os << ", " << c.comm_sms << " SMs kept for communication";
  os << "\n";
  os << "shape: batch " << s.shape.batch << ", seq " << s.shape.seq_tokens << ", text "
     << s.shape.text_tokens << ", heads " << s.shape.heads << " (kv " << s.shape.kv_heads_or_heads()
     << "), head_dim " << s.shape.head_dim << ", dtype_bytes " << s.shape.dtype_bytes << "\n";
  for (const std::string& note : s.notes) os << "note: " << note << "\n";
  const std::vector<RankCommVolume> vol = CommVolumePerRank(s);
  for (const RankProgram& prog : s.ranks) {
    const RankCommVolume& v = vol[prog.rank];
    os << "rank " << prog.rank << " (machine " << s.mesh.machine_of(prog.rank)
       << "): image tokens [" << prog.image_token_begin << ", "
       << prog.image_token_begin + prog.image_token_count << "), sent intra "
       << BytesText(v.sent_intra_bytes) << " inter " << BytesText(v.sent_inter_bytes)
       << ", recv intra " << BytesText(v.recv_intra_bytes) << " inter "
       << BytesText(v.recv_inter_bytes) << ", attention " << v.attention_flops / 1e6 << " MFLOP\n";
    for (size_t b = 0; b < prog.buffers.size(); ++b) {
      const BufferDecl& d = prog.buffers[b];
      os << "  buffer " << b << " " << d.name << " (" << ToString(d.role) << ") [" << s.shape.batch
         << "," << d.tokens << "," << d.heads << "," << d.width << "] x" << d.element_bytes
         << "B\n";
    }
    for (size_t i = 0; i < prog.ops.size(); ++i) {
      const Op& op = prog.ops[i];
      os << "  #" << i << " [" << ToString(op.stream);
      if (op.group >= 0) os << " g" << op.group;
      os << "] " << ToString(op.kind);
      if (op.peer >= 0) os << " peer " << op.peer << " (" << ToString(op.link) << ")";
      if (op.tag >= 0) os << " tag " << op.tag;
      if (!op.counter.empty()) os << " counter " << op.counter << " count " << op.count;
      if (op.src.valid()) os << " src " << RegionText(&prog, op.src);
      if (op.key.valid()) os << " k " << RegionText(&prog, op.key);
      if (op.value.valid()) os << " v " << RegionText(&prog, op.value);
      if (op.src_lse.valid()) os << " src_lse " << RegionText(&prog, op.src_lse);
      if (op.dst.valid()) {
        const RankProgram* owner = op.kind == OpKind::kPut ? ProgramOf(s, op.peer) : &prog;
        os << " dst " << RegionText(owner, op.dst);
      }
      if (op.dst_lse.valid()) os << " dst_lse " << RegionText(&prog, op.dst_lse);
      if (op.bytes > 0) os << " " << BytesText(op.bytes);
      if (op.flops > 0) os << " " << op.flops / 1e6 << " MFLOP";
      if (!op.deps.empty()) {
        os << " deps{";
        for (size_t d = 0; d < op.deps.size(); ++d) os << (d ? "," : "") << op.deps[d];
        os << "}";
      }
      if (!op.label.empty()) os << "  '" << op.label << "'";
      os << "\n";
    }
  }
  return os.str();
}

std::string ScheduleToJson(const Schedule& s, int indent) {
  nlohmann::json j;
  j["strategy"] = s.strategy;
  j["mesh"] = {{"machines", s.mesh.machines}, {"gpus_per_machine", s.mesh.gpus_per_machine}};
  j["config"] = {{"strategy", std::string(StrategyName(s.config.strategy))},
                 {"ulysses_degree", s.config.ulysses_degree},
                 {"ring_degree", s.config.ring_degree},
                 {"torus_chunks", s.config.torus_chunks},
                 {"ulysses_chunks", s.config.ulysses_chunks},
                 {"one_sided", s.config.one_sided},
                 {"one_sided_inter", s.config.one_sided_inter},
                 {"transport", TransportName(s.config)},
                 {"comm_sms", s.config.comm_sms},
                 {"placement", s.config.placement == Placement::kUlyssesOuter ? "ulysses-outer"
                                                                              : "ulysses-inner"}};
  j["shape"] = {{"batch", s.shape.batch},
                {"seq_tokens", s.shape.seq_tokens},
                {"text_tokens", s.shape.text_tokens},
                {"heads", s.shape.heads},
                {"kv_heads", s.shape.kv_heads_or_heads()},
                {"head_dim", s.shape.head_dim},
                {"dtype_bytes", s.shape.dtype_bytes}};
  j["head_group_begin"] = s.head_group_begin;
  j["head_group_size"] = s.head_group_size;
  j["notes"] = s.notes;
  const std::vector<RankCommVolume> vol = CommVolumePerRank(s);
  nlohmann::json ranks = nlohmann::json::array();
  for (const RankProgram& prog : s.ranks) {
    nlohmann::json r;
    r["rank"] = prog.rank;
    r["image_token_begin"] = prog.image_token_begin;
    r["image_token_count"] = prog.image_token_count;
    const RankCommVolume& v = vol[prog.rank];
    r["volume"] = {
        {"sent_intra_bytes", v.sent_intra_bytes}, {"sent_inter_bytes", v.sent_inter_bytes},
        {"recv_intra_bytes", v.recv_intra_bytes}, {"recv_inter_bytes", v.recv_inter_bytes},
        {"signals_intra", v.signals_intra},       {"signals_inter", v.signals_inter},
        {"local_copy_bytes", v.local_copy_bytes}, {"attention_flops", v.attention_flops}};
    nlohmann::json bufs = nlohmann::json::array();
    for (const BufferDecl& d : prog.buffers) {
      bufs.push_back({{"name", d.name},
                      {"role", ToString(d.role)},
                      {"tokens", d.tokens},
                      {"heads", d.heads},
                      {"width", d.width},
                      {"element_bytes", d.element_bytes}});
    }
    r["buffers"] = std::move(bufs);
    nlohmann::json ops = nlohmann::json::array();
    for (const Op& op : prog.ops) {
      nlohmann::json o = {{"kind", ToString(op.kind)}, {"stream", ToString(op.stream)},
                          {"deps", op.deps},           {"bytes", op.bytes},
                          {"flops", op.flops},         {"label", op.label}};
      if (op.group >= 0) o["group"] = op.group;
      if (op.peer >= 0) {
        o["peer"] = op.peer;
        o["link"] = ToString(op.link);
      }
      if (op.tag >= 0) o["tag"] = op.tag;
      if (!op.counter.empty()) {
        o["counter"] = op.counter;
        o["count"] = op.count;
      }
      const std::pair<const char*, const Region*> regions[] = {
          {"src", &op.src},         {"dst", &op.dst},
          {"key", &op.key},         {"value_region", &op.value},
          {"src_lse", &op.src_lse}, {"dst_lse", &op.dst_lse}};
      for (const auto& [name, reg] : regions) {
        if (reg->valid()) o[name] = RegionJson(*reg);
      }
      ops.push_back(std::move(o));
    }
    r["ops"] = std::move(ops);
    ranks.push_back(std::move(r));
  }
  j["ranks"] = std::move(ranks);
  return j.dump(indent);
}

std::vector<int64_t> WorkBytesPerRank(const Schedule& schedule) {
  std::vector<int64_t> out;
  for (const RankProgram& p : schedule.ranks) {
    int64_t bytes = 0;
    for (const BufferDecl& d : p.buffers) {
      if (d.role == BufferRole::kInput || d.role == BufferRole::kOutput) continue;
      bytes += d.elements(schedule.shape.batch) * d.element_bytes;
    }
    out.push_back(bytes);
  }
  return out;
}

}  // namespace ditscale::sp
