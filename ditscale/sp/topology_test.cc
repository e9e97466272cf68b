#include "ditscale/sp/topology.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <random>

namespace ditscale::sp {
namespace {

TEST(Topology, PresetsHaveDocumentedConstants) {
  Topology p = MakePresetTopology("p4de", 2).value();
  EXPECT_EQ(p.machines, 2);
  EXPECT_EQ(p.gpus_per_machine, 8);
  EXPECT_EQ(p.world_size(), 16);
  EXPECT_DOUBLE_EQ(p.nic_bandwidth_Bps, 42.5e9);
  EXPECT_DOUBLE_EQ(p.intra_bandwidth_Bps, 240e9);
  EXPECT_DOUBLE_EQ(p.attention_flops, 200e12);
  Topology h = MakePresetTopology("h100-8x", 4, 4).value();
  EXPECT_EQ(h.world_size(), 16);
  EXPECT_DOUBLE_EQ(h.nic_bandwidth_Bps, 320e9);
  Topology l = MakePresetTopology("h200-local", 2).value();
  EXPECT_DOUBLE_EQ(l.intra_bandwidth_Bps, 263.0 * 1073741824.0);
  EXPECT_DOUBLE_EQ(l.nic_bandwidth_Bps, 1.8 * 1073741824.0);
  EXPECT_DOUBLE_EQ(l.attention_flops, 650e12);
  for (const auto& n : PresetNames()) EXPECT_TRUE(MakePresetTopology(n, 1).value().Validate().ok());
}

TEST(Topology, UnknownPresetAndBadMachines) {
  auto r = MakePresetTopology("dgx-z", 2);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.failure().ToString().find("p4de"), std::string::npos);
  EXPECT_FALSE(MakePresetTopology("p4de", 0).ok());
}

TEST(Topology, RankPlacement) {
  Topology t = MakePresetTopology("p4de", 3, 4).value();
  EXPECT_EQ(t.MachineOf(0), 0);
  EXPECT_EQ(t.MachineOf(3), 0);
  EXPECT_EQ(t.MachineOf(4), 1);
  EXPECT_EQ(t.MachineOf(11), 2);
  EXPECT_TRUE(t.SameMachine(4, 7));
  EXPECT_FALSE(t.SameMachine(3, 4));
}

TEST(Topology, CostFormulas) {
  Topology t = MakePresetTopology("p4de", 2).value();
  EXPECT_DOUBLE_EQ(t.BlockEfficiency(128), 0.5);
  EXPECT_DOUBLE_EQ(t.BlockEfficiency(384), 0.75);
  EXPECT_DOUBLE_EQ(t.BlockEfficiency(0), 0.0);
  // 1e12 flops, q=kv=384 tokens: 5us + 1e12 / (200e12 * 0.5625).
  EXPECT_NEAR(t.AttentionSeconds(1e12, 384, 384), 5e-6 + 1e12 / (200e12 * 0.5625), 1e-15);
  EXPECT_NEAR(t.MemorySeconds(1.6e12), 5e-6 + 1.0, 1e-12);
  EXPECT_NEAR(t.LinearSeconds(250e12), 1.0, 1e-12);
  EXPECT_NEAR(t.TransferSeconds(240e9, 0, 1), 5e-6 + 1.0, 1e-12);
  EXPECT_NEAR(t.TransferSeconds(42.5e9, 0, 8), 20e-6 + 1.0, 1e-12);
  // Efficiency grows with block size, for random sizes.
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<double> d(1, 1e6);
  for (int i = 0; i < 100; ++i) {
    double a = d(rng), b = d(rng);
    if (a > b) std::swap(a, b);
    EXPECT_LE(t.BlockEfficiency(a), t.BlockEfficiency(b));
    EXPECT_LT(t.BlockEfficiency(b), 1.0);
  }
}

// The wave model: whole waves cost their work, a partial last wave a full one.
TEST(Topology, AttentionWaves) {
  Topology t = MakePresetTopology("h200-local", 1).value();
  ASSERT_EQ(t.attention_slots, 132);
  ASSERT_EQ(t.attention_tile_tokens, 128);
  // 12 heads x 11 tiles = 132 CTAs: exactly one wave per 1408 rows.
  EXPECT_DOUBLE_EQ(t.WaveFactor(1408, 12), 1.0);
  EXPECT_DOUBLE_EQ(t.WaveFactor(24 * 1408, 12), 1.0);
  // One row more starts a 25th wave of 12 CTAs.
  const double w = (24 * 132 + 12) / 132.0;
  EXPECT_NEAR(t.WaveFactor(24 * 1408 + 1, 12), 25 / w, 1e-12);
  // The measured case: 66,048 rows in one call (46.9 waves -> 47) vs two equal halves (23.45
  // waves each -> 24 + 24) vs whole-wave halves (24 + 23): the model orders them as measured.
  const double flops_row = 4.0 * 12 * 66048 * 128;  // per query row, kv 66,048, 12 heads
  auto call = [&](double rows) { return t.AttentionSeconds(flops_row * rows, rows, 66048, 12); };
  const double one = call(66048), halves = 2 * call(33024), whole = call(33792) + call(32256);
  EXPECT_GT(halves, whole * 1.015);
  EXPECT_NEAR(whole / one, 1.0, 0.003);  // 47 waves either way
  // Without batch x heads (or with no slots) there is no wave model.
  EXPECT_DOUBLE_EQ(t.WaveFactor(33024, 0), 1.0);
  t.attention_slots = 0;
  EXPECT_DOUBLE_EQ(t.WaveFactor(33024, 12), 1.0);
  // Random sizes: the factor is in [1, 2) once there is at least one full wave, and exactly the
  // ceiling's ratio.
  t.attention_slots = 132;
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> rows(1, 200000), heads(1, 64);
  for (int i = 0; i < 200; ++i) {
    const int q = rows(rng), bh = heads(rng);
    const double tiles = bh * std::ceil(q / 128.0), waves = tiles / 132;
    const double f = t.WaveFactor(q, bh);
    EXPECT_NEAR(f, std::ceil(waves - 1e-9) / waves, 1e-12) << q << " rows, " << bh << " heads";
    EXPECT_GE(f, 1.0);
    if (waves >= 1) EXPECT_LT(f, 2.0);
  }
  // JSON: both keys parse, and bad values name the field.
  auto r = ParseTopologyJson(R"({"base": "p4de", "attention_slots": 108,
                                 "attention_tile_tokens": 64})",
                             "w.json", 1);
  ASSERT_TRUE(r.ok()) << r.failure().ToString();
  EXPECT_EQ(r->attention_slots, 108);
  EXPECT_EQ(r->attention_tile_tokens, 64);
  for (const char* bad : {R"({"base": "p4de", "attention_slots": -1})",
                          R"({"base": "p4de", "attention_tile_tokens": 0})",
                          R"({"base": "p4de", "attention_slots": 1.5})"}) {
    auto e = ParseTopologyJson(bad, "w.json", 1);
    ASSERT_FALSE(e.ok()) << bad;
    EXPECT_NE(e.failure().ToString().find("attention_"), std::string::npos)
        << e.failure().ToString();
  }
}

TEST(Topology, JsonWithBaseOverridesFields) {
  auto r = ParseTopologyJson(R"({"base": "p4de", "name": "slow-efa", "nic_bandwidth_GBps": 10,
                                 "two_sided_sm_fraction": 0.2})",
                             "c.json", 4);
  ASSERT_TRUE(r.ok()) << r.failure().ToString();
  EXPECT_EQ(r->name, "slow-efa");
  EXPECT_EQ(r->machines, 4);
  EXPECT_DOUBLE_EQ(r->nic_bandwidth_Bps, 10e9);
  EXPECT_DOUBLE_EQ(r->intra_bandwidth_Bps, 240e9);
  EXPECT_DOUBLE_EQ(r->two_sided_sm_fraction, 0.2);
}

TEST(Topology, JsonErrorsNameFileAndField) {
  auto expect_fail = [](const std::string& text, const std::string& needle) {
    auto r = ParseTopologyJson(text, "my.json", 2);
    ASSERT_FALSE(r.ok()) << text;
    std::string msg = r.failure().ToString();
    EXPECT_NE(msg.find("my.json"), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  };
  expect_fail(R"({"base": "p4de", "nic_bandwidth_GBps": -1})", "'nic_bandwidth_GBps'");
  expect_fail(R"({"base": "p4de", "nic_bandwith_GBps": 1})", "'nic_bandwith_GBps': unknown");
  expect_fail(R"({"base": "p4de", "intra_latency_us": "5"})",
              "'intra_latency_us': must be a number");
  expect_fail(R"({"base": "nope"})", "'base'");
  expect_fail(R"({"base": "p4de", "gpus_per_machine": 2.5})", "'gpus_per_machine'");
  expect_fail(R"({"base": "p4de", "two_sided_sm_fraction": 1})", "'two_sided_sm_fraction'");
  expect_fail(R"({"base": "p4de", "inter_compute_interference": 1})",
              "'inter_compute_interference': 1 is out of range [0, 0.99]");
  expect_fail(R"({"base": "p4de", "inter_compute_interference": -0.1})",
              "'inter_compute_interference'");
  expect_fail(R"({"base": "p4de", "inter_compute_interference": "half"})",
              "'inter_compute_interference': must be a number");
  expect_fail(R"({"gpus_per_machine": 8})", "missing");
  expect_fail("[1, 2]", "object");
  auto r = ParseTopologyJson("{\n  \"base\": \"p4de\",\n  oops\n}", "my.json", 2);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.failure().line, 3) << r.failure().ToString();
}

TEST(Topology, NicsPerMachine) {
  Topology t = MakePresetTopology("p4de", 2).value();
  EXPECT_EQ(t.nics_per_machine, 1);  // one shared NIC: every GPU of a machine uses NIC m
  EXPECT_EQ(t.NicOf(0), 0);
  EXPECT_EQ(t.NicOf(7), 0);
  EXPECT_EQ(t.NicOf(8), 1);
  t.nics_per_machine = 4;  // p4de's 4 EFA devices: GPUs 0-1 -> NIC 0, ..., 6-7 -> NIC 3
  EXPECT_EQ(t.NicOf(1), 0);
  EXPECT_EQ(t.NicOf(2), 1);
  EXPECT_EQ(t.NicOf(15), 7);
  t.nics_per_machine = 0;  // one per GPU
  EXPECT_EQ(t.Nics(), 8);
  EXPECT_EQ(t.NicOf(13), 13);
  t.nics_per_machine = 9;
  auto v = t.Validate();
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.failure().ToString().find("nics_per_machine"), std::string::npos);
  // The emulated-machine preset: one per GPU.
  EXPECT_EQ(MakePresetTopology("h200-local", 2).value().nics_per_machine, 0);
  // JSON: optional, an integer >= 0.
  auto j = ParseTopologyJson(R"({"base": "p4de", "nics_per_machine": 4})", "c.json", 2);
  ASSERT_TRUE(j.ok()) << j.failure().ToString();
  EXPECT_EQ(j.value().nics_per_machine, 4);
  auto dj = ParseTopologyJson(R"({"base": "h200-local", "nic_duplex_GBps": 3.5})", "c.json", 2);
  ASSERT_TRUE(dj.ok()) << dj.failure().ToString();
  EXPECT_DOUBLE_EQ(dj.value().nic_duplex_Bps, 3.5e9);
  EXPECT_DOUBLE_EQ(MakePresetTopology("p4de", 2).value().nic_duplex_Bps, 0);  // full duplex
  // inter_compute_interference: optional (0 without base), set in the emulated-machine preset.
  auto ij =
      ParseTopologyJson(R"({"base": "p4de", "inter_compute_interference": 0.3})", "c.json", 2);
  ASSERT_TRUE(ij.ok()) << ij.failure().ToString();
  EXPECT_DOUBLE_EQ(ij.value().inter_compute_interference, 0.3);
  EXPECT_DOUBLE_EQ(MakePresetTopology("p4de", 2).value().inter_compute_interference, 0);
  EXPECT_GT(MakePresetTopology("h200-local", 2).value().inter_compute_interference, 0);
  // attention_holds_sms: a JSON bool; on in the Hopper presets.
  EXPECT_TRUE(MakePresetTopology("h200-local", 2).value().attention_holds_sms);
  EXPECT_TRUE(MakePresetTopology("h100-8x", 2).value().attention_holds_sms);
  EXPECT_FALSE(MakePresetTopology("p4de", 2).value().attention_holds_sms);
  auto hj =
      ParseTopologyJson(R"({"base": "h200-local", "attention_holds_sms": false})", "c.json", 2);
  ASSERT_TRUE(hj.ok()) << hj.failure().ToString();
  EXPECT_FALSE(hj.value().attention_holds_sms);
  auto hb = ParseTopologyJson(R"({"base": "p4de", "attention_holds_sms": 1})", "c.json", 2);
  ASSERT_FALSE(hb.ok());
  EXPECT_NE(hb.failure().ToString().find("'attention_holds_sms': must be true or false"),
            std::string::npos)
      << hb.failure().ToString();
  for (const char* bad :
       {R"({"base": "p4de", "nic_duplex_GBps": -1})", R"({"base": "p4de", "nics_per_machine": -1})",
        R"({"base": "p4de", "nics_per_machine": 1.5})",
        R"({"base": "p4de", "nics_per_machine": 12})"}) {
    auto e = ParseTopologyJson(bad, "c.json", 2);
    ASSERT_FALSE(e.ok()) << bad;
    EXPECT_NE(e.failure().ToString().find("nic"), std::string::npos) << bad;
    EXPECT_NE(e.failure().ToString().find("c.json"), std::string::npos) << bad;
  }
}

TEST(Topology, LoadFromFileAndPreset) {
  std::string path =
      ::testing::TempDir() + "topo_" + std::to_string(std::random_device{}()) + ".json";
  {
    std::ofstream f(path);
    f << R"({"name": "full", "gpus_per_machine": 4, "intra_bandwidth_GBps": 100,
             "intra_latency_us": 1, "nic_bandwidth_GBps": 10, "inter_latency_us": 10,
             "attention_tflops": 100, "attention_half_tokens": 0, "linear_tflops": 100,
             "hbm_bandwidth_GBps": 1000, "launch_overhead_us": 0, "two_sided_sync_us": 0,
             "two_sided_sm_fraction": 0, "one_sided_overhead_us": 0})";
  }
  auto r = LoadTopology(path, 3);
  ASSERT_TRUE(r.ok()) << r.failure().ToString();
  EXPECT_EQ(r->world_size(), 12);
  EXPECT_DOUBLE_EQ(r->BlockEfficiency(1), 1.0);
  std::remove(path.c_str());
  EXPECT_TRUE(LoadTopology("p4de", 2).ok());
  auto missing = LoadTopology("/nonexistent/x.json", 2);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.failure().ToString().find("/nonexistent/x.json"), std::string::npos);
}

// SM partitions: the compute partition is the largest multiple of the step that leaves at least
// comm_sms SMs; the presets measured on Hopper describe them, p4de (no copy rate) does not; the
// JSON keys parse and bad values name their field.
TEST(Topology, SmPartitions) {
  Topology h = MakePresetTopology("h200-local", 2).value();
  EXPECT_TRUE(h.SmPartitions());
  EXPECT_EQ(h.ComputeSms(0).value(), 132);
  EXPECT_EQ(h.ComputeSms(4).value(), 128);
  EXPECT_EQ(h.ComputeSms(5).value(), 120);
  EXPECT_EQ(h.ComputeSms(12).value(), 120);
  EXPECT_EQ(h.SmallestCommSms(), 4);
  EXPECT_FALSE(h.ComputeSms(127).ok());  // 5 SMs: no partition of 8
  EXPECT_EQ(h.ComputeSms(-1).failure().column, "comm_sms");
  Topology p = MakePresetTopology("p4de", 2).value();
  EXPECT_FALSE(p.SmPartitions());
  EXPECT_EQ(p.SmallestCommSms(), 0);
  EXPECT_NE(p.ComputeSms(4).failure().ToString().find("no SM partitions"), std::string::npos);
  // The call on 128 of 132 SMs: waves of 128 CTAs (12 heads x 516 tiles: 48.4 -> 49 waves, from
  // 46.9 -> 47 on 132), at 128/132 of the rate.
  const double whole = h.AttentionSeconds(1e12, 66048, 66048, 12);
  const double part = h.AttentionSeconds(1e12, 66048, 66048, 12, 128);
  const double waves132 = 12.0 * 516 / 132, waves128 = 12.0 * 516 / 128;
  EXPECT_NEAR((part - h.launch_overhead_s) / (whole - h.launch_overhead_s),
              (std::ceil(waves128) / waves128) / (std::ceil(waves132) / waves132) * 132 / 128,
              1e-9);
  auto j = ParseTopologyJson(
      R"({"base": "p4de", "gpu_sms": 108, "sm_partition_step": 2, "comm_sm_GBps": 10})", "c.json",
      2);
  ASSERT_TRUE(j.ok()) << j.failure().ToString();
  EXPECT_EQ(j.value().SmallestCommSms(), 2);
  EXPECT_DOUBLE_EQ(j.value().comm_sm_Bps, 10e9);
  auto bad = ParseTopologyJson(R"({"base": "p4de", "sm_partition_step": -2})", "c.json", 2);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.failure().ToString().find("'sm_partition_step'"), std::string::npos)
      << bad.failure().ToString();
  auto neg = ParseTopologyJson(R"({"base": "p4de", "comm_sm_GBps": -1})", "c.json", 2);
  ASSERT_FALSE(neg.ok());
  EXPECT_NE(neg.failure().ToString().find("comm_sm_GBps"), std::string::npos);
}
// Every field has a range; hostile numbers, duplicate keys and sizes end in a failure naming the
// file, the field, the value and the range (never an exception, a wrapped int or a default).
TEST(Topology, HostileValuesNameFileFieldValueAndRange) {
  auto fails = [](const std::string& text, int machines, int gpus) {
    auto r = ParseTopologyJson(text, "h.json", machines, gpus);
    return r.ok() ? std::string("ok") : r.failure().ToString();
  };
  EXPECT_EQ(fails(R"({"base": "p4de", "nic_bandwidth_GBps": 0})", 2, 0),
            "h.json: column 'nic_bandwidth_GBps': 0 is out of range [0.001, 100000]");
  EXPECT_EQ(fails(R"({"base": "p4de", "intra_bandwidth_GBps": -240})", 2, 0),
            "h.json: column 'intra_bandwidth_GBps': -240 is out of range [0.001, 100000]");
  EXPECT_EQ(fails(R"({"base": "p4de", "inter_latency_us": -1})", 2, 0),
            "h.json: column 'inter_latency_us': -1 is out of range [0, 1e+06]");
  EXPECT_EQ(fails(R"({"base": "p4de", "nic_duplex_GBps": 1e-9})", 2, 0),
            "h.json: column 'nic_duplex_GBps': 1e-09 is out of range [0.001, 100000] (or 0: off)");
  EXPECT_EQ(fails(R"({"base": "p4de", "gpus_per_machine": 5000})", 2, 0),
            "h.json: column 'gpus_per_machine': 5000 is out of range [1, 72]");
  EXPECT_EQ(fails(R"({"base": "p4de", "gpus_per_machine": 1e300})", 2, 0),
            "h.json: column 'gpus_per_machine': 1e+300 is out of range [1, 72]");
  EXPECT_EQ(fails(R"({"base": "p4de", "attention_slots": -5})", 2, 0),
            "h.json: column 'attention_slots': -5 is out of range [0, 1048576]");
  // JSON-level: 1e400 and duplicate keys, with the file's name.
  const std::string big = fails(R"({"base": "p4de", "nic_bandwidth_GBps": 1e400})", 2, 0);
  EXPECT_EQ(big.rfind("h.json:", 0), 0u) << big;
  const std::string dup =
      fails(R"({"base": "p4de", "nic_bandwidth_GBps": 1, "nic_bandwidth_GBps": 2})", 2, 0);
  EXPECT_NE(dup.find("h.json"), std::string::npos) << dup;
  EXPECT_NE(dup.find("duplicate key 'nic_bandwidth_GBps'"), std::string::npos) << dup;
  // Sizes: machines, gpus_per_machine (0 = the file's), the rank count.
  EXPECT_EQ(fails(R"({"base": "p4de"})", 1000, 0),
            "column 'machines': 1000 is out of range [1, 256]");
  EXPECT_EQ(fails(R"({"base": "p4de"})", 2, -1),
            "column 'gpus_per_machine': -1 is out of range [1, 72] (or 0: the cluster's default)");
  EXPECT_EQ(fails(R"({"base": "p4de"})", 200, 0),
            "h.json: column 'machines': 200 machines x 8 GPUs = 1600 ranks exceeds the limit of "
            "1024 ranks");
  auto p = MakePresetTopology("p4de", 1000);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.failure().ToString(), "column 'machines': 1000 is out of range [1, 256]");
  p = MakePresetTopology("p4de", 2, 5000);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.failure().column, "gpus_per_machine");
  p = MakePresetTopology("p4de", 2, -1);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.failure().column, "gpus_per_machine");
  p = MakePresetTopology("h200-local", 256);  // 256 x 4 = 1024 ranks: the limit itself
  EXPECT_TRUE(p.ok()) << p.failure().ToString();
  // Validate on a struct set in code: NaN latency, zero rate.
  Topology t = MakePresetTopology("p4de", 2).value();
  t.intra_latency_s = std::nan("");
  EXPECT_EQ(t.Validate().failure().column, "intra_latency_us");
  t = MakePresetTopology("p4de", 2).value();
  t.hbm_bandwidth_Bps = 0;
  EXPECT_NE(t.Validate().failure().ToString().find("'hbm_bandwidth_GBps': 0 is out of range"),
            std::string::npos);
  // A directory is not a topology file.
  auto d = LoadTopology(::testing::TempDir(), 2);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.failure().ToString().find("not a regular file"), std::string::npos)
      << d.failure().ToString();
}

}  // namespace
}  // namespace ditscale::sp
