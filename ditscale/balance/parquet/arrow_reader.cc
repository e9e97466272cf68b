// Parquet and Arrow-stream manifests through Arrow C++ (see internal/parquet_manifest.h): the
// schema is checked once, then each record batch's five columns are turned, row by row, into the
// FieldRefs of internal/manifest_rows.h (numbers written as CSV text), so every row goes through
// the same ValidateRow and RowSink as a CSV row. Built only into the plugin module
// libditscale_parquet.so (internal/parquet_plugin.h), whose one exported symbol is the table of
// the three readers below.
#include "ditscale/balance/internal/parquet_manifest.h"
#include "ditscale/balance/internal/parquet_plugin.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <exception>
#include <new>
#include <vector>

#include "ditscale/balance/internal/manifest_rows.h"

#include <arrow/array.h>
#include <arrow/c/abi.h>
#include <arrow/c/bridge.h>
#include <arrow/io/file.h>
#include <arrow/io/memory.h>
#include <arrow/record_batch.h>
#include <arrow/type.h>
#include <arrow/util/float16.h>
#include <parquet/arrow/reader.h>
#include <parquet/arrow/schema.h>
#include <parquet/file_reader.h>
#include <parquet/metadata.h>
#include <parquet/properties.h>

#include <charconv>
#include <memory>

namespace ditscale::balance::internal::arrow_reader {
namespace {

Failure InFile(const std::string& name, std::string message, long long line = 0,
               std::string column = {}) {
  return Failure::InFile(name, line, std::move(column), std::move(message));
}

}  // namespace


namespace {

// Whether Arrow type id `t` may hold a path (want_string) or a number.
bool Allowed(arrow::Type::type t, bool want_string) {
  using T = arrow::Type;
  if (want_string) return t == T::STRING || t == T::LARGE_STRING || t == T::STRING_VIEW;
  switch (t) {
    case T::INT8:
    case T::INT16:
    case T::INT32:
    case T::INT64:
    case T::UINT8:
    case T::UINT16:
    case T::UINT32:
    case T::UINT64:
    case T::HALF_FLOAT:
    case T::FLOAT:
    case T::DOUBLE:
      return true;
    default:
      return false;
  }
}

// The value type of `type` (a dictionary's value type), or null when not allowed for the slot.
const arrow::DataType* ValueType(const arrow::DataType& type, bool want_string) {
  const arrow::DataType* v = &type;
  if (type.id() == arrow::Type::DICTIONARY) {
    v = static_cast<const arrow::DictionaryType&>(type).value_type().get();
  }
  return Allowed(v->id(), want_string) ? v : nullptr;
}

// Checks the schema: each required column once, top-level, of an allowed type. *index: its
// field index.
std::optional<Failure> CheckSchema(const arrow::Schema& schema, const std::string& name,
                                   std::array<int, kNumRequired>* index) {
  for (int r = 0; r < kNumRequired; ++r) {
    const std::string col(kRequired[r]);
    const std::vector<int> at = schema.GetAllFieldIndices(col);
    if (at.empty()) {
      return InFile(
          name, "schema lacks required column (need path, num_frames, height, width, fps)", 0, col);
    }
    if (at.size() > 1) return InFile(name, "duplicate column in the schema", 0, col);
    const arrow::DataType& type = *schema.field(at[0])->type();
    if (!ValueType(type, r == kPath)) {
      return InFile(name,
                    "Arrow type " + type.ToString() + " is not allowed (expected " +
                        (r == kPath ? "string, large_string or string_view"
                                    : "an integer or floating-point type") +
                        ", or a dictionary of them)",
                    0, col);
    }
    (*index)[r] = at[0];
  }
  return std::nullopt;
}

// One required column of one record batch: each row's value as the FieldRef a CSV field would
// give (numbers written into a per-column buffer, strings viewed in the array).
class ColumnReader {
 public:
  // `array` has passed ValidateFull and its type CheckSchema.
  explicit ColumnReader(const std::shared_ptr<arrow::Array>& array) {
    values_ = array.get();
    if (array->type_id() == arrow::Type::DICTIONARY) {
      dict_ = static_cast<const arrow::DictionaryArray*>(array.get());
      values_ = dict_->dictionary().get();
    }
    type_ = values_->type_id();
  }

  FieldRef Field(int64_t i, int64_t line) {
    FieldRef f;
    f.present = true;
    f.line = line;
    int64_t j = i;
    if (dict_ != nullptr) {
      if (dict_->IsNull(i)) return Null(f);
      j = dict_->GetValueIndex(i);  // in range: ValidateFull checked the indices
    }
    if (values_->IsNull(j)) return Null(f);
    f.text = Text(j);
    return f;
  }

 private:
  static FieldRef Null(FieldRef f) {
    f.is_null = true;
    return f;
  }
  template <typename A>
  const A& As() const {
    return static_cast<const A&>(*values_);
  }
  template <typename V>
  std::string_view Write(V v) {
    auto r = std::to_chars(buf_, buf_ + sizeof(buf_), v);
    return std::string_view(buf_, static_cast<size_t>(r.ptr - buf_));
  }
  std::string_view Text(int64_t j) {
    using T = arrow::Type;
    switch (type_) {
      case T::STRING:
        return As<arrow::StringArray>().GetView(j);
      case T::LARGE_STRING:
        return As<arrow::LargeStringArray>().GetView(j);
      case T::STRING_VIEW:
        return As<arrow::StringViewArray>().GetView(j);
      case T::INT8:
        return Write(As<arrow::Int8Array>().Value(j));
      case T::INT16:
        return Write(As<arrow::Int16Array>().Value(j));
      case T::INT32:
        return Write(As<arrow::Int32Array>().Value(j));
      case T::INT64:
        return Write(As<arrow::Int64Array>().Value(j));
      case T::UINT8:
        return Write(As<arrow::UInt8Array>().Value(j));
      case T::UINT16:
        return Write(As<arrow::UInt16Array>().Value(j));
      case T::UINT32:
        return Write(As<arrow::UInt32Array>().Value(j));
      case T::UINT64:
        return Write(As<arrow::UInt64Array>().Value(j));
      case T::HALF_FLOAT:
        return Write(
            arrow::util::Float16::FromBits(As<arrow::HalfFloatArray>().Value(j)).ToFloat());
      case T::FLOAT:
        return Write(As<arrow::FloatArray>().Value(j));
      case T::DOUBLE:
        return Write(As<arrow::DoubleArray>().Value(j));
      default:
        return {};  // unreachable: CheckSchema allowed only the types above
    }
  }

  const arrow::Array* values_ = nullptr;
  const arrow::DictionaryArray* dict_ = nullptr;
  arrow::Type::type type_ = arrow::Type::NA;
  char buf_[40];  // the longest shortest-form double ("-2.2250738585072014e-308") fits
};

// The rows of one batch into *sink (rows numbered from first_row); false when parsing must stop.
bool AddBatch(const arrow::RecordBatch& batch, int64_t first_row, RowSink* sink) {
  std::vector<ColumnReader> cols;
  cols.reserve(kNumRequired);
  for (int r = 0; r < kNumRequired; ++r) {
    cols.emplace_back(batch.GetColumnByName(std::string(kRequired[r])));
  }
  std::array<FieldRef, kNumRequired> fields;
  for (int64_t i = 0; i < batch.num_rows(); ++i) {
    const int64_t row = first_row + i;
    for (int r = 0; r < kNumRequired; ++r) fields[r] = cols[r].Field(i, row);
    if (!sink->Row(fields, row)) return false;
  }
  return true;
}

// Reads every batch of `reader` (its schema checked by CheckSchema) into a Manifest.
Result<Manifest> ReadBatches(arrow::RecordBatchReader* reader, const std::string& name,
                             const ManifestOptions& options, size_t reserve) {
  std::vector<RowSink> parts;
  parts.emplace_back(options.skip_bad_rows, reserve);
  RowSink& sink = parts[0];
  int64_t rows = 0;
  while (true) {
    std::shared_ptr<arrow::RecordBatch> batch;
    arrow::Status st = reader->ReadNext(&batch);
    if (st.ok() && batch) {
      st = batch->ValidateFull();
      if (st.ok()) {
        for (int r = 0; r < kNumRequired && st.ok(); ++r) {
          if (!batch->GetColumnByName(std::string(kRequired[r]))) {
            st = arrow::Status::Invalid("a record batch lacks the column ", kRequired[r]);
          }
        }
      }
    }
    if (!st.ok()) {
      return InFile(name,
                    "cannot read the rows from row " + std::to_string(rows + 1) +
                        " on (corrupt or truncated file?): " + st.ToString(),
                    rows + 1);
    }
    if (!batch) break;
    if (!AddBatch(*batch, rows + 1, &sink)) break;
    rows += batch->num_rows();
  }
  return Finish(&parts, name, options);
}

// Opens a Parquet source, checks its metadata and schema and reads its required columns.
Result<Manifest> ReadParquet(std::shared_ptr<arrow::io::RandomAccessFile> input,
                             const std::string& name, const ManifestOptions& options) {
  parquet::ReaderProperties props(arrow::default_memory_pool());
  props.enable_buffered_stream();
  props.set_buffer_size(int64_t{1} << 20);
  parquet::ArrowReaderProperties arrow_props(/*use_threads=*/false);
  arrow_props.set_batch_size(kParquetBatchRows);
  arrow_props.set_pre_buffer(false);
  parquet::arrow::FileReaderBuilder builder;
  arrow::Status st = builder.Open(std::move(input), props);
  if (!st.ok()) return InFile(name, "not a Parquet file, or truncated: " + st.ToString());
  const int64_t num_rows = builder.raw_reader()->metadata()->num_rows();
  const int num_row_groups = builder.raw_reader()->metadata()->num_row_groups();
  if (num_rows < 0 || num_rows > kMaxRows) {
    return InFile(name, "the footer claims " + std::to_string(num_rows) + " rows, outside [0, " +
                            std::to_string(kMaxRows) + "] (the limit)");
  }
  builder.properties(arrow_props);
  std::unique_ptr<parquet::arrow::FileReader> reader;
  st = builder.Build(&reader);
  std::shared_ptr<arrow::Schema> schema;
  if (st.ok()) st = reader->GetSchema(&schema);
  if (!st.ok()) return InFile(name, "cannot read the Parquet schema: " + st.ToString());
  std::array<int, kNumRequired> index{};
  if (auto f = CheckSchema(*schema, name, &index)) return *f;
  std::vector<int> leaves;
  for (int r = 0; r < kNumRequired; ++r) {
    leaves.push_back(reader->manifest().schema_fields[index[r]].column_index);
  }
  std::vector<int> groups(static_cast<size_t>(num_row_groups));
  for (int g = 0; g < num_row_groups; ++g) groups[g] = g;
  auto batches = reader->GetRecordBatchReader(groups, leaves);
  if (!batches.ok()) {
    return InFile(name, "cannot read the Parquet columns: " + batches.status().ToString());
  }
  const auto reserve = static_cast<size_t>(std::min<int64_t>(num_rows, int64_t{16} << 20));
  return ReadBatches(batches->get(), name, options, reserve);
}

// Every Arrow or C++ exception, and running out of memory, as a Failure naming the file.
template <typename F>
Result<Manifest> Guarded(const std::string& name, F&& read) {
  try {
    return read();
  } catch (const std::bad_alloc&) {
    return InFile(name, "out of memory while reading the manifest");
  } catch (const std::exception& e) {
    return InFile(name, std::string("cannot read the Parquet data: ") + e.what());
  }
}

}  // namespace

Result<Manifest> ReadParquetManifest(const std::string& path, const ManifestOptions& options) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return InFile(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  const bool stat_ok = fstat(fd, &st) == 0;
  const int stat_errno = errno;
  std::optional<Failure> refused;
  if (!stat_ok) {
    refused = InFile(path, std::string("cannot stat: ") + std::strerror(stat_errno));
  } else if (S_ISDIR(st.st_mode)) {
    refused = InFile(path, "is a directory, not a manifest file");
  } else if (!S_ISREG(st.st_mode)) {
    refused = InFile(path,
                     "not a regular file: a Parquet manifest is read from its footer (save "
                     "the stream to a regular file)");
  } else if (static_cast<uint64_t>(st.st_size) > kMaxFileBytes) {
    refused = InFile(path, "file of " + std::to_string(st.st_size) + " bytes exceeds the " +
                               std::to_string(kMaxFileBytes) + "-byte limit of a manifest");
  }
  if (refused) {
    ::close(fd);
    return *refused;
  }
  return Guarded(path, [&]() -> Result<Manifest> {
    auto file = arrow::io::ReadableFile::Open(fd);  // owns fd from here on
    if (!file.ok()) return InFile(path, "cannot open: " + file.status().ToString());
    return ReadParquet(*std::move(file), path, options);
  });
}

Result<Manifest> ParseParquetManifest(std::string_view bytes, const std::string& name,
                                      const ManifestOptions& options) {
  return Guarded(name, [&]() -> Result<Manifest> {
    auto buffer = std::make_shared<arrow::Buffer>(reinterpret_cast<const uint8_t*>(bytes.data()),
                                                  static_cast<int64_t>(bytes.size()));
    return ReadParquet(std::make_shared<arrow::io::BufferReader>(std::move(buffer)), name, options);
  });
}

Result<Manifest> ReadArrowStreamManifest(ArrowArrayStream* stream, const std::string& name,
                                         const ManifestOptions& options) {
  if (stream == nullptr || stream->release == nullptr) {
    return InFile(name, "no Arrow stream (null or already consumed)");
  }
  return Guarded(name, [&]() -> Result<Manifest> {
    auto reader = arrow::ImportRecordBatchReader(stream);  // moves the stream; it releases it
    if (!reader.ok())
      return InFile(name, "cannot import the Arrow stream: " + reader.status().ToString());
    std::array<int, kNumRequired> index{};
    if (auto f = CheckSchema(*(*reader)->schema(), name, &index)) return *f;
    return ReadBatches(reader->get(), name, options, 0);
  });
}

}  // namespace ditscale::balance::internal::arrow_reader

extern "C" __attribute__((visibility("default")))
const ditscale::balance::internal::ParquetReaderTable* ditscale_parquet_reader_table() {
  namespace in = ditscale::balance::internal;
  static const in::ParquetReaderTable table = [] {
    in::ParquetReaderTable t = in::ExpectedParquetLayout();
    t.read_file = &in::arrow_reader::ReadParquetManifest;
    t.parse_bytes = &in::arrow_reader::ParseParquetManifest;
    t.read_stream = &in::arrow_reader::ReadArrowStreamManifest;
    return t;
  }();
  return &table;
}
