// A bounded fuzz test of the manifest readers (fixed seed, ~2 s): valid CSV and JSONL manifests
// are mutated (byte flips, truncation, hostile field values, very long fields, NUL bytes, CRLF,
// duplicated and dropped lines) and each result must be either a Failure naming the file and a
// line of the text, or a manifest whose every row passes the field rules of manifest.h, in strict
// and skip mode, with the two-thread CSV path and the general scanner equal to the one-pass
// fast path. Never a crash, never an exception.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "ditscale/balance/internal/csv_manifest.h"
#include "ditscale/balance/manifest.h"

namespace ditscale::balance {
namespace {

const char* const kHostile[] = {"0",       "-1",    "2147483648", "9223372036854775808",
                                "1e400",   "nan",   "inf",        "",
                                "\"",      "\"\"",  "1e39",       "1e-50",
                                "-0",      " 81 ",  "81.0",       "\"81\"",
                                "0x10",    "+5",    "1e-400",     "4294967297",
                                "null",    "true",  "[1]",        "{\"a\":1}",
                                "\\u0000", "1.5e3", ".5",         "1000001"};

std::string SeedCsv(std::mt19937_64& rng) {
  std::string s = "path,text,num_frames,height,width,fps\n";
  for (int r = 0; r < 12; ++r) {
    const bool image = rng() % 3 == 0;
    // Odd rows: a quoted caption (with a line break in every fifth row); even rows: a plain one
    // (the one-pass fast path).
    const std::string caption =
        r % 2 == 1 ? std::string("\"a, \"\"caption\"\"") + (r % 5 == 0 ? "\nmore" : "") + "\""
                   : "a plain caption";
    s += "v" + std::to_string(r) + ".mp4," + caption + "," +
         (image ? "1" : std::to_string(2 + rng() % 300)) + "," + std::to_string(16 + rng() % 2000) +
         "," + std::to_string(16 + rng() % 2000) + "," +
         (image ? "" : std::to_string(1 + rng() % 60)) + (r % 4 == 0 ? "\r\n" : "\n");
  }
  return s;
}

std::string SeedJsonl(std::mt19937_64& rng) {
  std::string s;
  for (int r = 0; r < 12; ++r) {
    const bool image = rng() % 3 == 0;
    s += "{\"path\": \"v" + std::to_string(r) + ".mp4\", \"text\": \"a \\\"cap\\\", x\", " +
         "\"num_frames\": " + (image ? "1" : std::to_string(2 + rng() % 300)) +
         ", \"height\": " + std::to_string(16 + rng() % 2000) +
         ", \"width\": " + std::to_string(16 + rng() % 2000) +
         ", \"fps\": " + (image ? "null" : std::to_string(1 + rng() % 60) + ".5") + "}" +
         (r % 4 == 0 ? "\r\n" : "\n");
  }
  return s;
}

// Replaces the value after a random ',' or ':' (up to the next delimiter) by a hostile token.
void ReplaceValue(std::string* s, std::mt19937_64& rng, bool jsonl) {
  if (s->empty()) return;
  const size_t at = rng() % s->size();
  const size_t sep = s->find(jsonl ? ':' : ',', at);
  if (sep == std::string::npos) return;
  const size_t end = s->find_first_of(jsonl ? ",}\n" : ",\n", sep + 1);
  const size_t len = (end == std::string::npos ? s->size() : end) - sep - 1;
  std::string token = kHostile[rng() % std::size(kHostile)];
  if (rng() % 20 == 0) token = std::string(rng() % 4 == 0 ? kMaxLineBytes + 1 : 3000, '9');
  if (rng() % 10 == 0)
    token = std::string(
        "8\0"
        "1",
        3);
  s->replace(sep + 1, len, token);
}

void Mutate(std::string* s, std::mt19937_64& rng, bool jsonl) {
  static const char kBytes[] = {'\0', '"', ',', '\n', '\r', '{', '}',    ':',   '\\',
                                ' ',  '9', '-', 'e',  '.',  '[', '\x80', '\xff'};
  for (int k = 1 + static_cast<int>(rng() % 4); k > 0 && !s->empty(); --k) {
    const size_t at = rng() % s->size();
    switch (rng() % 7) {
      case 0:
        (*s)[at] = kBytes[rng() % sizeof(kBytes)];
        break;
      case 1:
        (*s)[at] = static_cast<char>(rng());
        break;
      case 2:
        s->resize(at);
        break;
      case 3:
        s->insert(at, "\r\n");
        break;
      case 4: {  // duplicate or drop a line
        const size_t b = s->rfind('\n', at), e = s->find('\n', at);
        const size_t from = b == std::string::npos ? 0 : b + 1;
        const size_t to = e == std::string::npos ? s->size() : e + 1;
        if (rng() % 2) {
          s->insert(from, s->substr(from, to - from));
        } else {
          s->erase(from, to - from);
        }
        break;
      }
      default:
        ReplaceValue(s, rng, jsonl);
        break;
    }
  }
}

// The checks on one parse result; `what` describes the case for failure messages.
void Check(const Result<Manifest>& r, const std::string& text, const std::string& name, bool skip,
           const std::string& what) {
  if (!r.ok()) {
    const Failure& f = r.failure();
    ASSERT_EQ(f.file, name) << what;
    // CSV also ends a line at a lone '\r': an upper bound on the lines of either format.
    const long long lines =
        1 + std::count(text.begin(), text.end(), '\n') + std::count(text.begin(), text.end(), '\r');
    ASSERT_GE(f.line, 1) << what << f.ToString();
    ASSERT_LE(f.line, lines) << what << f.ToString();
    return;
  }
  const Manifest& m = *r;
  ASSERT_EQ(m.samples.size(), m.ids.size()) << what;
  ASSERT_EQ(static_cast<int64_t>(m.samples.size()) + m.rows_skipped, m.rows_total) << what;
  if (!skip) ASSERT_EQ(m.rows_skipped, 0) << what;
  for (size_t i = 0; i < m.samples.size(); ++i) {
    const RawSample& s = m.samples[i];
    ASSERT_GE(s.num_frames, 1) << what;
    ASSERT_GE(s.height, 1) << what;
    ASSERT_GE(s.width, 1) << what;
    if (s.num_frames == 1) {
      ASSERT_EQ(s.fps, 0.f) << what;
    } else {
      ASSERT_TRUE(std::isfinite(s.fps)) << what;
      ASSERT_GE(s.fps, static_cast<float>(kMinVideoFps)) << what;
      ASSERT_LE(s.fps, static_cast<float>(kMaxFps)) << what;
    }
    ASSERT_GE(m.ids[i], i == 0 ? 0 : m.ids[i - 1] + 1) << what;
    ASSERT_LT(m.ids[i], m.rows_total) << what;
  }
}

bool SameManifest(const Result<Manifest>& a, const Result<Manifest>& b) {
  if (a.ok() != b.ok()) return false;
  if (!a.ok()) return a.failure().ToString() == b.failure().ToString();
  if (a->ids != b->ids || a->rows_total != b->rows_total || a->rows_skipped != b->rows_skipped ||
      a->skipped_examples != b->skipped_examples || a->samples.size() != b->samples.size()) {
    return false;
  }
  for (size_t i = 0; i < a->samples.size(); ++i) {
    const RawSample &x = a->samples[i], &y = b->samples[i];
    if (x.num_frames != y.num_frames || x.height != y.height || x.width != y.width ||
        x.fps != y.fps) {
      return false;
    }
  }
  return true;
}

TEST(ManifestFuzz, MutatedManifestsFailWithALineOrPassTheFieldRules) {
  std::mt19937_64 rng(20261202);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(2000);
  int cases = 0, failures = 0;
  for (; cases < 20000 && std::chrono::steady_clock::now() < deadline; ++cases) {
    const bool jsonl = cases % 2 == 1;
    const std::string name = jsonl ? "fuzz.jsonl" : "fuzz.csv";
    std::string text = jsonl ? SeedJsonl(rng) : SeedCsv(rng);
    Mutate(&text, rng, jsonl);
    for (bool skip : {false, true}) {
      const std::string what = "case " + std::to_string(cases) + (skip ? " skip: " : ": ");
      ManifestOptions o;
      o.skip_bad_rows = skip;
      try {
        auto r = ParseManifest(text, name, o);
        failures += !r.ok();
        Check(r, text, name, skip, what);
        if (!jsonl) {
          internal::CsvParseOptions two;
          two.force_parallel = true;
          auto p = internal::ParseCsvManifest(text, name, o, two);
          ASSERT_TRUE(SameManifest(r, p)) << what << "two threads differ from one pass";
          internal::CsvParseOptions general;
          general.plain_fast_path = false;
          auto g = internal::ParseCsvManifest(text, name, o, general);
          ASSERT_TRUE(SameManifest(r, g)) << what << "the fast path differs from the scanner";
        }
      } catch (const std::exception& e) {
        FAIL() << what << "exception: " << e.what();
      }
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  std::printf("%d mutated manifests, %d strict/skip parses failed\n", cases, failures);
  EXPECT_GT(cases, 200);
}

}  // namespace
}  // namespace ditscale::balance
