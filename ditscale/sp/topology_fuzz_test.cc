// Bounded fuzz test of the topology reader (fixed seed, a few hundred ms): mutated valid
// topology JSONs and hostile numbers each end in a Result failure or in a topology that
// Validate() accepts and the simulator runs to a finite layer time: never a crash, a signal or
// an exception.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "ditscale/sp/simulator.h"
#include "ditscale/sp/strategies.h"
#include "ditscale/sp/topology.h"

namespace ditscale::sp {
namespace {

const char* const kValid[] = {
    R"({"base": "p4de", "name": "a", "nic_bandwidth_GBps": 10, "nics_per_machine": 2})",
    R"({"base": "h200-local", "nic_duplex_GBps": 3.5, "inter_compute_interference": 0.2,
        "attention_slots": 132, "attention_tile_tokens": 128, "gpu_sms": 132,
        "sm_partition_step": 8, "comm_sm_GBps": 11, "attention_holds_sms": true})",
    R"({"name": "full", "gpus_per_machine": 4, "intra_bandwidth_GBps": 100,
        "intra_latency_us": 1, "nic_bandwidth_GBps": 10, "inter_latency_us": 10,
        "attention_tflops": 100, "attention_half_tokens": 0, "linear_tflops": 100,
        "hbm_bandwidth_GBps": 1000, "launch_overhead_us": 0, "two_sided_sync_us": 0,
        "two_sided_sm_fraction": 0, "one_sided_overhead_us": 0})",
};

const char* const kHostileNumbers[] = {"0",
                                       "-0",
                                       "-1",
                                       "1e400",
                                       "-1e400",
                                       "1e-400",
                                       "1e308",
                                       "4.9e-324",
                                       "1e-9",
                                       "0.999",
                                       "0.99",
                                       "2147483648",
                                       "-2147483649",
                                       "9223372036854775808",
                                       "18446744073709551616",
                                       "1.5",
                                       "65537",
                                       "1e6",
                                       "100001",
                                       "\"5\"",
                                       "null",
                                       "true",
                                       "[]",
                                       "{}",
                                       "NaN",
                                       "Infinity"};

const char* const kKeys[] = {"gpus_per_machine",
                             "intra_bandwidth_GBps",
                             "intra_latency_us",
                             "nic_bandwidth_GBps",
                             "nics_per_machine",
                             "nic_duplex_GBps",
                             "inter_latency_us",
                             "attention_tflops",
                             "attention_half_tokens",
                             "attention_slots",
                             "attention_tile_tokens",
                             "linear_tflops",
                             "hbm_bandwidth_GBps",
                             "launch_overhead_us",
                             "two_sided_sync_us",
                             "two_sided_sm_fraction",
                             "one_sided_overhead_us",
                             "inter_compute_interference",
                             "gpu_sms",
                             "sm_partition_step",
                             "comm_sm_GBps",
                             "attention_holds_sms",
                             "base",
                             "name"};

std::string Mutate(std::string s, std::mt19937& rng) {
  auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  switch (pick(5)) {
    case 0: {  // set a key to a hostile value (appended: a duplicate key when present)
      std::string kv = std::string("\"") + kKeys[pick(std::size(kKeys))] +
                       "\": " + kHostileNumbers[pick(std::size(kHostileNumbers))];
      const size_t close = s.rfind('}');
      return s.substr(0, close) + ", " + kv + "}";
    }
    case 1:  // flip a byte
      if (!s.empty()) s[pick(s.size())] = static_cast<char>(pick(256));
      return s;
    case 2:  // drop a range
      if (s.size() > 2) {
        const size_t a = pick(s.size()), n = pick(8) + 1;
        s.erase(a, n);
      }
      return s;
    case 3: {  // replace a number of the document by a hostile one
      std::vector<size_t> starts;
      for (size_t i = 1; i < s.size(); ++i) {
        if ((std::isdigit(static_cast<unsigned char>(s[i])) != 0) && s[i - 1] == ' ') {
          starts.push_back(i);
        }
      }
      if (starts.empty()) return s;
      const size_t a = starts[pick(starts.size())];
      size_t e = a;
      while (e < s.size() && (std::isdigit(static_cast<unsigned char>(s[e])) || s[e] == '.')) ++e;
      return s.substr(0, a) + kHostileNumbers[pick(std::size(kHostileNumbers))] + s.substr(e);
    }
    default:  // truncate
      return s.substr(0, pick(s.size() + 1));
  }
}

TEST(TopologyFuzz, MutatedJsonEndsInFailureOrAUsableTopology) {
  std::mt19937 rng(20240613);
  AttentionShape shape;
  shape.seq_tokens = 256;
  shape.text_tokens = 8;
  shape.heads = 4;
  shape.head_dim = 16;
  const auto start = std::chrono::steady_clock::now();
  int ok = 0, failed = 0;
  for (int iter = 0; iter < 1500; ++iter) {
    std::string text = kValid[iter % std::size(kValid)];
    const int mutations = iter % 4 == 3 ? 2 : 1;
    for (int m = 0; m < mutations; ++m) text = Mutate(text, rng);
    const int machines = 1 + iter % 3;
    const int gpus = (iter % 4) == 0 ? 0 : 1 + iter % 2;  // 0: the file's
    try {
      Result<Topology> t = ParseTopologyJson(text, "fuzz.json", machines, gpus);
      if (!t.ok()) {
        ++failed;
        EXPECT_NE(t.failure().ToString().find("fuzz.json"), std::string::npos)
            << text << "\n"
            << t.failure().ToString();
        continue;
      }
      ++ok;
      ASSERT_TRUE(t->Validate().ok()) << text;
      if (t->world_size() > 16) continue;  // keep the simulation small
      SpConfig cfg;
      cfg.strategy = t->machines > 1 ? Strategy::kTorus : Strategy::kRing;
      cfg.ulysses_degree = t->machines > 1 ? t->machines : 0;
      cfg.one_sided = iter % 2 == 0;
      Result<Schedule> s = BuildSchedule(SpMesh{t->machines, t->gpus_per_machine}, cfg, shape);
      ASSERT_TRUE(s.ok()) << text << "\n" << s.failure().ToString();
      Result<SimResult> r = Simulate(*s, *t);
      ASSERT_TRUE(r.ok()) << text << "\n" << r.failure().ToString();
      EXPECT_TRUE(std::isfinite(r->layer_s) && r->layer_s > 0) << text;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "exception " << e.what() << " for\n" << text;
    }
  }
  EXPECT_GT(ok, 30);
  EXPECT_GT(failed, 100);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(s, 10.0);  // ~0.3 s; a loose bound for a loaded CI machine
}

}  // namespace
}  // namespace ditscale::sp
