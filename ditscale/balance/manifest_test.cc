#include "ditscale/balance/manifest.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <thread>

#include "ditscale/balance/internal/jsonl_manifest.h"

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
      {"v.mp4,0,480,832,16,x", "num_frames", "'0' is out of range [1, 2147483647]"},
      {"v.mp4,81,-480,832,16,x", "height", "'-480' is out of range [1, 2147483647]"},
      {"v.mp4,81,480,0,16,x", "width", "'0' is out of range [1, 2147483647]"},
      {"v.mp4,81.5,480,832,16,x", "num_frames", "not an integer"},
      {"v.mp4,81,480,nan,16,x", "width", "'nan' is out of range [1, 2147483647]"},
      {"v.mp4,81,480,832,inf,x", "fps", "'inf' is out of range [0.001, 1e+06] for a video"},
      {"v.mp4,81,480,832,,x", "fps", "missing fps for a video"},
      {"v.mp4,81,480,832,0,x", "fps", "'0' is out of range [0.001, 1e+06] for a video"},
      {"v.mp4,81,480,832,-5,x", "fps", "'-5' is out of range [0.001, 1e+06]"},
      {"v.mp4,81,480,832,16fps,x", "fps", "not a number: '16fps'"},
      {"i.jpg,1,480,832,abc,x", "fps", "not a number"},
      {"v.mp4,81,480,832,16", "caption", "wrong field count"},
      {"v.mp4,81,480,832,16,x,extra", "", "wrong field count"},
      {"v.mp4,81,480,832,16,\"unterminated caption", "caption", "unterminated quoted field"},
      {"v.mp4,81,480,832,16,\"q\"x", "caption", "after a closing quote"},
      {"v.mp4,99999999999,480,832,16,x", "num_frames", "'99999999999' is out of range"},
      {"v.mp4,81,480,832,1e39,x", "fps", "'1e39' is out of range [0.001, 1e+06]"},
      {"v.mp4,81,480,832,1e-50,x", "fps", "'1e-50' is out of range [0.001, 1e+06]"},
      {"i.jpg,1,480,832,-5,x", "fps", "'-5' is out of range [0, 1e+06]"},
      {"v.mp4,81,480,832,1e400,x", "fps", "'1e400' is out of range"},
      {"v.mp4,2147483648,480,832,16,x", "num_frames", "'2147483648' is out of range"},
      {"v.mp4,81,9223372036854775808,832,16,x", "height", "'9223372036854775808' is out of range"},
      {"v.mp4,81,480,1e400,16,x", "width", "'1e400' is out of range"},
      {"v.mp4,81,480,8\x01\x7f,16,x", "width", "not a number: '8\\x01\\x7f'"},
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
      "{\"fps\": 30, \"width\": 1280, \"height\": 720, \"num_frames\": 300, \"path\": \"v\"}\n";
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
  EXPECT_EQ(f.line, 1);
  EXPECT_NE(f.message.find("JSON syntax error"), std::string::npos) << f.ToString();
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

namespace ditscale::balance {
namespace {

// One bad value written in both formats: the CSV row and the JSONL row give the same line,
// column and message.
struct SameRuleCase {
  std::string frames, height, width, fps;  // JSON value text; "" = empty CSV field / JSON null
  std::string column, message;
};

std::string CsvOf(const SameRuleCase& c) {
  return "path,num_frames,height,width,fps\nok.mp4,81,480,832,16\nv.mp4," + c.frames + "," +
         c.height + "," + c.width + "," + c.fps + "\n";
}

std::string JsonlOf(const SameRuleCase& c) {
  auto v = [](const std::string& s) { return s.empty() ? std::string("null") : s; };
  return "{\"path\":\"ok.mp4\",\"num_frames\":81,\"height\":480,\"width\":832,\"fps\":16}\n"
         "{\"path\":\"v.mp4\",\"num_frames\":" +
         v(c.frames) + ",\"height\":" + v(c.height) + ",\"width\":" + v(c.width) +
         ",\"fps\":" + v(c.fps) + "}\n";
}

TEST(ManifestRules, CsvAndJsonlApplyTheSameFieldRules) {
  const std::string dim = " is out of range [1, 2147483647]";
  const std::string video = " is out of range [0.001, 1e+06] for a video (num_frames > 1)";
  const std::vector<SameRuleCase> cases = {
      {"81", "480", "832", "1e39", "fps", "'1e39'" + video},
      {"81", "480", "832", "1e-50", "fps", "'1e-50'" + video},
      {"81", "480", "832", "0", "fps", "'0'" + video},
      {"81", "480", "832", "-1", "fps", "'-1'" + video},
      {"81", "480", "832", "1000001", "fps", "'1000001'" + video},
      {"1", "480", "832", "-5", "fps", "'-5' is out of range [0, 1e+06]"},
      {"1", "480", "832", "1e39", "fps", "'1e39' is out of range [0, 1e+06]"},
      {"81", "480", "832", "", "fps", "missing fps for a video (num_frames > 1)"},
      {"0", "480", "832", "16", "num_frames", "'0'" + dim},
      {"-1", "480", "832", "16", "num_frames", "'-1'" + dim},
      {"2147483648", "480", "832", "16", "num_frames", "'2147483648'" + dim},
      {"81", "9223372036854775808", "832", "16", "height", "'9223372036854775808'" + dim},
      {"81", "480", "18446744073709551616", "16", "width", "'18446744073709551616'" + dim},
      {"81.5", "480", "832", "16", "num_frames", "not an integer: '81.5'"},
      {"81", "", "832", "16", "height", "missing value"},
  };
  for (const auto& c : cases) {
    auto csv = MustFail(CsvOf(c), "m.csv");
    auto jsonl = MustFail(JsonlOf(c), "m.jsonl");
    EXPECT_EQ(csv.line, 3) << csv.ToString();
    EXPECT_EQ(jsonl.line, 2) << jsonl.ToString();
    for (const Failure& f : {csv, jsonl}) {
      EXPECT_EQ(f.column, c.column) << f.ToString();
      EXPECT_EQ(f.message, c.message) << f.ToString();
    }
  }
  // Integral reals are integers in both: 81.0 and 8.1e1 are 81 frames.
  for (const std::string frames : {"81.0", "8.1e1"}) {
    SameRuleCase c{frames, "480", "832", "16", "", ""};
    EXPECT_EQ(MustParse(CsvOf(c)).samples.at(1).num_frames, 81);
    EXPECT_EQ(MustParse(JsonlOf(c), "m.jsonl").samples.at(1).num_frames, 81);
  }
}

TEST(ManifestRules, JsonlTypesDuplicatesAndHugeNumbersNameTheLine) {
  const std::string ok = "{\"path\":\"a\",\"num_frames\":1,\"height\":8,\"width\":8}\n";
  struct Case {
    std::string row, column, message;
  };
  const std::vector<Case> cases = {
      {"{\"path\":\"a\",\"num_frames\":\"1\",\"height\":8,\"width\":8}", "num_frames",
       "expected a number, got the string '1'"},
      {"{\"path\":\"a\",\"num_frames\":2,\"height\":8,\"width\":8,\"fps\":\"30\"}", "fps",
       "expected a number, got the string '30'"},
      {"{\"path\":\"a\",\"num_frames\":1,\"height\":[8],\"width\":8}", "height",
       "expected a number, got '[8]'"},
      {"{\"path\":7,\"num_frames\":1,\"height\":8,\"width\":8}", "path",
       "expected a string, got '7'"},
      {"{\"path\":\"a\",\"num_frames\":1,\"height\":8,\"width\":8,\"height\":9}", "",
       "duplicate key 'height'"},
      {"[1, 2]", "", "expected a JSON object, got '[1,2]'"},
  };
  for (const auto& c : cases) {
    auto f = MustFail(ok + c.row + "\n", "m.jsonl");
    EXPECT_EQ(f.file, "m.jsonl");
    EXPECT_EQ(f.line, 2) << f.ToString();
    EXPECT_EQ(f.column, c.column) << f.ToString();
    EXPECT_EQ(f.message, c.message) << f.ToString();
  }
  // 1e400: a Failure with file and line (no raw json.exception), naming the number.
  auto f = MustFail(
      ok + ok + "{\"path\":\"a\",\"num_frames\":2,\"height\":8,\"width\":8,\"fps\":1e400}\n",
      "m.jsonl");
  EXPECT_EQ(f.line, 3) << f.ToString();
  EXPECT_NE(f.message.find("1e400"), std::string::npos) << f.ToString();
  EXPECT_EQ(f.message.find("json.exception"), std::string::npos) << f.ToString();
}

TEST(ManifestRules, SkipBadRowsIsTheSameForBothFormats) {
  const std::vector<SameRuleCase> rows = {
      {"81", "480", "832", "16", "", ""},   {"81", "480", "832", "1e39", "", ""},
      {"1", "480", "832", "", "", ""},      {"0", "480", "832", "16", "", ""},
      {"1", "480", "832", "-5", "", ""},    {"150", "720", "1280", "30", "", ""},
      {"81.5", "480", "832", "16", "", ""},
  };
  std::string csv = "path,num_frames,height,width,fps\n", jsonl;
  for (const auto& r : rows) {
    csv += "v.mp4," + r.frames + "," + r.height + "," + r.width + "," + r.fps + "\n";
    jsonl += JsonlOf(r).substr(JsonlOf(r).find('\n') + 1);
  }
  ManifestOptions o;
  o.skip_bad_rows = true;
  const Manifest a = MustParse(csv, "m.csv", o);
  const Manifest b = MustParse(jsonl, "m.jsonl", o);
  EXPECT_EQ(a.ids, (std::vector<int64_t>{0, 2, 5}));
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(a.rows_total, 7);
  EXPECT_EQ(b.rows_total, 7);
  EXPECT_EQ(a.rows_skipped, 4);
  EXPECT_EQ(b.rows_skipped, 4);
  ASSERT_EQ(a.skipped_examples.size(), b.skipped_examples.size());
  for (size_t i = 0; i < a.skipped_examples.size(); ++i) {
    // Same reason; the CSV line is one more (the header).
    const std::string& x = a.skipped_examples[i];
    const std::string& y = b.skipped_examples[i];
    EXPECT_EQ(x.substr(x.find(": ")), y.substr(y.find(": "))) << x << " vs " << y;
  }
  for (size_t i = 0; i < a.samples.size(); ++i) {
    EXPECT_EQ(a.samples[i].num_frames, b.samples[i].num_frames);
    EXPECT_EQ(a.samples[i].fps, b.samples[i].fps);
  }
}

TEST(ManifestRules, ErrorMessagesQuoteAtMost40BytesAndEscapeControlBytes) {
  const std::string header = "path,num_frames,height,width,fps\n";
  auto f = MustFail(header + "v," + std::string(100, '7') + "x,8,8,16\n");
  EXPECT_EQ(f.message, "not a number: '" + std::string(40, '7') + "...'");
  f = MustFail(header + "v,8" + std::string("\0\r", 1) + "1,8,8,16\n");
  EXPECT_EQ(f.message, "not a number: '8\\x001'") << f.ToString();
  f = MustFail(header + "v,8,8,\"8\x1b\",16\n");
  EXPECT_EQ(f.column, "width");
  EXPECT_EQ(f.message, "not a number: '8\\x1b'");
}

// ----- limits -----

TEST(ManifestLimits, LineLongerThanTheLimitIsAnErrorEvenWhenSkipping) {
  ManifestOptions skip;
  skip.skip_bad_rows = true;
  const std::string header = "path,text,num_frames,height,width,fps\n";
  const std::string ok = "v.mp4,cap,81,480,832,16\n";
  const std::string long_caption(kMaxLineBytes, 'c');
  // A row of kMaxLineBytes bytes is fine; one more byte is not.
  const std::string fits = "v.mp4," + long_caption.substr(0, kMaxLineBytes - 20) + ",81,480,832,16";
  ASSERT_LE(fits.size(), kMaxLineBytes);
  EXPECT_EQ(MustParse(header + ok + fits + "\n", "m.csv", skip).samples.size(), 2u);
  for (const auto& o : {ManifestOptions{}, skip}) {
    auto r = ParseManifest(header + ok + ok + "v.mp4," + long_caption + ",81,480,832,16\n" + ok,
                           "m.csv", o);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.failure().ToString(), "m.csv:4: line longer than the 1048576-byte limit");
    // Inside a quoted caption that spans lines: the long physical line is named.
    r = ParseManifest(header + ok + "v.mp4,\"a\nb\n" + long_caption + "\",81,480,832,16\n", "m.csv",
                      o);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.failure().ToString(), "m.csv:5: line longer than the 1048576-byte limit");
    const std::string row = "{\"path\":\"a\",\"num_frames\":1,\"height\":8,\"width\":8}\n";
    r = ParseManifest(row + "\n" + long_caption + "c\n" + row, "m.jsonl", o);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.failure().ToString(), "m.jsonl:3: line longer than the 1048576-byte limit");
  }
  // A header line over the limit.
  auto f = MustFail("path,num_frames,height,width,fps," + long_caption + "\n");
  EXPECT_EQ(f.ToString(), "m.csv:1: line longer than the 1048576-byte limit");
}

TEST(ManifestLimits, HeaderColumns) {
  std::string header = "path,num_frames,height,width,fps";
  for (size_t i = 5; i < kMaxColumns; ++i) header += ",c";
  EXPECT_EQ(MustParse(header + "\n").rows_total, 0);
  auto f = MustFail(header + ",c\n");
  EXPECT_EQ(f.line, 1);
  EXPECT_EQ(f.message, "header has more than 1024 columns (the limit)");
}

TEST(ManifestLimits, DevZeroFailsAtLineOneInBothFormats) {
  for (const std::string format : {"csv", "jsonl"}) {
    for (bool skip : {false, true}) {
      ManifestOptions o;
      o.format = format;
      o.skip_bad_rows = skip;
      auto r = ReadManifest("/dev/zero", o);
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.failure().ToString(), "/dev/zero:1: line longer than the 1048576-byte limit");
    }
  }
}

TEST(ManifestLimits, DirectoryIsRefused) {
  auto r = ReadManifest("/");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.failure().ToString(), "/: is a directory, not a manifest file");
}

// A FIFO is read as a stream: the same rows as the file, and its long lines fail while reading.
TEST(ManifestLimits, FifoIsStreamedWithTheSameRulesAndLimits) {
  const std::string dir = ::testing::TempDir() + "manifest_fifo_" + std::to_string(getpid());
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  const std::string fifo = dir + "/m.csv";
  // The reader stops at the long line; the writer then gets EPIPE instead of SIGPIPE.
  signal(SIGPIPE, SIG_IGN);
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  auto feed = [&](std::string text) {
    return std::thread([fifo, text] {
      std::ofstream out(fifo, std::ios::binary);
      out << text;
    });
  };
  std::thread w = feed("path,num_frames,height,width,fps\na,1,8,8,\nb,9,8,8,0\n");
  auto r = ReadManifest(fifo);
  w.join();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(
      r.failure().ToString(),
      fifo + ":3: column 'fps': '0' is out of range [0.001, 1e+06] for a video (num_frames > 1)");
  w = feed("path,num_frames,height,width,fps\na,1,8,8,\n" + std::string(3 << 20, 'x'));
  r = ReadManifest(fifo);
  w.join();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.failure().ToString(), fifo + ":3: line longer than the 1048576-byte limit");
  w = feed("path,num_frames,height,width,fps\na,1,8,8,\nb,9,8,8,30\n");
  r = ReadManifest(fifo);
  w.join();
  ASSERT_TRUE(r.ok()) << r.failure().ToString();
  EXPECT_EQ(r->samples.size(), 2u);
  unlink(fifo.c_str());
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace ditscale::balance

namespace ditscale::balance {
namespace {

// JSONL on two threads gives what one pass gives: rows, ids, lines, skip reasons, the failure.
TEST(ManifestJsonl, TwoThreadsEqualOnePass) {
  std::mt19937_64 rng(11);
  const std::vector<std::string> bad = {
      "{\"path\":\"b\",\"num_frames\":0,\"height\":8,\"width\":8}",
      "{\"path\":\"b\",\"num_frames\":2,\"height\":8,\"width\":8,\"fps\":1e400}",
      "{\"path\":\"b\",\"num_frames\":1,\"num_frames\":1,\"height\":8,\"width\":8}",
      "not json",
      "",
      "\r"};
  for (int iter = 0; iter < 200; ++iter) {
    std::string text;
    for (int r = 0, n = 1 + static_cast<int>(rng() % 40); r < n; ++r) {
      if (rng() % 6 == 0) {
        text += bad[rng() % bad.size()];
      } else {
        text += "{\"path\":\"v\",\"num_frames\":" + std::to_string(1 + rng() % 3) +
                ",\"height\":8,\"width\":8,\"fps\":24}";
      }
      text += rng() % 5 == 0 ? "\r\n" : "\n";
    }
    for (bool skip : {false, true}) {
      ManifestOptions o;
      o.skip_bad_rows = skip;
      auto one = internal::ParseJsonlManifest(text, "m.jsonl", o, SIZE_MAX);
      auto two = internal::ParseJsonlManifest(text, "m.jsonl", o, 0);
      const std::string ctx = "iter " + std::to_string(iter) + (skip ? " skip" : " strict");
      ASSERT_EQ(one.ok(), two.ok()) << ctx;
      if (!one.ok()) {
        EXPECT_EQ(one.failure().ToString(), two.failure().ToString()) << ctx;
        continue;
      }
      EXPECT_EQ(one->ids, two->ids) << ctx;
      EXPECT_EQ(one->rows_total, two->rows_total) << ctx;
      EXPECT_EQ(one->skipped_examples, two->skipped_examples) << ctx;
      ASSERT_EQ(one->samples.size(), two->samples.size()) << ctx;
      for (size_t i = 0; i < one->samples.size(); ++i) {
        EXPECT_EQ(one->samples[i].num_frames, two->samples[i].num_frames) << ctx;
      }
    }
  }
}

}  // namespace
}  // namespace ditscale::balance
