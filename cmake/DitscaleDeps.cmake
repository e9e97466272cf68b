# Third-party dependencies. Required: fmt, nlohmann_json, CLI11 (CLI only), GTest (tests),
# benchmark (benchmarks). Optional, switched on when found: CUDA, NCCL, NVSHMEM, Torch, Arrow
# (Parquet manifests).
find_package(fmt REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(Threads REQUIRED)
if(DITSCALE_BUILD_CLI)
  find_package(CLI11 REQUIRED)
endif()
if(DITSCALE_BUILD_TESTS)
  find_package(GTest REQUIRED)
  include(GoogleTest)
endif()
if(DITSCALE_BUILD_BENCHMARKS)
  find_package(benchmark REQUIRED)
endif()

# ---- CUDA ----
set(DITSCALE_HAVE_CUDA OFF)
if(NOT DITSCALE_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_ARCHITECTURES ${DITSCALE_CUDA_ARCHS})
    enable_language(CUDA)
    # CMake 3.25 does not know nvcc 13's C++20 flag; name it.
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(DITSCALE_HAVE_CUDA ON)
  elseif(DITSCALE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "DITSCALE_CUDA=ON but no CUDA compiler was found")
  else()
    message(STATUS "ditscale: no CUDA compiler found; CUDA kernels are off")
  endif()
endif()

# ---- NCCL ----
# NCCL_HOME first, then the nvidia-nccl-cu13 wheel of the running Python (the NCCL that torch
# loads: a process has ONE libnccl.so.2, so the headers we compile against must be that
# library's), then the CUDA toolkit / system.
set(DITSCALE_HAVE_NCCL OFF)
if(DITSCALE_HAVE_CUDA)
  set(_nccl_hints $ENV{NCCL_HOME})
  ditscale_python_package_dir(nvidia.nccl _nccl_py)
  if(_nccl_py AND EXISTS "${_nccl_py}/include/nccl.h")
    list(APPEND _nccl_hints ${_nccl_py})
  endif()
  find_path(DITSCALE_NCCL_INCLUDE nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include NO_DEFAULT_PATH)
  find_library(DITSCALE_NCCL_LIB NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64
               NO_DEFAULT_PATH)
  find_path(DITSCALE_NCCL_INCLUDE nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(DITSCALE_NCCL_LIB NAMES nccl libnccl.so.2 HINTS ${CUDAToolkit_LIBRARY_DIR})
  if(DITSCALE_NCCL_INCLUDE AND DITSCALE_NCCL_LIB)
    set(DITSCALE_HAVE_NCCL ON)
    add_library(ditscale_nccl_dep INTERFACE)
    target_include_directories(ditscale_nccl_dep INTERFACE ${DITSCALE_NCCL_INCLUDE})
    target_link_libraries(ditscale_nccl_dep INTERFACE ${DITSCALE_NCCL_LIB})
    message(STATUS "ditscale: NCCL ${DITSCALE_NCCL_LIB} (headers ${DITSCALE_NCCL_INCLUDE})")
  else()
    message(STATUS "ditscale: NCCL not found; the NCCL transport is off")
  endif()
endif()

# ---- NVSHMEM (headers and libraries from the nvidia-nvshmem-cu13 wheel or NVSHMEM_HOME) ----
set(DITSCALE_HAVE_NVSHMEM OFF)
if(DITSCALE_HAVE_CUDA AND NOT DITSCALE_NVSHMEM STREQUAL "OFF")
  include(FindNvshmem)
endif()

# ---- Torch ----
set(DITSCALE_HAVE_TORCH OFF)
if(NOT DITSCALE_TORCH STREQUAL "OFF")
  include(FindTorchExt)
endif()

# ---- Parquet manifests (Arrow C++: a system Arrow or the pyarrow wheel) ----
set(DITSCALE_PARQUET "AUTO" CACHE STRING "Read Parquet manifests through Arrow C++: AUTO, ON or OFF")
set(DITSCALE_HAVE_PARQUET OFF)
if(NOT DITSCALE_PARQUET STREQUAL "OFF")
  include(FindArrowFromPyarrow)
else()
  message(STATUS "ditscale: DITSCALE_PARQUET=OFF; Parquet manifests are off")
endif()
