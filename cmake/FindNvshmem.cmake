# Locates NVSHMEM 3: NVSHMEM_HOME, or the nvidia-nvshmem-cu13 wheel of the running Python.
# The wheel ships libnvshmem_host.so.3 (no unversioned link) and the static libnvshmem_device.a.
set(_nvshmem_hints $ENV{NVSHMEM_HOME})
ditscale_python_package_dir(nvidia.nvshmem _nvshmem_py)  # cmake/DitscaleHelpers.cmake
if(_nvshmem_py)
  list(APPEND _nvshmem_hints ${_nvshmem_py})
endif()
find_path(NVSHMEM_INCLUDE_DIR nvshmem.h HINTS ${_nvshmem_hints} PATH_SUFFIXES include)
find_library(NVSHMEM_HOST_LIBRARY NAMES nvshmem_host libnvshmem_host.so.3
             HINTS ${_nvshmem_hints} PATH_SUFFIXES lib lib64)
find_library(NVSHMEM_DEVICE_LIBRARY NAMES nvshmem_device HINTS ${_nvshmem_hints}
             PATH_SUFFIXES lib lib64)
if(NVSHMEM_INCLUDE_DIR AND NVSHMEM_HOST_LIBRARY AND NVSHMEM_DEVICE_LIBRARY)
  set(DITSCALE_HAVE_NVSHMEM ON)
  message(STATUS "ditscale: NVSHMEM at ${NVSHMEM_INCLUDE_DIR}")
  # Host-library target (what ditscale_comm uses). libnvshmem_host.so.3 is linked by full path
  # (the wheel has no unversioned .so); its folder goes into the RPATH of every binary or module
  # that links it, installed ones included (the Python extension is loaded from site-packages),
  # because the wheel's folder is on no loader path. libnvshmem_host.so.3 itself has
  # RPATH $ORIGIN, so its bootstrap plugin nvshmem_bootstrap_uid.so.3 is found next to it.
  get_filename_component(NVSHMEM_LIB_DIR ${NVSHMEM_HOST_LIBRARY} DIRECTORY)
  if(NOT TARGET ditscale_nvshmem_dep)
    add_library(ditscale_nvshmem_dep INTERFACE)
    target_include_directories(ditscale_nvshmem_dep INTERFACE ${NVSHMEM_INCLUDE_DIR})
    target_link_libraries(ditscale_nvshmem_dep INTERFACE ${NVSHMEM_HOST_LIBRARY})
    target_link_options(ditscale_nvshmem_dep INTERFACE "LINKER:-rpath,${NVSHMEM_LIB_DIR}")
  endif()
elseif(DITSCALE_NVSHMEM STREQUAL "ON")
  message(FATAL_ERROR "DITSCALE_NVSHMEM=ON but NVSHMEM was not found (pip install nvidia-nvshmem-cu13)")
else()
  message(STATUS "ditscale: NVSHMEM not found; one-sided transport is off")
endif()
