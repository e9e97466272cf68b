#include "ditscale/balance/manifest.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>

namespace ditscale::balance {
namespace {

Manifest MustParse(const std::string& text, const std::string& name = "m.csv",
                   ManifestOptions o = {}) {
  auto r = ParseManifest(text, name, o);
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.failure().ToString());
  return r.ok() ? std::move(r).value() : Manifest{};
}

Failure MustFail(const std::string& text, const std::string& name = "m.csv") {
  auto r = ParseManifest(text, name);
  EXPECT_FALSE(r.ok());
  return r.ok() ? Failure{} : r.failure();
}

TEST(Manifest, BasicCsvAnyColumnOrderAndExtraColumns) {
  auto m = MustParse(
      "fps,width,text,path,height,num_frames,aes\n"
      "30,1280,\"a dog\",v0.mp4,720,150,5.5\n"
      ",1024,\"a cat\",i0.jpg,768,1,4.0\n"
      "0,512,x,i1.png,512,1,1\n");
  ASSERT_EQ(m.samples.size(), 3u);
  EXPECT_EQ(m.rows_total, 3);
  EXPECT_EQ(m.samples[0].num_frames, 150);
  EXPECT_EQ(m.samples[0].height, 720);
  EXPECT_EQ(m.samples[0].width, 1280);
  EXPECT_FLOAT_EQ(m.samples[0].fps, 30.f);
  EXPECT_EQ(m.samples[1].num_frames, 1);
  EXPECT_EQ(m.samples[1].fps, 0.f);
  EXPECT_EQ(m.samples[2].fps, 0.f);
  EXPECT_EQ(m.ids, (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(m.source, "m.csv");
}

TEST(Manifest, QuotingCommasDoubledQuotesNewlinesAndCrlf) {
  // The caption of row 1 spans lines 2-4; row 2 starts on physical line 5.
  std::string text =
      "path,text,num_frames,height,width,fps\r\n"
      "a.mp4,\"a man says \"\"hi, there\"\"\r\nthen\nleaves\",49,480,832,24\r\n"
      "\"b.mp4\",\"x\",\"81\",480,832,16\r\n"
      "c.jpg,\"\",1,256,256,\r\n";
  auto m = MustParse(text);
  ASSERT_EQ(m.samples.size(), 3u);
  EXPECT_EQ(m.samples[0].num_frames, 49);
  EXPECT_FLOAT_EQ(m.samples[0].fps, 24.f);
  EXPECT_EQ(m.samples[1].num_frames, 81);
  EXPECT_EQ(m.samples[2].width, 256);
  // A bad value after a multi-line caption names the physical line of that value.
  auto f = MustFail(
      "path,text,num_frames,height,width,fps\n"
      "a.mp4,\"line one\nline two\nline three\",49,480,abc,24\n");
  EXPECT_EQ(f.line, 4);
  EXPECT_EQ(f.column, "width");
}

TEST(Manifest, BlankLinesAndNoTrailingNewlineAndBom) {
  auto m = MustParse(
      "\xEF\xBB\xBFpath,num_frames,height,width,fps\n\n"
      "a,1,16,16,\n\r\n b ,2, 32 ,48,25.0");
  ASSERT_EQ(m.samples.size(), 2u);
  EXPECT_EQ(m.rows_total, 2);
  EXPECT_EQ(m.samples[1].height, 32);
  EXPECT_FLOAT_EQ(m.samples[1].fps, 25.f);
}

struct BadCase {
  std::string row;  // the data row, written on line 3 (line 2 is a good row)
  std::string column;
  std::string message_part;
};

TEST(Manifest, EachBadRowKindNamesLineAndColumn) {
  const std::string header = "path,num_frames,height,width,fps,caption\n";
  const std::string good = "ok.mp4,81,480,832,16,fine\n";
  const std::vector<BadCase> cases = {
      {",81,480,832,16,x", "path", "missing value"},
      {"v.mp4,,480,832,16,x", "num_frames", "missing value"},
      {"v.mp4,abc,480,832,16,x", "num_frames", "not a number"},
      {"v.mp4,12abc,480,832,16,x", "num_frames", "not a number"},
      {"v.mp4,81,480x,832,16,x", "height", "not a number"},
      {"v.mp4,0,480,832,16,x", "num_frames", "must be > 0"},
      {"v.mp4,81,-480,832,16,x", "height", "must be > 0"},
      {"v.mp4,81,480,0,16,x", "width", "must be > 0"},
      {"v.mp4,81.5,480,832,16,x", "num_frames", "not an integer"},
      {"v.mp4,81,480,nan,16,x", "width", "not a finite number"},
      {"v.mp4,81,480,832,inf,x", "fps", "not a finite number"},
      {"v.mp4,81,480,832,,x", "fps", "missing fps for a video"},
      {"v.mp4,81,480,832,0,x", "fps", "fps must be > 0"},
      {"v.mp4,81,480,832,-5,x", "fps", "fps must be > 0"},
      {"v.mp4,81,480,832,16fps,x", "fps", "not a number"},
      {"i.jpg,1,480,832,abc,x", "fps", "not a number"},
      {"v.mp4,81,480,832,16", "caption", "wrong field count"},
      {"v.mp4,81,480,832,16,x,extra", "", "wrong field count"},
      {"v.mp4,81,480,832,16,\"unterminated caption", "caption", "unterminated quoted field"},
      {"v.mp4,81,480,832,16,\"q\"x", "caption", "after a closing quote"},
      {"v.mp4,99999999999,480,832,16,x", "num_frames", "too large"},
  };
  for (const auto& c : cases) {
    auto f = MustFail(header + good + c.row + "\n" + good, "bad.csv");
    EXPECT_EQ(f.file, "bad.csv") << c.row;
    EXPECT_EQ(f.line, 3) << c.row;
    EXPECT_EQ(f.column, c.column) << c.row;
    EXPECT_NE(f.message.find(c.message_part), std::string::npos) << c.row << " -> " << f.ToString();
  }
}

TEST(Manifest, HeaderErrors) {
  auto f = MustFail("path,num_frames,height,fps\nv,1,2,3\n");
  EXPECT_EQ(f.line, 1);
  EXPECT_EQ(f.column, "width");
  f = MustFail("path,num_frames,height,width,fps,fps\n");
  EXPECT_EQ(f.column, "fps");
  EXPECT_NE(f.message.find("duplicate"), std::string::npos);
  f = MustFail("");
  EXPECT_NE(f.message.find("empty"), std::string::npos);
}

TEST(Manifest, SkipModeCountsAndKeepsFirstTenReasonsAndStableIds) {
  std::string text = "path,num_frames,height,width,fps\n";
  std::vector<int64_t> expected_ids;
  int64_t id = 0;
  for (int i = 0; i < 30; ++i, ++id) {
    if (i % 3 == 1) {
      text += "bad.mp4,81,480,832,0\n";  // video without fps
    } else {
      text += "ok.mp4,81,480,832,16\n";
      expected_ids.push_back(id);
    }
  }
  ManifestOptions o;
  o.skip_bad_rows = true;
  auto m = MustParse(text, "s.csv", o);
  EXPECT_EQ(m.rows_total, 30);
  EXPECT_EQ(m.rows_skipped, 10);
  EXPECT_EQ(m.ids, expected_ids);
  ASSERT_EQ(m.skipped_examples.size(), 10u);
  EXPECT_EQ(m.skipped_examples[0].rfind("s.csv:3: column 'fps': ", 0), 0u) << m.skipped_examples[0];
  // Twelve bad rows: still only ten reasons kept.
  text += "x,0,1,1,1\nx,1,0,1,1\n";
  m = MustParse(text, "s.csv", o);
  EXPECT_EQ(m.rows_skipped, 12);
  EXPECT_EQ(m.skipped_examples.size(), 10u);
  // A skipped unterminated quote swallows the rest of the file as one bad row.
  m = MustParse("path,num_frames,height,width,fps\na,1,2,2,\n\"b,1,2,2,\nc,1,2,2,\n", "u.csv", o);
  EXPECT_EQ(m.samples.size(), 1u);
  EXPECT_EQ(m.rows_skipped, 1);
}

TEST(Manifest, Jsonl) {
  const std::string text =
      "{\"path\": \"a.mp4\", \"num_frames\": 81, \"height\": 480, \"width\": 832, \"fps\": 16,"
      " \"text\": \"with \\\"escapes\\\", commas\", \"meta\": {\"k\": [1, {\"x\": \"}\"}]}}\n"
      "\n"
      "{\"path\":\"i.jpg\",\"num_frames\":1,\"height\":1024,\"width\":768,\"fps\":null}\r\n"
      "{\"fps\": \"30\", \"width\": 1280, \"height\": 720, \"num_frames\": 300, \"path\": \"v\"}\n";
  auto m = MustParse(text, "m.jsonl");
  ASSERT_EQ(m.samples.size(), 3u);
  EXPECT_EQ(m.samples[0].num_frames, 81);
  EXPECT_EQ(m.samples[1].width, 768);
  EXPECT_EQ(m.samples[1].fps, 0.f);
  EXPECT_FLOAT_EQ(m.samples[2].fps, 30.f);
  EXPECT_EQ(m.ids, (std::vector<int64_t>{0, 1, 2}));

  auto f = MustFail(
      "{\"path\":\"a\",\"num_frames\":1,\"height\":8,\"width\":8}\n"
      "{\"path\":\"a\",\"num_frames\":5,\"height\":8,\"width\":8,\"fps\":\"x\"}\n",
      "m.jsonl");
  EXPECT_EQ(f.line, 2);
  EXPECT_EQ(f.column, "fps");
  f = MustFail("{\"path\":\"a\",\"num_frames\":1,\"height\":8}\n", "m.jsonl");
  EXPECT_EQ(f.column, "width");
  EXPECT_NE(f.message.find("missing"), std::string::npos);
  f = MustFail("\n\n{\"path\":\"a\",\"num_frames\":1,,}\n", "m.jsonl");
  EXPECT_EQ(f.line, 3);
  f = MustFail("{\"path\":\"a\",\"num_frames\":2,\"height\":8,\"width\":8,\"fps\":9} x\n",
               "m.jsonl");
  EXPECT_NE(f.message.find("trailing"), std::string::npos);
  f = MustFail("{\"path\":\"a\",\"num_frames\":true,\"height\":8,\"width\":8}\n", "m.jsonl");
  EXPECT_EQ(f.column, "num_frames");
  ManifestOptions o;
  o.format = "csv";
  EXPECT_FALSE(ParseManifest(text, "m.jsonl", o).ok());  // forced CSV: no header columns
}

TEST(Manifest, ReadFileAndMissingFile) {
  auto r = ReadManifest("/nonexistent/dir/x.csv");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.failure().file, "/nonexistent/dir/x.csv");
  EXPECT_NE(r.failure().message.find("cannot open"), std::string::npos);
}

// Fresh random rows round-trip exactly; also a throughput check on ~1M rows.
TEST(Manifest, RandomRowsRoundTripAndThroughput) {
  std::mt19937_64 rng(std::random_device{}());
  const int n = 1'000'000;
  std::string text = "path,text,num_frames,height,width,aspect_ratio,fps\n";
  text.reserve(static_cast<size_t>(n) * 90);
  std::vector<RawSample> want(n);
  for (int i = 0; i < n; ++i) {
    RawSample s;
    const bool image = rng() % 5 < 2;
    s.num_frames = image ? 1 : static_cast<int32_t>(2 + rng() % 1200);
    s.height = static_cast<int32_t>(64 + rng() % 2000);
    s.width = static_cast<int32_t>(64 + rng() % 2000);
    s.fps = image ? 0.f : static_cast<float>(std::vector<int>{24, 25, 30, 60}[rng() % 4]);
    want[i] = s;
    text += "clips/" + std::to_string(i) + ".mp4,\"a scene, with \"\"quotes\"\" and text\",";
    text += std::to_string(s.num_frames) + "," + std::to_string(s.height) + "," +
            std::to_string(s.width) + ",0.56,";
    if (!image) text += std::to_string(static_cast<int>(s.fps));
    text += (i % 2) ? "\r\n" : "\n";
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto m = MustParse(text, "big.csv");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(m.samples.size(), want.size());
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(m.samples[i].num_frames, want[i].num_frames) << i;
    ASSERT_EQ(m.samples[i].height, want[i].height) << i;
    ASSERT_EQ(m.samples[i].width, want[i].width) << i;
    ASSERT_EQ(m.samples[i].fps, want[i].fps) << i;
  }
  std::printf("parsed %d rows (%.1f MB) in %.3f s\n", n, text.size() / 1e6, secs);
  EXPECT_LT(secs, 2.0);  // generous: a loaded shared machine; typically ~0.1 s
}

}  // namespace
}  // namespace ditscale::balance

namespace ditscale::balance {
namespace {

// The bundled examples (examples/manifests/), found through DITSCALE_SOURCE_DIR (set by CTest).
std::string ExamplePath(const std::string& name) {
  const char* root = std::getenv("DITSCALE_SOURCE_DIR");
  return root ? std::string(root) + "/examples/manifests/" + name : "";
}

TEST(ManifestExamples, BadRowsExample) {
  const std::string path = ExamplePath("bad_rows.csv");
  if (path.empty()) GTEST_SKIP() << "DITSCALE_SOURCE_DIR not set";
  auto strict = ReadManifest(path);
  ASSERT_FALSE(strict.ok());
  EXPECT_EQ(strict.failure().line, 3);
  EXPECT_EQ(strict.failure().column, "fps");
  ManifestOptions o;
  o.skip_bad_rows = true;
  auto m = ReadManifest(path, o);
  ASSERT_TRUE(m.ok()) << m.failure().ToString();
  EXPECT_EQ(m->rows_total, 8);
  EXPECT_EQ(m->rows_skipped, 5);
  EXPECT_EQ(m->ids, (std::vector<int64_t>{0, 2, 5}));
  const std::vector<std::string> want = {":3: column 'fps'", ":5: column 'num_frames'",
                                         ":6: column 'height'", ":9: column 'resolution'",
                                         ":10: column 'width'"};
  ASSERT_EQ(m->skipped_examples.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NE(m->skipped_examples[i].find(want[i]), std::string::npos) << m->skipped_examples[i];
  }
}

TEST(ManifestExamples, Mixed2kExample) {
  const std::string path = ExamplePath("mixed_2k.csv");
  if (path.empty()) GTEST_SKIP() << "DITSCALE_SOURCE_DIR not set";
  auto m = ReadManifest(path);
  ASSERT_TRUE(m.ok()) << m.failure().ToString();
  EXPECT_EQ(m->samples.size(), 2000u);
  int64_t images = 0;
  for (const auto& s : m->samples) images += s.num_frames == 1;
  EXPECT_GT(images, 700);
  EXPECT_LT(images, 900);
}

}  // namespace
}  // namespace ditscale::balance
