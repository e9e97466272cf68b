// The two-thread CSV path must give exactly what one sequential pass gives (samples, ids,
// counts, skip reasons, the strict-mode failure) on well-formed and hostile files alike, and the
// number fast paths must agree with std::from_chars.
#include "ditscale/balance/internal/csv_manifest.h"

#include <gtest/gtest.h>

#include <charconv>
#include <cstdint>
#include <limits>
#include <random>
#include <string>

#include "ditscale/balance/internal/random_csv_test_util.h"

namespace ditscale::balance::internal {
namespace {

void ExpectSame(const Result<Manifest>& a, const Result<Manifest>& b, const std::string& ctx) {
  ASSERT_EQ(a.ok(), b.ok()) << ctx;
  if (!a.ok()) {
    EXPECT_EQ(a.failure().ToString(), b.failure().ToString()) << ctx;
    return;
  }
  const Manifest& x = *a;
  const Manifest& y = *b;
  EXPECT_EQ(x.rows_total, y.rows_total) << ctx;
  EXPECT_EQ(x.rows_skipped, y.rows_skipped) << ctx;
  EXPECT_EQ(x.skipped_examples, y.skipped_examples) << ctx;
  EXPECT_EQ(x.ids, y.ids) << ctx;
  ASSERT_EQ(x.samples.size(), y.samples.size()) << ctx;
  for (size_t i = 0; i < x.samples.size(); ++i) {
    ASSERT_EQ(x.samples[i].num_frames, y.samples[i].num_frames) << ctx << " row " << i;
    ASSERT_EQ(x.samples[i].height, y.samples[i].height) << ctx << " row " << i;
    ASSERT_EQ(x.samples[i].width, y.samples[i].width) << ctx << " row " << i;
    ASSERT_EQ(x.samples[i].fps, y.samples[i].fps) << ctx << " row " << i;
  }
}

TEST(CsvManifest, TwoThreadsEqualOnePassOnRandomHostileFiles) {
  std::mt19937_64 rng(std::random_device{}());
  CsvParseOptions serial;
  serial.min_parallel_bytes = std::numeric_limits<size_t>::max();
  CsvParseOptions parallel;
  parallel.force_parallel = true;
  int failures = 0, skipped = 0;
  for (int iter = 0; iter < 400; ++iter) {
    const uint64_t seed = rng();
    std::mt19937_64 g(seed);
    const bool hostile = iter % 4 != 0;
    const std::string text = RandomCsv(g, 1 + static_cast<int>(g() % 60), hostile);
    for (bool skip : {false, true}) {
      ManifestOptions o;
      o.skip_bad_rows = skip;
      const std::string ctx = "seed " + std::to_string(seed) + (skip ? " skip" : " strict");
      auto a = ParseCsvManifest(text, "m.csv", o, serial);
      auto b = ParseCsvManifest(text, "m.csv", o, parallel);
      ExpectSame(a, b, ctx);
      if (!a.ok()) ++failures;
      if (a.ok()) skipped += static_cast<int>(a->rows_skipped);
      if (!hostile) {
        ASSERT_TRUE(a.ok()) << ctx << ": " << a.failure().ToString();
        EXPECT_EQ(a->rows_skipped, 0) << ctx;
      }
    }
  }
  // The generator did produce both outcomes.
  EXPECT_GT(failures, 0);
  EXPECT_GT(skipped, 0);
}

// The one-pass split of plain records gives exactly what the general scanner gives, on plain and
// hostile files (CRLF across a 16-byte block, lone '\r', quotes, wrong counts, no final newline).
TEST(CsvManifest, PlainRecordFastPathEqualsTheGeneralScanner) {
  std::mt19937_64 rng(7);
  CsvParseOptions general;
  general.plain_fast_path = false;
  for (int iter = 0; iter < 400; ++iter) {
    const uint64_t seed = rng();
    std::mt19937_64 g(seed);
    const std::string text =
        RandomCsv(g, 1 + static_cast<int>(g() % 60), iter % 3 != 0, /*plain=*/iter % 2 == 0);
    for (bool skip : {false, true}) {
      ManifestOptions o;
      o.skip_bad_rows = skip;
      const std::string ctx = "seed " + std::to_string(seed) + (skip ? " skip" : " strict");
      ExpectSame(ParseCsvManifest(text, "m.csv", o, general), ParseCsvManifest(text, "m.csv", o),
                 ctx);
    }
  }
}

TEST(CsvManifest, TwoThreadsKeepIdsAndLinesAcrossTheSplit) {
  // 1000 good rows with two-line captions, one bad row near the end: the failure's line must be
  // exact (the second thread's lines are offset by the first part's).
  std::string text = "path,text,num_frames,height,width,fps\n";
  for (int r = 0; r < 1000; ++r) {
    text += "v" + std::to_string(r) + ".mp4,\"two\nlines, \"\"q\"\"\"," + std::to_string(r + 2) +
            ",480,832,24\n";
  }
  text += "bad.mp4,\"x\",5,480,832,-1\n";  // line 2 + 2 * 1000 = 2002
  CsvParseOptions parallel;
  parallel.force_parallel = true;
  auto r = ParseCsvManifest(text, "m.csv", {}, parallel);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.failure().line, 2002);
  EXPECT_EQ(r.failure().column, "fps");
  ManifestOptions skip;
  skip.skip_bad_rows = true;
  auto m = ParseCsvManifest(text, "m.csv", skip, parallel);
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->samples.size(), 1000u);
  EXPECT_EQ(m->rows_total, 1001);
  EXPECT_EQ(m->rows_skipped, 1);
  ASSERT_EQ(m->skipped_examples.size(), 1u);
  EXPECT_EQ(m->skipped_examples[0].rfind("m.csv:2002: ", 0), 0u) << m->skipped_examples[0];
  for (int i = 0; i < 1000; ++i) {
    ASSERT_EQ(m->ids[i], i);
    ASSERT_EQ(m->samples[i].num_frames, i + 2);
  }
}

TEST(CsvManifest, NumberFastPathsAgreeWithFromChars) {
  std::mt19937_64 rng(std::random_device{}());
  std::string text = "path,num_frames,height,width,fps\n";
  std::vector<std::string> fps;
  std::vector<int> frames;
  for (int i = 0; i < 3000; ++i) {
    std::string f = std::to_string(1 + rng() % 100000);
    if (rng() % 2) {
      f += ".";
      for (int d = 1 + static_cast<int>(rng() % 14); d > 0; --d) f += char('0' + rng() % 10);
    }
    if (rng() % 5 == 0) f = "0000" + f;
    fps.push_back(f);
    frames.push_back(2 + static_cast<int>(rng() % 999999998));
    text += "a.mp4," + std::to_string(frames.back()) + ",16,16," + f + "\n";
  }
  auto m = ParseCsvManifest(text, "m.csv", {});
  ASSERT_TRUE(m.ok()) << m.failure().ToString();
  for (size_t i = 0; i < fps.size(); ++i) {
    double v = 0;
    std::from_chars(fps[i].data(), fps[i].data() + fps[i].size(), v);
    ASSERT_EQ(m->samples[i].fps, static_cast<float>(v)) << fps[i];
    ASSERT_EQ(m->samples[i].num_frames, frames[i]);
  }
}

}  // namespace
}  // namespace ditscale::balance::internal
