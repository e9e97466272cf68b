# Locates Arrow C++ and Parquet for the Parquet manifest reader (the plugin module
# libditscale_parquet.so of ditscale/balance/parquet/arrow_reader.cc): a system Arrow first
# (find_package(Parquet CONFIG), e.g. Debian's or conda's libarrow-dev / libparquet-dev), else
# the pyarrow wheel of Python3_EXECUTABLE, which ships the headers (pyarrow.get_include()) and
# the shared libraries (libarrow.so.<N>, libparquet.so.<N> in pyarrow.get_library_dirs(); no
# unversioned names unless pyarrow.create_library_symlinks() was run, so they are linked by full
# path, which needs no change to the Python environment).
#
# Sets DITSCALE_HAVE_PARQUET and, when ON, the INTERFACE target ditscale_parquet_dep (headers as
# SYSTEM, the two libraries, and for the wheel an RPATH entry for its folder in every binary or
# module that links it (the plugin module and the Parquet tests), installed ones included: the
# folder is on no loader path; the libraries themselves carry RUNPATH $ORIGIN, so libparquet
# finds libarrow beside it).
#
# ABI: pyarrow's wheels are built with the C++11 string ABI (_GLIBCXX_USE_CXX11_ABI=1, the default
# of g++ >= 5) against libstdc++ 3.4.22 or older; a small program calling
# arrow::Status::ToString() (whose mangled name carries the ABI tag) and parquet::arrow::OpenFile
# must compile and link with our compiler and flags, else Parquet is switched off (AUTO) with the
# linker's words or is an error (ON).
set(DITSCALE_HAVE_PARQUET OFF)

# Parquet off with the reason (the arguments, joined), or an error under DITSCALE_PARQUET=ON.
function(_ditscale_parquet_off)
  string(JOIN "" why ${ARGN})
  if(DITSCALE_PARQUET STREQUAL "ON")
    message(FATAL_ERROR "DITSCALE_PARQUET=ON but ${why}")
  endif()
  message(STATUS "ditscale: ${why}; Parquet manifests are off (the reader then fails with "
                 "'built without Parquet support')")
endfunction()

# The library file `name` (libarrow, libparquet) in `dir`: the unversioned .so when present, else
# the one versioned by the soname's number only (libarrow.so.2600, not libarrow.so.2600.1.0).
function(_ditscale_pyarrow_lib dir name out)
  set(found "")
  if(EXISTS "${dir}/${name}.so")
    set(found "${dir}/${name}.so")
  else()
    file(GLOB cands "${dir}/${name}.so.*")
    foreach(c ${cands})
      get_filename_component(base "${c}" NAME)
      if(base MATCHES "^${name}\\.so\\.[0-9]+$")
        set(found "${c}")
      endif()
    endforeach()
  endif()
  set(${out} "${found}" PARENT_SCOPE)
endfunction()

set(_arrow_kind "")
find_package(Parquet CONFIG QUIET)
if(Parquet_FOUND AND TARGET Parquet::parquet_shared AND TARGET Arrow::arrow_shared)
  add_library(ditscale_parquet_dep INTERFACE)
  target_link_libraries(ditscale_parquet_dep INTERFACE Parquet::parquet_shared
                        Arrow::arrow_shared)
  set(_arrow_kind "system Arrow ${Parquet_VERSION}")
  set(_arrow_libs Parquet::parquet_shared Arrow::arrow_shared)
  set(_arrow_includes "")
else()
  find_package(Python3 COMPONENTS Interpreter QUIET)
  set(_pa_out "")
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND ${Python3_EXECUTABLE} -c
              "import pyarrow as p; print(p.__version__); print(p.get_include()); print(p.get_library_dirs()[0])"
      OUTPUT_VARIABLE _pa_out OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET
      RESULT_VARIABLE _pa_rc)
  endif()
  if(NOT _pa_out OR NOT _pa_rc EQUAL 0)
    _ditscale_parquet_off("neither a system Arrow nor pyarrow in ${Python3_EXECUTABLE} was found")
    return()
  endif()
  string(REPLACE "\n" ";" _pa_out "${_pa_out}")
  list(GET _pa_out 0 DITSCALE_PYARROW_VERSION)
  list(GET _pa_out 1 _pa_include)
  list(GET _pa_out 2 DITSCALE_ARROW_LIB_DIR)
  _ditscale_pyarrow_lib("${DITSCALE_ARROW_LIB_DIR}" libarrow _pa_arrow)
  _ditscale_pyarrow_lib("${DITSCALE_ARROW_LIB_DIR}" libparquet _pa_parquet)
  if(NOT EXISTS "${_pa_include}/parquet/arrow/reader.h" OR NOT _pa_arrow OR NOT _pa_parquet)
    _ditscale_parquet_off("pyarrow ${DITSCALE_PYARROW_VERSION} in ${DITSCALE_ARROW_LIB_DIR} lacks "
                          "the Parquet headers or libarrow/libparquet")
    return()
  endif()
  add_library(ditscale_parquet_dep INTERFACE)
  target_include_directories(ditscale_parquet_dep SYSTEM INTERFACE "${_pa_include}")
  target_link_libraries(ditscale_parquet_dep INTERFACE "${_pa_parquet}" "${_pa_arrow}")
  target_link_options(ditscale_parquet_dep INTERFACE "LINKER:-rpath,${DITSCALE_ARROW_LIB_DIR}")
  set(_arrow_kind "pyarrow ${DITSCALE_PYARROW_VERSION} (${DITSCALE_ARROW_LIB_DIR})")
  set(_arrow_libs "${_pa_parquet}" "${_pa_arrow}" "-Wl,-rpath,${DITSCALE_ARROW_LIB_DIR}")
  set(_arrow_includes "${_pa_include}")
endif()

# The ABI probe (see the file comment): compiled with our standard and flags.
set(_probe_dir "${CMAKE_BINARY_DIR}/CMakeFiles/ditscale_arrow_probe")
file(WRITE "${_probe_dir}/probe.cc" [=[
#include <arrow/io/memory.h>
#include <arrow/status.h>
#include <parquet/arrow/reader.h>
#include <cstdio>
int main() {
  auto in = std::make_shared<arrow::io::BufferReader>(std::make_shared<arrow::Buffer>(""));
  auto r = parquet::arrow::OpenFile(in, arrow::default_memory_pool());
  std::printf("%s\n", r.status().ToString().c_str());
  return 0;
}
]=])
set(_probe_flags "")
if(_arrow_includes)
  set(_probe_flags "-DINCLUDE_DIRECTORIES=${_arrow_includes}")
endif()
try_compile(_arrow_abi_ok "${_probe_dir}/build" SOURCES "${_probe_dir}/probe.cc"
            CMAKE_FLAGS ${_probe_flags}
            LINK_LIBRARIES ${_arrow_libs}
            CXX_STANDARD 20 CXX_STANDARD_REQUIRED ON
            OUTPUT_VARIABLE _arrow_abi_out)
if(NOT _arrow_abi_ok)
  string(REGEX MATCH "undefined reference[^\n]*" _arrow_abi_why "${_arrow_abi_out}")
  if(NOT _arrow_abi_why)
    string(REGEX MATCH "error:[^\n]*" _arrow_abi_why "${_arrow_abi_out}")
  endif()
  _ditscale_parquet_off("${_arrow_kind} does not link with ${CMAKE_CXX_COMPILER_ID} "
                        "${CMAKE_CXX_COMPILER_VERSION} (C++ ABI or headers: ${_arrow_abi_why})")
  return()
endif()
set(DITSCALE_HAVE_PARQUET ON)
message(STATUS "ditscale: Parquet manifests through ${_arrow_kind}")
