// A bounded fuzz test of the Parquet manifest reader (fixed seed, ~2 s): valid Parquet manifests
// (random rows with hostile values and nulls; plain and dictionary-encoded pages, uncompressed
// and compressed, one or several row groups) are written by Arrow, their bytes mutated (bit
// flips, random bytes, truncation, inserted, deleted and copied runs), and each result must be
// either a Failure naming the file, or a manifest whose every row passes the field rules of
// manifest.h, in strict and skip mode; a strict success is the skip result with nothing skipped.
// Never a crash, never an exception.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "ditscale/balance/internal/parquet_manifest.h"
#include "ditscale/balance/manifest.h"

#if DITSCALE_HAVE_PARQUET
#include <arrow/builder.h>
#include <arrow/io/memory.h>
#include <arrow/table.h>
#include <arrow/util/compression.h>
#include <parquet/arrow/writer.h>
#endif

namespace ditscale::balance {
namespace {

#if DITSCALE_HAVE_PARQUET

// A random manifest of `rows` rows as Parquet bytes; `variant` picks the encodings, odd variants
// have a hostile value or null in about one row of 30.
std::string SeedParquet(std::mt19937_64& rng, int rows, int variant) {
  arrow::StringBuilder path;
  arrow::Int64Builder frames;
  arrow::Int32Builder height;
  arrow::DoubleBuilder width, fps;
  static const double kOdd[] = {0, -1, 2147483648.0, 1e39, NAN, INFINITY, 81.5, 1e-50, 1e6 + 1};
  for (int r = 0; r < rows; ++r) {
    const bool image = rng() % 3 == 0;
    const bool odd = variant % 2 == 1 && rng() % 60 == 0;
    (void)(variant % 2 == 1 && rng() % 60 == 0 ? path.AppendNull()
                                               : path.Append("v" + std::to_string(r % 5) + ".mp4"));
    (void)(odd && rng() % 2 ? frames.Append(static_cast<int64_t>(rng()))
                            : frames.Append(image ? 1 : 2 + static_cast<int64_t>(rng() % 300)));
    (void)height.Append(16 + static_cast<int32_t>(rng() % 2000));
    (void)(odd ? width.Append(kOdd[rng() % std::size(kOdd)])
               : width.Append(16 + static_cast<double>(rng() % 2000)));
    (void)(image && rng() % 2 ? fps.AppendNull()  // a null fps is fine for an image
                              : fps.Append(odd ? kOdd[rng() % std::size(kOdd)]
                                               : 1 + static_cast<double>(rng() % 60) + 0.5));
  }
  std::shared_ptr<arrow::Array> a[5];
  (void)path.Finish(&a[0]);
  (void)frames.Finish(&a[1]);
  (void)height.Finish(&a[2]);
  (void)width.Finish(&a[3]);
  (void)fps.Finish(&a[4]);
  auto schema =
      arrow::schema({arrow::field("path", a[0]->type()), arrow::field("num_frames", a[1]->type()),
                     arrow::field("height", a[2]->type()), arrow::field("width", a[3]->type()),
                     arrow::field("fps", a[4]->type())});
  auto table = arrow::Table::Make(schema, {a[0], a[1], a[2], a[3], a[4]});
  parquet::WriterProperties::Builder props;
  static const arrow::Compression::type kCodecs[] = {
      arrow::Compression::UNCOMPRESSED, arrow::Compression::SNAPPY, arrow::Compression::ZSTD};
  const auto codec = kCodecs[variant % 3];
  props.compression(arrow::util::Codec::IsAvailable(codec) ? codec
                                                           : arrow::Compression::UNCOMPRESSED);
  if ((variant / 3) % 2 == 1) props.disable_dictionary();
  if (variant % 4 == 3) props.data_page_version(parquet::ParquetDataPageVersion::V2);
  auto sink = arrow::io::BufferOutputStream::Create().ValueOrDie();
  const int64_t group_rows = variant % 5 == 0 ? 7 : 1 << 20;
  EXPECT_TRUE(parquet::arrow::WriteTable(*table, arrow::default_memory_pool(), sink, group_rows,
                                         props.build())
                  .ok());
  return sink->Finish().ValueOrDie()->ToString();
}

void Mutate(std::string* s, std::mt19937_64& rng) {
  for (int k = 1 + static_cast<int>(rng() % 3); k > 0 && !s->empty(); --k) {
    const size_t at = rng() % s->size();
    switch (rng() % 6) {
      case 0:
        (*s)[at] = static_cast<char>((*s)[at] ^ (1 << (rng() % 8)));
        break;
      case 1:
        (*s)[at] = static_cast<char>(rng());
        break;
      case 2:
        s->resize(at);
        break;
      case 3:
        s->insert(at, std::string(1 + rng() % 16, static_cast<char>(rng())));
        break;
      case 4:
        s->erase(at, 1 + rng() % 16);
        break;
      default: {  // a run copied over another place
        const size_t from = rng() % s->size(), len = 1 + rng() % 32;
        const std::string run = s->substr(from, len);
        s->replace(at, std::min(run.size(), s->size() - at), run);
        break;
      }
    }
  }
}

void Check(const Result<Manifest>& r, const std::string& name, bool skip, const std::string& what) {
  if (!r.ok()) {
    ASSERT_EQ(r.failure().file, name) << what;
    ASSERT_GE(r.failure().line, 0) << what;
    ASSERT_FALSE(r.failure().message.empty()) << what;
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

TEST(ParquetManifestFuzz, MutatedFilesFailNamingTheFileOrPassTheFieldRules) {
  std::mt19937_64 rng(20261203);
  const std::string name = "fuzz.parquet";
  std::vector<std::string> seeds;
  for (int v = 0; v < 12; ++v)
    seeds.push_back(SeedParquet(rng, 10 + static_cast<int>(rng() % 40), v));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(2000);
  int cases = 0, failures = 0;
  for (; cases < 20000 && std::chrono::steady_clock::now() < deadline; ++cases) {
    std::string bytes = seeds[cases % seeds.size()];
    if (cases >= static_cast<int>(seeds.size())) Mutate(&bytes, rng);
    Result<Manifest> strict = Failure{};
    for (bool skip : {false, true}) {
      const std::string what = "case " + std::to_string(cases) + (skip ? " skip: " : ": ");
      ManifestOptions o;
      o.skip_bad_rows = skip;
      try {
        auto r = ParseManifest(bytes, name, o);
        failures += !r.ok();
        Check(r, name, skip, what);
        if (!skip) {
          strict = std::move(r);
        } else if (strict.ok()) {
          ASSERT_TRUE(r.ok()) << what << r.failure().ToString();
          ASSERT_EQ(r->ids, strict->ids) << what;
          ASSERT_EQ(r->rows_skipped, 0) << what;
        }
      } catch (const std::exception& e) {
        FAIL() << what << "exception: " << e.what();
      }
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  std::printf("%d mutated Parquet manifests, %d strict/skip parses failed\n", cases, failures);
  EXPECT_GT(cases, 100);
}

#else

TEST(ParquetManifestFuzz, BuiltWithoutParquet) {
  EXPECT_FALSE(internal::ParquetSupported());
  EXPECT_FALSE(ParseManifest("PAR1", "fuzz.parquet").ok());
}

#endif

}  // namespace
}  // namespace ditscale::balance
