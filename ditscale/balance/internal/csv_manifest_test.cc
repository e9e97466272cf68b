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

namespace ditscale::balance::internal {
namespace {

// A random manifest; `hostile` mixes in every kind of bad row and awkward quoting.
// `plain`: unquoted captions without line breaks (the records the one-pass fast path takes).
std::string RandomCsv(std::mt19937_64& rng, int rows, bool hostile, bool plain = false) {
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  std::string s = pick(4) == 0 ? "\xEF\xBB\xBF" : "";
  s += "path,text,num_frames,height,width,fps,extra\n";
  const char* fps[] = {"24", "23.976", "29.97", "30", "60", "", "0.5", "25.000000001"};
  for (int r = 0; r < rows; ++r) {
    const bool image = pick(3) == 0;
    std::string caption = "\"a ";
    for (int w = pick(6); w >= 0; --w) {
      const int k = pick(10);
      caption += k == 0   ? "\"\"quoted\"\" "
                 : k == 1 ? ", comma "
                 : k == 2 ? "line\nbreak "
                          : "word ";
    }
    caption += "\"";
    if (plain) caption = std::string(static_cast<size_t>(pick(40)), 'w');
    std::string row = "v" + std::to_string(r) + ".mp4," + caption + "," +
                      (image ? "1" : std::to_string(1 + pick(400))) + "," +
                      std::to_string(16 + pick(1500)) + "," + std::to_string(16 + pick(2000)) +
                      "," + (image ? "" : fps[pick(5)]) + ",x";
    if (hostile) {
      switch (pick(40)) {
        case 0:
          row = "bad.mp4,\"c\",12abc,480,832,24,x";
          break;
        case 1:
          row = "bad.mp4,\"c\",81,480,832,,x";
          break;
        case 2:
          row = "bad.mp4,\"c\",81,480";
          break;
        case 3:
          row = "bad.mp4,\"c\"x,81,480,832,24,x";
          break;
        case 4:
          row = "ab\"c.mp4,caption,81,480,832,24,x";
          break;  // a quote in an unquoted field
        case 5:
          row = "q.mp4,\"c\",81,480,832,\"" + std::string(fps[pick(8)]) + "\",x,y";
          break;
        case 6:
          row += "\r";
          break;  // CRLF
        case 7:
          s += "\n";
          break;  // a blank line
        case 8:
          row += "\r\r";
          break;  // a lone '\r' ends the row too
        case 9:
          row = "z.mp4,\"c\",-3,0,nan,24,x";
          break;
        case 10:
          row = "p.mp4,c,2,16,16," + std::string(fps[pick(8)]) + ",x";
          break;
        default:
          break;
      }
    }
    s += row;
    s += "\n";
  }
  if (hostile && pick(4) == 0) s += "tail.mp4,\"unterminated,81,480,832,24,x\n";
  if (pick(2) == 0 && !s.empty()) s.pop_back();  // no final newline
  return s;
}

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
