// The Parquet manifest reader: the same rows, field rules, messages (with the row as the line)
// and skip behaviour as the CSV reader; the schema's columns and types; files that are not
// Parquet; the Arrow-stream entry; the "built without Parquet support" failure of a build
// without Arrow; the reader module's loading (internal/parquet_plugin.h). Files are written with
// Arrow's Parquet writer.
#include "ditscale/balance/internal/parquet_manifest.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "ditscale/balance/internal/parquet_plugin.h"
#include "ditscale/balance/manifest.h"

#if DITSCALE_HAVE_PARQUET
#include <arrow/array.h>
#include <arrow/builder.h>
#include <arrow/c/abi.h>
#include <arrow/c/bridge.h>
#include <arrow/io/file.h>
#include <arrow/io/memory.h>
#include <arrow/record_batch.h>
#include <arrow/table.h>
#include <parquet/arrow/reader.h>
#include <parquet/arrow/writer.h>
#endif

namespace ditscale::balance {
namespace {

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "pq_" + std::to_string(getpid()) + "_" + name;
}

#if !DITSCALE_HAVE_PARQUET

TEST(ParquetManifest, BuiltWithoutParquetSaysSoNamingTheFile) {
  EXPECT_FALSE(internal::ParquetSupported());
  auto r = ReadManifest("m.parquet");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.failure().file, "m.parquet");
  EXPECT_NE(r.failure().message.find("built without Parquet support"), std::string::npos);
}

#else

TEST(ParquetPlugin, TheBuildsModuleLoadsWithThisLayout) {
  const internal::ParquetPluginLoad& load = internal::ParquetPlugin();
  ASSERT_NE(load.table, nullptr) << load.error;
  EXPECT_EQ(load.table->version, internal::kParquetTableVersion);
  EXPECT_TRUE(internal::ParquetSupported());
}

TEST(ParquetPlugin, AModuleThatCannotLoadIsNamedWithTheLoadersWords) {
  const std::string missing = TempPath("nowhere/libditscale_parquet.so");
  const std::string not_elf = TempPath("not_a_module.so");
  std::ofstream(not_elf) << "not an ELF file";
  auto load = internal::LoadParquetPlugin({missing, not_elf});
  EXPECT_EQ(load.table, nullptr);
  EXPECT_NE(load.error.find(missing), std::string::npos) << load.error;
  EXPECT_NE(load.error.find(not_elf), std::string::npos) << load.error;
  EXPECT_EQ(internal::LoadParquetPlugin({}).error, "no place to look for it");
  // A loadable library without the table (the C library) is refused too.
  load = internal::LoadParquetPlugin({"libc.so.6"});
  EXPECT_EQ(load.table, nullptr);
  EXPECT_NE(load.error.find("no ditscale_parquet_reader_table"), std::string::npos) << load.error;
  // The first candidate that loads wins; the failures before it are forgotten.
  const std::vector<std::string> found = internal::ParquetPluginCandidates();
  ASSERT_FALSE(found.empty());
  std::vector<std::string> tried = {missing};
  tried.insert(tried.end(), found.begin(), found.end());
  load = internal::LoadParquetPlugin(tried);
  EXPECT_NE(load.table, nullptr) << load.error;
  EXPECT_EQ(load.error, "");
  std::remove(not_elf.c_str());
}

// One column: its name, Arrow type and cells (nullopt: null), written in the type.
struct Col {
  std::string name;
  std::shared_ptr<arrow::DataType> type;
  std::vector<std::optional<std::string> > cells;
};

template <typename B, typename F>
std::shared_ptr<arrow::Array> Build(B builder, const Col& c, F parse) {
  for (const auto& x : c.cells) {
    arrow::Status st = x ? builder.Append(parse(*x)) : builder.AppendNull();
    EXPECT_TRUE(st.ok()) << st.ToString();
  }
  std::shared_ptr<arrow::Array> out;
  EXPECT_TRUE(builder.Finish(&out).ok());
  return out;
}

std::shared_ptr<arrow::Array> ArrayOf(const Col& c) {
  using T = arrow::Type;
  auto str = [](const std::string& s) { return s; };
  auto i64 = [](const std::string& s) { return std::stoll(s); };
  auto u64 = [](const std::string& s) { return std::stoull(s); };
  auto f64 = [](const std::string& s) { return std::stod(s); };
  switch (c.type->id()) {
    case T::STRING:
      return Build(arrow::StringBuilder(), c, str);
    case T::LARGE_STRING:
      return Build(arrow::LargeStringBuilder(), c, str);
    case T::BINARY:
      return Build(arrow::BinaryBuilder(), c, str);
    case T::INT8:
      return Build(arrow::Int8Builder(), c, i64);
    case T::INT32:
      return Build(arrow::Int32Builder(), c, i64);
    case T::INT64:
      return Build(arrow::Int64Builder(), c, i64);
    case T::UINT16:
      return Build(arrow::UInt16Builder(), c, u64);
    case T::UINT64:
      return Build(arrow::UInt64Builder(), c, u64);
    case T::FLOAT:
      return Build(arrow::FloatBuilder(), c, [](const std::string& s) { return std::stof(s); });
    case T::DOUBLE:
      return Build(arrow::DoubleBuilder(), c, f64);
    case T::BOOL:
      return Build(arrow::BooleanBuilder(), c, [](const std::string& s) { return s == "1"; });
    case T::DICTIONARY:
      return Build(arrow::StringDictionaryBuilder(), c, str);
    default:
      ADD_FAILURE() << "no builder for " << c.type->ToString();
      return nullptr;
  }
}

std::shared_ptr<arrow::Table> TableOf(const std::vector<Col>& cols) {
  arrow::FieldVector fields;
  arrow::ArrayVector arrays;
  for (const Col& c : cols) {
    arrays.push_back(ArrayOf(c));
    fields.push_back(arrow::field(c.name, arrays.back()->type()));
  }
  return arrow::Table::Make(arrow::schema(fields), arrays);
}

// The Parquet bytes of `cols` (row groups of `group_rows` rows; the Arrow schema stored, as
// pyarrow does, so dictionary and large_string columns read back as such).
std::string ParquetBytes(const std::vector<Col>& cols, int64_t group_rows = 1 << 20) {
  auto sink = arrow::io::BufferOutputStream::Create().ValueOrDie();
  auto st =
      parquet::arrow::WriteTable(*TableOf(cols), arrow::default_memory_pool(), sink, group_rows,
                                 parquet::default_writer_properties(),
                                 parquet::ArrowWriterProperties::Builder().store_schema()->build());
  EXPECT_TRUE(st.ok()) << st.ToString();
  auto buf = sink->Finish().ValueOrDie();
  return buf->ToString();
}

// The Arrow type that a reader of `bytes` sees for column `name`.
std::string ArrowTypeIn(const std::string& bytes, const std::string& name) {
  auto in = std::make_shared<arrow::io::BufferReader>(std::make_shared<arrow::Buffer>(bytes));
  auto reader = parquet::arrow::OpenFile(in, arrow::default_memory_pool()).ValueOrDie();
  std::shared_ptr<arrow::Schema> schema;
  EXPECT_TRUE(reader->GetSchema(&schema).ok());
  return schema->GetFieldByName(name)->type()->ToString();
}

std::string WriteFile(const std::string& name, const std::string& bytes) {
  const std::string path = TempPath(name);
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

Result<Manifest> Parse(const std::string& bytes, bool skip = false) {
  ManifestOptions o;
  o.skip_bad_rows = skip;
  return ParseManifest(bytes, "m.parquet", o);
}

std::optional<std::string> S(const char* s) { return std::string(s); }

// The five columns of `rows` (CSV cells; "" in a numeric column is null), numbers as the types
// given.
std::vector<Col> Columns(const std::vector<std::array<std::string, 5> >& rows,
                         std::array<std::shared_ptr<arrow::DataType>, 5> types) {
  static const char* kNames[] = {"path", "num_frames", "height", "width", "fps"};
  std::vector<Col> cols;
  for (int c = 0; c < 5; ++c) {
    Col col{kNames[c], types[c], {}};
    for (const auto& r : rows) {
      if (c > 0 && r[c].empty()) {
        col.cells.push_back(std::nullopt);
      } else {
        col.cells.push_back(r[c]);
      }
    }
    cols.push_back(std::move(col));
  }
  return cols;
}

TEST(ParquetManifest, SameSamplesAsCsvAcrossTypesRowGroupsAndBatches) {
  std::mt19937_64 rng(7);
  std::string csv = "fps,caption,path,height,num_frames,width\n";
  Col path{"path", arrow::dictionary(arrow::int32(), arrow::utf8()), {}};
  Col frames{"num_frames", arrow::int64(), {}}, height{"height", arrow::uint16(), {}};
  Col width{"width", arrow::float64(), {}}, fps{"fps", arrow::float32(), {}};
  Col caption{"caption", arrow::utf8(), {}};
  const int n = 150000;  // three record batches, four row groups
  for (int i = 0; i < n; ++i) {
    const bool image = rng() % 3 == 0;
    const std::string f = image ? "1" : std::to_string(2 + rng() % 200);
    const std::string h = std::to_string(16 + rng() % 2000), w = std::to_string(16 + rng() % 2000);
    const std::string r = image ? "" : std::to_string(1 + rng() % 60) + ".976";
    const std::string p = "clip" + std::to_string(i % 97) + ".mp4";
    csv += r + ",\"a, caption\"," + p + "," + h + "," + f + "," + w + "\n";
    path.cells.push_back(p);
    frames.cells.push_back(f);
    height.cells.push_back(h);
    width.cells.push_back(w);
    fps.cells.push_back(image ? std::nullopt : std::optional<std::string>(r));
    caption.cells.push_back("a, caption");
  }
  const std::string bytes = ParquetBytes({fps, caption, path, height, frames, width}, 40000);
  ASSERT_EQ(ArrowTypeIn(bytes, "path").substr(0, 25), "dictionary<values=string,");
  ASSERT_EQ(ArrowTypeIn(bytes, "height"), "uint16");
  auto a = ParseManifest(csv, "m.csv");
  auto b = Parse(bytes);
  ASSERT_TRUE(a.ok()) << a.failure().ToString();
  ASSERT_TRUE(b.ok()) << b.failure().ToString();
  ASSERT_EQ(b->samples.size(), static_cast<size_t>(n));
  EXPECT_EQ(a->ids, b->ids);
  EXPECT_EQ(b->rows_total, n);
  for (int i = 0; i < n; ++i) {
    const RawSample &x = a->samples[i], &y = b->samples[i];
    ASSERT_EQ(x.num_frames, y.num_frames) << i;
    ASSERT_EQ(x.height, y.height) << i;
    ASSERT_EQ(x.width, y.width) << i;
    ASSERT_EQ(x.fps, y.fps) << i;  // float32 23.976 == float(double 23.976)
  }
  // The same file on disk, by either extension or by the format option.
  for (const std::string name : {"m.parquet", "m.pq", "m.bin"}) {
    const std::string p = WriteFile(name, bytes);
    ManifestOptions o;
    if (name == "m.bin") o.format = "parquet";
    auto c = ReadManifest(p, o);
    ASSERT_TRUE(c.ok()) << c.failure().ToString();
    EXPECT_EQ(c->source, p);
    EXPECT_EQ(c->ids, b->ids);
    unlink(p.c_str());
  }
}

// The bad-row cases of the CSV tests (manifest_test.cc), each in a column of the type that can
// hold it: row 2 is bad, row 1 good; strict mode names row 2 and the column, skip mode skips it.
struct BadCase {
  int slot;
  std::shared_ptr<arrow::DataType> type;
  std::optional<std::string> value;
  std::string column, message;
  std::string frames = "81";  // the bad row's num_frames when slot != 1
};

TEST(ParquetManifest, EachBadRowKindNamesRowAndColumn) {
  const auto i64 = arrow::int64(), f64 = arrow::float64(), u64 = arrow::uint64();
  const std::string dim = " is out of range [1, 2147483647]";
  const std::string video = " is out of range [0.001, 1e+06] for a video (num_frames > 1)";
  const std::vector<BadCase> cases = {
      {0, arrow::utf8(), S(""), "path", "missing value"},
      {0, arrow::utf8(), S(" \t "), "path", "missing value"},
      {0, arrow::utf8(), std::nullopt, "path", "missing value"},
      {1, i64, std::nullopt, "num_frames", "missing value"},
      {1, i64, S("0"), "num_frames", "'0'" + dim},
      {2, i64, S("-480"), "height", "'-480'" + dim},
      {3, i64, S("0"), "width", "'0'" + dim},
      {1, f64, S("81.5"), "num_frames", "not an integer: '81.5'"},
      {3, f64, S("nan"), "width", "'nan'" + dim},
      {4, f64, S("inf"), "fps", "'inf'" + video},
      {4, f64, std::nullopt, "fps", "missing fps for a video (num_frames > 1)"},
      {4, f64, S("0"), "fps", "'0'" + video},
      {4, f64, S("-5"), "fps", "'-5'" + video},
      {1, i64, S("99999999999"), "num_frames", "'99999999999'" + dim},
      {4, f64, S("1e39"), "fps", "'1e+39'" + video},
      {4, f64, S("1e-50"), "fps", "'1e-50'" + video},
      {4, f64, S("-5"), "fps", "'-5' is out of range [0, 1e+06]", "1"},
      {4, f64, S("1000001"), "fps", "'1000001'" + video},
      {1, i64, S("2147483648"), "num_frames", "'2147483648'" + dim},
      {2, u64, S("9223372036854775808"), "height", "'9223372036854775808'" + dim},
      {3, u64, S("18446744073709551615"), "width", "'18446744073709551615'" + dim},
      {3, f64, S("1e300"), "width", "'1e+300'" + dim},
      {1, arrow::int8(), S("-1"), "num_frames", "'-1'" + dim},
  };
  for (const BadCase& c : cases) {
    std::vector<std::array<std::string, 5> > rows = {{"a.mp4", "81", "8", "8", "16"},
                                                     {"b.mp4", c.frames, "8", "8", "16"}};
    std::array<std::shared_ptr<arrow::DataType>, 5> types = {arrow::utf8(), i64, i64, i64, f64};
    types[c.slot] = c.type;
    auto cols = Columns(rows, types);
    cols[c.slot].cells[1] = c.value;
    const std::string what = c.column + " " + (c.value ? *c.value : "null");
    auto r = Parse(ParquetBytes(cols));
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.failure().ToString(), "m.parquet:2: column '" + c.column + "': " + c.message)
        << what;
    auto s = Parse(ParquetBytes(cols), true);
    ASSERT_TRUE(s.ok()) << what << ": " << s.failure().ToString();
    EXPECT_EQ(s->rows_total, 2) << what;
    EXPECT_EQ(s->rows_skipped, 1) << what;
    EXPECT_EQ(s->ids, std::vector<int64_t>{0}) << what;
    ASSERT_EQ(s->skipped_examples.size(), 1u);
    EXPECT_EQ(s->skipped_examples[0], r.failure().ToString());
  }
}

TEST(ParquetManifest, NumbersAsCsvReadsThem) {
  // 81.0 is 81; an image's fps may be null or a number in [0, 1e6]; float16 and int8 columns.
  auto cols = Columns(
      {{"a", "81", "8", "8", "16"}, {"b", "1", "8", "8", ""}, {"c", "1", "8", "8", "0"}},
      {arrow::large_utf8(), arrow::float64(), arrow::int8(), arrow::int32(), arrow::float32()});
  cols[1].cells[0] = "81.0";
  const std::string bytes = ParquetBytes(cols);
  ASSERT_EQ(ArrowTypeIn(bytes, "path"), "large_string");
  auto r = Parse(bytes);
  ASSERT_TRUE(r.ok()) << r.failure().ToString();
  ASSERT_EQ(r->samples.size(), 3u);
  EXPECT_EQ(r->samples[0].num_frames, 81);
  EXPECT_EQ(r->samples[0].fps, 16.f);
  EXPECT_EQ(r->samples[1].fps, 0.f);
  EXPECT_EQ(r->samples[2].fps, 0.f);
}

TEST(ParquetManifest, SkipModeKeepsTheFirstTenReasonsAndStableIds) {
  std::vector<std::array<std::string, 5> > rows;
  for (int i = 0; i < 30; ++i) rows.push_back({"v", i % 2 ? "0" : "5", "8", "8", "30"});
  auto cols = Columns(
      rows, {arrow::utf8(), arrow::int32(), arrow::int32(), arrow::int32(), arrow::float64()});
  auto r = Parse(ParquetBytes(cols), true);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->rows_total, 30);
  EXPECT_EQ(r->rows_skipped, 15);
  ASSERT_EQ(r->skipped_examples.size(), 10u);
  EXPECT_EQ(r->skipped_examples[0], "m.parquet:2: column 'num_frames': '0'" +
                                        std::string(" is out of range [1, 2147483647]"));
  EXPECT_EQ(r->skipped_examples[9].substr(0, 13), "m.parquet:20:");
  for (size_t i = 0; i < r->ids.size(); ++i) EXPECT_EQ(r->ids[i], 2 * static_cast<int64_t>(i));
}

TEST(ParquetManifest, SchemaErrorsNameTheColumnAndItsArrowType) {
  const auto i64 = arrow::int64();
  auto good = Columns({{"a", "1", "8", "8", ""}}, {arrow::utf8(), i64, i64, i64, arrow::float64()});
  auto fail = [](const std::vector<Col>& cols) {
    auto r = Parse(ParquetBytes(cols));
    EXPECT_FALSE(r.ok());
    return r.ok() ? std::string() : r.failure().ToString();
  };
  auto no_fps = good;
  no_fps.pop_back();
  EXPECT_EQ(fail(no_fps),
            "m.parquet: column 'fps': schema lacks required column (need path, "
            "num_frames, height, width, fps)");
  auto twice = good;
  twice.push_back(good[2]);
  EXPECT_EQ(fail(twice), "m.parquet: column 'height': duplicate column in the schema");
  auto text = good;
  text[1] = Col{"num_frames", arrow::utf8(), {S("1")}};
  EXPECT_EQ(fail(text),
            "m.parquet: column 'num_frames': Arrow type string is not allowed "
            "(expected an integer or floating-point type, or a dictionary of them)");
  auto flag = good;
  flag[4] = Col{"fps", arrow::boolean(), {S("1")}};
  EXPECT_NE(fail(flag).find("column 'fps': Arrow type bool is not allowed"), std::string::npos);
  auto bin = good;
  bin[0] = Col{"path", arrow::binary(), {S("a")}};
  EXPECT_EQ(fail(bin),
            "m.parquet: column 'path': Arrow type binary is not allowed (expected "
            "string, large_string or string_view, or a dictionary of them)");
}

TEST(ParquetManifest, FilesThatAreNotParquetNameTheFile) {
  const auto i64 = arrow::int64();
  const std::string bytes = ParquetBytes(
      Columns({{"a", "1", "8", "8", ""}}, {arrow::utf8(), i64, i64, i64, arrow::float64()}));
  auto check = [](const std::string& data, const std::string& want) {
    const std::string p = WriteFile("bad.parquet", data);
    auto r = ReadManifest(p);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.failure().file, p);
    EXPECT_NE(r.failure().message.find(want), std::string::npos) << r.failure().ToString();
    unlink(p.c_str());
  };
  check("path,num_frames,height,width,fps\na,1,8,8,\n", "not a Parquet file, or truncated");
  check("", "not a Parquet file, or truncated");
  check(bytes.substr(0, bytes.size() / 2), "not a Parquet file, or truncated");
  check(bytes.substr(0, bytes.size() - 1), "not a Parquet file, or truncated");
  // The directory, a FIFO (never opened for reading past the check), a missing file.
  auto dir = ReadManifest("/", ManifestOptions{false, "parquet"});
  ASSERT_FALSE(dir.ok());
  EXPECT_EQ(dir.failure().ToString(), "/: is a directory, not a manifest file");
  const std::string fifo = TempPath("fifo.parquet");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  // O_RDONLY on a FIFO blocks until a writer opens it: open one end here without blocking.
  const int w = ::open(fifo.c_str(), O_RDWR);
  auto f = ReadManifest(fifo);
  ::close(w);
  unlink(fifo.c_str());
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.failure().message.find("not a regular file"), std::string::npos);
  auto missing = ReadManifest(TempPath("none.parquet"));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.failure().message.find("cannot open"), std::string::npos);
}

TEST(ParquetManifest, ArrowStreamGivesWhatTheFileGives) {
  const auto i64 = arrow::int64();
  auto cols =
      Columns({{"a", "81", "8", "8", "16"}, {"b", "0", "8", "8", "16"}, {"c", "1", "8", "8", ""}},
              {arrow::utf8(), i64, i64, i64, arrow::float64()});
  ManifestOptions skip;
  skip.skip_bad_rows = true;
  auto file = ParseManifest(ParquetBytes(cols), "t", ManifestOptions{true, "parquet"});
  ASSERT_TRUE(file.ok());
  auto table = TableOf(cols);
  auto reader = std::make_shared<arrow::TableBatchReader>(table);
  reader->set_chunksize(2);  // two batches: rows are numbered across them
  ArrowArrayStream stream;
  ASSERT_TRUE(arrow::ExportRecordBatchReader(reader, &stream).ok());
  auto s = internal::ReadArrowStreamManifest(&stream, "t", skip);
  EXPECT_EQ(stream.release, nullptr);  // consumed
  ASSERT_TRUE(s.ok()) << s.failure().ToString();
  EXPECT_EQ(s->ids, file->ids);
  EXPECT_EQ(s->skipped_examples, file->skipped_examples);
  EXPECT_EQ(s->skipped_examples[0].substr(0, 4), "t:2:");
  // A stream without a required column fails like the file, and is released too.
  auto cut = TableOf({cols[0], cols[1], cols[2], cols[3]});
  ASSERT_TRUE(
      arrow::ExportRecordBatchReader(std::make_shared<arrow::TableBatchReader>(cut), &stream).ok());
  auto f = internal::ReadArrowStreamManifest(&stream, "t", skip);
  EXPECT_EQ(stream.release, nullptr);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.failure().column, "fps");
  auto none = internal::ReadArrowStreamManifest(&stream, "t", skip);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.failure().message.find("no Arrow stream"), std::string::npos);
}

#endif  // DITSCALE_HAVE_PARQUET

}  // namespace
}  // namespace ditscale::balance
