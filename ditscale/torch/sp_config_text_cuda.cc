// The torch ops' configuration text (sp_config_text.h).
#include <c10/util/Exception.h>

#include <map>
#include <sstream>
#include <string>

#include "ditscale/core/error.h"
#include "ditscale/core/range.h"
#include "ditscale/torch/sp_args.h"
#include "ditscale/torch/sp_config_text.h"

namespace ditscale::torch_ext {
namespace {

runtime::OneSidedEngine EngineOf(const std::string& name, const char* who) {
  if (name == "auto") return runtime::OneSidedEngine::kAuto;
  if (name == "copy-engine") return runtime::OneSidedEngine::kCopyEngine;
  if (name == "nvshmem") return runtime::OneSidedEngine::kNvshmem;
  TORCH_CHECK(false, who, ": engine: '", name, "' is not one of auto, copy-engine, nvshmem");
}

std::string Required(const std::map<std::string, std::string>& extra, const char* key,
                     const char* who) {
  const auto it = extra.find(key);
  TORCH_CHECK(it != extra.end(), who, ": config: the key '", key, "' is missing");
  return it->second;
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

SpRunArgs RunArgsOf(const SpConfigText& text, const char* who) {
  std::map<std::string, std::string> extra;
  SpRunArgs a;
  try {
    a.config = SpConfigOf(SpFieldsOfText(text, &extra));
  } catch (const Error& e) {
    TORCH_CHECK(false, who, ": ", e.what());
  }
  for (const auto& [key, value] : extra) {
    TORCH_CHECK(key == "engine" || key == "signal", who, ": config: unknown key '", key, "'");
  }
  a.engine = EngineOf(Required(extra, "engine", who), who);
  const std::string signal = Required(extra, "signal", who);
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
