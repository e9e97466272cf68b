// One sequence-parallel configuration as the Python API (ditscale.sp.Config) hands it to C++:
// its one text encoding, parsed into the named fields of SpFields, turned into an sp::SpConfig
// (the strategy name parsed into an sp::Strategy here: this is an edge, strategy.h). Shared by
// the bindings of ditscale._core (python/src/sp_bindings.cc, sp_schedule_bindings.cc: no torch),
// which also export the ranges below to Python, and the torch ops of the GPU runtime
// (sp_config_text.h: the same text with the experiment variant's entries). Header-only so that
// _core needs no torch sources.
//
// The text (ditscale/sp/config.py: config_text writes it): "key=value" entries joined by ';',
// each key once, e.g. "strategy=torus;transport=nccl;ulysses_degree=0;ring_degree=0;chunks=2;
// ulysses_chunks=1;comm_sms=0;topology=h200-local". Every key of kSpIntFields, strategy and
// transport required; topology optional (the planner's cluster model; any text without ';').
//
// Fields and ranges (ditscale.sp.Config reads them from _core.sp_config_fields(); out of range
// -> ditscale::Error "<field>: <value> is out of range [lo, hi]"):
//   strategy        one of sp::StrategyNames() ("auto" is resolved in Python, by the planner);
//                   else "strategy: 'x' is not one of ulysses, ulysses-overlap, ..."
//   transport       one of kTransportNames (sp::SetTransport)
//   ulysses_degree  [0, kMaxDegree], 0 = the strategy's default
//   ring_degree     [0, kMaxDegree], 0 = the strategy's default
//   chunks          [1, kMaxChunks]: torus token chunks (SpConfig::torus_chunks); 1 for ulysses
//   ulysses_chunks  [1, kMaxChunks]: ulysses head chunks (SpConfig::ulysses_chunks); 1 unless
//                   strategy is ulysses
//   comm_sms        [0, kMaxCommSms]: SMs kept for communication (SpConfig::comm_sms)
#pragma once

#include <charconv>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <system_error>

#include "ditscale/core/error.h"
#include "ditscale/core/range.h"
#include "ditscale/core/result.h"
#include "ditscale/sp/schedule.h"
#include "ditscale/sp/strategies.h"

namespace ditscale::torch_ext {

inline constexpr long long kMaxDegree = 65536;
inline constexpr long long kMaxChunks = 4096;
inline constexpr long long kMaxCommSms = 4096;
// nccl: Send/Recv everywhere; nvshmem: puts with signals on every link; nvshmem-intra: puts
// within machines, NCCL Send/Recv between them.
inline constexpr const char* kTransportNames[] = {"nccl", "nvshmem", "nvshmem-intra"};

struct SpFields {
  std::string strategy = "ulysses";
  std::string transport = "nccl";
  int64_t ulysses_degree = 0;
  int64_t ring_degree = 0;
  int64_t chunks = 1;
  int64_t ulysses_chunks = 1;
  int64_t comm_sms = 0;
  std::string topology;  // empty: not given
};

// The integer fields of a configuration and their ranges.
struct SpIntField {
  const char* name;
  int64_t SpFields::*member;
  long long lo, hi;
};
inline constexpr SpIntField kSpIntFields[] = {
    {"ulysses_degree", &SpFields::ulysses_degree, 0, kMaxDegree},
    {"ring_degree", &SpFields::ring_degree, 0, kMaxDegree},
    {"chunks", &SpFields::chunks, 1, kMaxChunks},
    {"ulysses_chunks", &SpFields::ulysses_chunks, 1, kMaxChunks},
    {"comm_sms", &SpFields::comm_sms, 0, kMaxCommSms},
};

// The strategy of a name; throws ditscale::Error "strategy: 'x' is not one of ...".
inline sp::Strategy StrategyOf(const std::string& name) {
  Result<sp::Strategy> s = sp::ParseStrategy(name);
  if (!s.ok()) throw Error("strategy: " + s.failure().message);
  return s.value();
}

// Whether `key` is a key of the text encoding.
inline bool IsSpKey(std::string_view key) {
  if (key == "strategy" || key == "transport" || key == "topology") return true;
  for (const SpIntField& field : kSpIntFields) {
    if (key == field.name) return true;
  }
  return false;
}

// The fields of the text encoding (see the top of this file); throws ditscale::Error "config:
// ..." naming the entry or key, or "<key>: '<v>' is not an integer". Ranges are SpConfigOf's.
// Keys that are not the encoding's go to `extra` when given (the torch ops' engine and signal),
// else are an error.
inline SpFields SpFieldsOfText(std::string_view text,
                               std::map<std::string, std::string>* extra = nullptr) {
  std::map<std::string, std::string, std::less<>> entries;
  for (std::size_t pos = 0; pos <= text.size();) {
    std::size_t end = text.find(';', pos);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view entry = text.substr(pos, end - pos);
    const std::size_t eq = entry.find('=');
    if (eq == std::string_view::npos) {
      throw Error("config: entry '" + std::string(entry) + "' is not key=value");
    }
    const std::string key(entry.substr(0, eq));
    if (!entries.emplace(key, std::string(entry.substr(eq + 1))).second) {
      throw Error("config: the key '" + key + "' is given twice");
    }
    pos = end + 1;
  }
  SpFields f;
  std::size_t known = 0;
  const auto take = [&](const char* key, bool required, std::string* out) {
    const auto it = entries.find(key);
    if (it == entries.end()) {
      if (required) throw Error(std::string("config: the key '") + key + "' is missing");
      return false;
    }
    *out = it->second;
    ++known;
    return true;
  };
  take("strategy", true, &f.strategy);
  take("transport", true, &f.transport);
  take("topology", false, &f.topology);
  for (const SpIntField& field : kSpIntFields) {
    std::string value;
    take(field.name, true, &value);
    int64_t v = 0;
    const char* last = value.data() + value.size();
    const auto r = std::from_chars(value.data(), last, v);
    if (value.empty() || r.ec != std::errc() || r.ptr != last) {
      throw Error(std::string(field.name) + ": '" + value + "' is not an integer");
    }
    f.*field.member = v;
  }
  if (known != entries.size()) {
    for (const auto& entry : entries) {
      if (IsSpKey(entry.first)) continue;
      if (extra == nullptr) throw Error("config: unknown key '" + entry.first + "'");
      extra->emplace(entry.first, entry.second);
    }
  }
  return f;
}

// The SpConfig the fields name; throws ditscale::Error naming the field.
inline sp::SpConfig SpConfigOf(const SpFields& f) {
  const sp::Strategy strategy = StrategyOf(f.strategy);
  for (const SpIntField& field : kSpIntFields) {
    CheckRange(field.name, static_cast<long long>(f.*field.member), field.lo, field.hi);
  }
  sp::SpConfig cfg;
  if (!sp::SetTransport(f.transport, &cfg)) {
    throw Error("transport: '" + f.transport + "' is not one of nccl, nvshmem, nvshmem-intra");
  }
  cfg.strategy = strategy;
  cfg.ulysses_degree = static_cast<int>(f.ulysses_degree);
  cfg.ring_degree = static_cast<int>(f.ring_degree);
  cfg.torus_chunks = static_cast<int>(f.chunks);
  cfg.ulysses_chunks = static_cast<int>(f.ulysses_chunks);
  if (f.ulysses_chunks > 1 && strategy != sp::Strategy::kUlysses) {
    throw Error("ulysses_chunks: " + std::to_string(f.ulysses_chunks) +
                " head chunks need strategy ulysses, not " + f.strategy);
  }
  if (f.chunks > 1 && strategy == sp::Strategy::kUlysses) {
    throw Error("chunks: ulysses cuts its head group, not tokens: ulysses_chunks, not chunks " +
                std::to_string(f.chunks));
  }
  cfg.comm_sms = static_cast<int>(f.comm_sms);
  return cfg;
}

}  // namespace ditscale::torch_ext
