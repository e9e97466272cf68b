// ReadShapedManifest must give exactly ReadManifest + ShapeManifest: the same shapes, indices,
// ids, counts and row counts, the same Failure, the same refused-sample error, on one thread
// and on two, on well-formed and hostile files, CSV and (through the fallback) JSONL.
#include "ditscale/balance/shaped_reader.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <string>

#include "ditscale/balance/internal/csv_manifest.h"
#include "ditscale/balance/internal/random_csv_test_util.h"
#include "ditscale/core/error.h"

namespace ditscale::balance {
namespace {

// One outcome of reading + shaping: the shaped manifest with its counts, or the message.
struct Outcome {
  std::optional<ShapedManifest> shaped;
  Manifest rows;
  std::string error;  // Failure::ToString() or the thrown Error's text
};

Outcome Reference(std::string_view text, const ModelPreset& model, const ManifestOptions& o) {
  Outcome out;
  auto m = ParseManifest(text, "m.csv", o);
  if (!m.ok()) {
    out.error = m.failure().ToString();
    return out;
  }
  try {
    out.shaped = ShapeManifest(*m, model);
  } catch (const Error& e) {
    out.error = e.what();
    return out;
  }
  out.rows = std::move(*m);
  return out;
}

Outcome Fused(std::string_view text, const ModelPreset& model, const ManifestOptions& o,
              const internal::CsvParseOptions& csv) {
  Outcome out;
  try {
    auto s = internal::ShapeCsvText(text, "m.csv", model, o, csv, &out.rows);
    if (!s.ok()) {
      out.error = s.failure().ToString();
    } else {
      out.shaped = std::move(*s);
    }
  } catch (const Error& e) {
    out.error = e.what();
  }
  return out;
}

// The sample ids of every entry (ShapedManifest::id), dense or stored.
std::vector<int64_t> Ids(const ShapedManifest& s) {
  std::vector<int64_t> ids;
  for (size_t i = 0; i < s.shape_of.size(); ++i) ids.push_back(s.id(i));
  return ids;
}

void ExpectSame(const Outcome& a, const Outcome& b, const std::string& ctx) {
  ASSERT_EQ(a.shaped.has_value(), b.shaped.has_value()) << ctx << ": " << a.error << b.error;
  EXPECT_EQ(a.error, b.error) << ctx;
  if (!a.shaped) return;
  EXPECT_EQ(a.rows.source, b.rows.source) << ctx;
  EXPECT_EQ(a.rows.rows_total, b.rows.rows_total) << ctx;
  EXPECT_EQ(a.rows.rows_skipped, b.rows.rows_skipped) << ctx;
  EXPECT_EQ(a.rows.skipped_examples, b.rows.skipped_examples) << ctx;
  EXPECT_TRUE(b.rows.samples.empty() && b.rows.ids.empty()) << ctx;
  EXPECT_EQ(a.shaped->shapes, b.shaped->shapes) << ctx;
  EXPECT_EQ(a.shaped->shape_of, b.shaped->shape_of) << ctx;
  EXPECT_EQ(Ids(*a.shaped), Ids(*b.shaped)) << ctx;
  // The reader stores no ids when no row was skipped; ShapeManifest always does.
  EXPECT_EQ(b.shaped->ids_dense, b.rows.rows_skipped == 0) << ctx;
  EXPECT_TRUE(!b.shaped->ids_dense || b.shaped->ids.empty()) << ctx;
  EXPECT_EQ(a.shaped->count, b.shaped->count) << ctx;
}

// A model without buckets (sizes kept, rounded to 16 px): a huge image has more than
// kMaxSeqLen tokens and is refused.
ModelPreset Unbucketed() {
  ModelPreset m = GetModelPreset("wan2.1-1.3b").value();
  m.buckets.clear();
  return m;
}

// Inserts `row` (with its '\n') after the k-th line end of text (or at the end).
std::string InsertRow(std::string text, size_t k, const std::string& row) {
  size_t pos = 0;
  for (size_t i = 0; i <= k; ++i) {
    const size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) {
      if (!text.empty() && text.back() != '\n') text += '\n';
      return text + row + "\n";
    }
    pos = nl + 1;
  }
  return text.insert(pos, row + "\n");
}

TEST(ShapedReader, EqualsReadThenShapeOnRandomHostileFiles) {
  std::mt19937_64 rng(std::random_device{}());
  internal::CsvParseOptions serial;
  serial.min_parallel_bytes = std::numeric_limits<size_t>::max();
  internal::CsvParseOptions parallel;
  parallel.force_parallel = true;
  const ModelPreset wan = GetModelPreset("wan2.1-1.3b").value();
  const ModelPreset flat = Unbucketed();
  int ok = 0, refused = 0, failed = 0;
  for (int iter = 0; iter < 300; ++iter) {
    const uint64_t seed = rng();
    std::mt19937_64 g(seed);
    const int nrows = 1 + static_cast<int>(g() % 60);
    std::string text = internal::RandomCsv(g, nrows, iter % 4 != 0);
    if (iter % 3 == 0) {  // a sample the unbucketed model refuses, anywhere
      text = InsertRow(text, 1 + g() % static_cast<uint64_t>(nrows),
                       "huge.jpg,c,1,2147483647,2147483647,,x");
    }
    for (bool skip : {false, true}) {
      ManifestOptions o;
      o.skip_bad_rows = skip;
      for (const ModelPreset* model : {&wan, &flat}) {
        const std::string ctx = "seed " + std::to_string(seed) + (skip ? " skip " : " strict ") +
                                (model == &wan ? "buckets" : "no buckets");
        const Outcome want = Reference(text, *model, o);
        ExpectSame(want, Fused(text, *model, o, serial), ctx + " one thread");
        ExpectSame(want, Fused(text, *model, o, parallel), ctx + " two threads");
        if (want.shaped) {
          ++ok;
        } else if (want.error.find("sample id") != std::string::npos) {
          ++refused;
        } else {
          ++failed;
        }
      }
    }
  }
  // The generator did produce every outcome.
  EXPECT_GT(ok, 0);
  EXPECT_GT(refused, 0);
  EXPECT_GT(failed, 0);
}

// The refused sample's id counts the rows of the first part (two threads, refusal in the second).
TEST(ShapedReader, RefusalInTheSecondPartNamesTheGlobalId) {
  std::string text = "path,num_frames,height,width,fps\n";
  for (int i = 0; i < 2000; ++i) text += "v" + std::to_string(i) + ".mp4,81,480,832,16\n";
  text += "huge.jpg,1,2147483647,2147483647,\n";
  internal::CsvParseOptions parallel;
  parallel.force_parallel = true;
  const Outcome got = Fused(text, Unbucketed(), {}, parallel);
  ASSERT_FALSE(got.shaped);
  EXPECT_EQ(got.error.rfind("m.csv: sample id 2000: tokens of sample", 0), 0u) << got.error;
  EXPECT_EQ(got.error, Reference(text, Unbucketed(), {}).error);
}

class TempFile {
 public:
  TempFile(const std::string& name, const std::string& text)
      : path_((std::filesystem::temp_directory_path() /
               ("ditscale_shaped_" + std::to_string(::getpid()) + "_" + name))
                  .string()) {
    std::ofstream(path_) << text;
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Through a file: CSV (fused) and JSONL (read, then shaped) give what ReadManifest +
// ShapeManifest give, and a missing file the same Failure.
TEST(ShapedReader, FilesEqualReadThenShape) {
  std::mt19937_64 g(11);
  const std::string csv_text = internal::RandomCsv(g, 300, /*hostile=*/false);
  const TempFile csv("m.csv", csv_text);
  const TempFile jsonl("m.jsonl",
                       "{\"path\":\"a.mp4\",\"num_frames\":81,\"height\":480,\"width\":832,"
                       "\"fps\":16}\n{\"path\":\"b.jpg\",\"num_frames\":1,\"height\":1024,"
                       "\"width\":768}\n{\"path\":\"c\",\"num_frames\":\"x\"}\n");
  const ModelPreset wan = GetModelPreset("wan2.1-1.3b").value();
  ManifestOptions skip;
  skip.skip_bad_rows = true;
  for (const std::string& path : {csv.path(), jsonl.path()}) {
    Manifest rows;
    auto got = ReadShapedManifest(path, wan, skip, &rows);
    ASSERT_TRUE(got.ok()) << got.failure().ToString();
    auto m = ReadManifest(path, skip);
    ASSERT_TRUE(m.ok());
    const ShapedManifest want = ShapeManifest(*m, wan);
    EXPECT_EQ(got->shapes, want.shapes) << path;
    EXPECT_EQ(got->shape_of, want.shape_of) << path;
    EXPECT_EQ(Ids(*got), want.ids) << path;
    EXPECT_EQ(got->count, want.count) << path;
    EXPECT_EQ(rows.rows_total, m->rows_total) << path;
    EXPECT_EQ(rows.rows_skipped, m->rows_skipped) << path;
    EXPECT_EQ(rows.skipped_examples, m->skipped_examples) << path;
  }
  Manifest rows;
  auto strict = ReadShapedManifest(jsonl.path(), wan, {}, &rows);
  ASSERT_FALSE(strict.ok());
  EXPECT_EQ(strict.failure().ToString(), ReadManifest(jsonl.path()).failure().ToString());
  auto missing = ReadShapedManifest(csv.path() + ".missing", wan, {}, &rows);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.failure().ToString(),
            ReadManifest(csv.path() + ".missing").failure().ToString());
}

}  // namespace
}  // namespace ditscale::balance
