// The torch ops' configuration dict (sp_config_dict.h).
#include <c10/util/Exception.h>

#include <charconv>
#include <set>
#include <sstream>

#include "ditscale/core/error.h"
#include "ditscale/core/range.h"
#include "ditscale/torch/sp_args.h"
#include "ditscale/torch/sp_config_dict.h"

namespace ditscale::torch_ext {
namespace {

const std::set<std::string>& Keys() {
  static const std::set<std::string> keys = {"strategy",    "transport", "ulysses_degree",
                                             "ring_degree", "chunks",    "ulysses_chunks",
                                             "comm_sms",    "engine",    "signal"};
  return keys;
}

int64_t IntField(const SpConfigDict& f, const char* key, const char* who) {
  const std::string text = f.at(key);
  int64_t v = 0;
  const char* end = text.data() + text.size();
  const auto r = std::from_chars(text.data(), end, v);
  TORCH_CHECK(!text.empty() && r.ec == std::errc() && r.ptr == end, who, ": ", key, ": '", text,
              "' is not an integer");
  return v;
}

runtime::OneSidedEngine EngineOf(const std::string& name, const char* who) {
  if (name == "auto") return runtime::OneSidedEngine::kAuto;
  if (name == "copy-engine") return runtime::OneSidedEngine::kCopyEngine;
  if (name == "nvshmem") return runtime::OneSidedEngine::kNvshmem;
  TORCH_CHECK(false, who, ": engine: '", name, "' is not one of auto, copy-engine, nvshmem");
}

}  // namespace

std::string SpRunArgs::LayerKey() const {
  std::ostringstream os;
  os << sp::StrategyName(config.strategy) << " u" << config.ulysses_degree << " r"
     << config.ring_degree << " c" << config.torus_chunks << " h" << config.ulysses_chunks << " "
     << sp::TransportName(config);
  return os.str();
}

std::string SpRunArgs::Key() const {
  std::ostringstream os;
  os << LayerKey() << " sms" << config.comm_sms << " " << runtime::ToString(engine)
     << (signal_by_copy ? " signal-copy" : " signal-write");
  return os.str();
}

SpRunArgs RunArgsOf(const SpConfigDict& f, const char* who) {
  for (const auto& item : f) {
    TORCH_CHECK(Keys().count(item.key()), who, ": unknown configuration key '", item.key(), "'");
  }
  for (const std::string& k : Keys()) {
    TORCH_CHECK(f.contains(k), who, ": the configuration misses the key '", k, "'");
  }
  SpFields fields;
  fields.strategy = f.at("strategy");
  fields.transport = f.at("transport");
  fields.ulysses_degree = IntField(f, "ulysses_degree", who);
  fields.ring_degree = IntField(f, "ring_degree", who);
  fields.chunks = IntField(f, "chunks", who);
  fields.ulysses_chunks = IntField(f, "ulysses_chunks", who);
  fields.comm_sms = IntField(f, "comm_sms", who);
  SpRunArgs a;
  try {
    a.config = SpConfigOf(fields);
  } catch (const Error& e) {
    TORCH_CHECK(false, who, ": ", e.what());
  }
  a.engine = EngineOf(f.at("engine"), who);
  const std::string signal = f.at("signal");
  TORCH_CHECK(signal == "write" || signal == "copy", who, ": signal: '", signal,
              "' is not one of write, copy");
  a.signal_by_copy = signal == "copy";
  return a;
}

void CheckIntArg(const char* who, const char* name, int64_t v, int64_t lo, int64_t hi) {
  const auto e = RangeError(name, static_cast<long long>(v), static_cast<long long>(lo),
                            static_cast<long long>(hi));
  TORCH_CHECK(!e.has_value(), who, ": ", e.value_or(""));
}

void CheckMesh(const char* who, int64_t machines, int64_t gpus_per_machine) {
  CheckIntArg(who, "machines", machines, 1, 65536);
  CheckIntArg(who, "gpus_per_machine", gpus_per_machine, 1, 65536);
}

}  // namespace ditscale::torch_ext
