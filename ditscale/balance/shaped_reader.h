// Reading a manifest straight into its training shapes: ReadManifest (manifest.h) followed by
// ShapeManifest (shapes.h), with the same result and the same failures, for the programs that
// need only the shapes (`ditscale plan`). For a CSV file the parse threads map every good row to
// its shape as they parse it (one memo lookup, see ShapeManifest), so the raw samples (16 bytes
// a row, 160 MB for 10M rows) are never stored and there is no second pass over them; other
// formats are read and then shaped.
#pragma once

#include <string>
#include <string_view>

#include "ditscale/balance/manifest.h"
#include "ditscale/balance/shapes.h"
#include "ditscale/core/result.h"

namespace ditscale::balance {

// Reads the manifest at `path` (the rules, limits and failures of ReadManifest) and groups its
// samples by training shape for `model` (ShapeManifest). *rows gets the manifest's source,
// rows_total, rows_skipped and skipped_examples; its samples and ids stay empty. A CSV file
// without skipped rows gives ids_dense (ids empty, entry i is sample id i); ShapedManifest::id
// reads either form.
// A Failure is what ReadManifest gives (the file, a bad row in strict mode, a limit, out of
// memory); a sample the model refuses throws ditscale::Error as ShapeManifest does ("<file>:
// sample id <id>: ..."), the first such sample in row order, and only when the read succeeds.
Result<ShapedManifest> ReadShapedManifest(const std::string& path, const ModelPreset& model,
                                          const ManifestOptions& options, Manifest* rows);

namespace internal {
struct CsvParseOptions;
// The CSV path of ReadShapedManifest on text in memory (`name` names it in messages), with the
// parser's options (tests: the two-thread split on small texts). Throws as ReadShapedManifest.
Result<ShapedManifest> ShapeCsvText(std::string_view text, const std::string& name,
                                    const ModelPreset& model, const ManifestOptions& options,
                                    const CsvParseOptions& csv, Manifest* rows);
}  // namespace internal

}  // namespace ditscale::balance
