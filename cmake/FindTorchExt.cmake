# Finds Torch through the running Python's torch.utils.cmake_prefix_path.
find_package(Python3 COMPONENTS Interpreter Development.Module QUIET)
if(Python3_Interpreter_FOUND)
  execute_process(COMMAND ${Python3_EXECUTABLE} -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
                  OUTPUT_VARIABLE _torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()
if(_torch_prefix)
  list(APPEND CMAKE_PREFIX_PATH ${_torch_prefix})
  # A CUDA torch's config (Caffe2/public/cuda.cmake) probes the installed GPUs with try_run unless
  # TORCH_CUDA_ARCH_LIST is set (that probe fails to configure here), and it sets
  # CMAKE_CUDA_ARCHITECTURES to OFF, which would drop our sm_80/sm_90a targets: give it our list
  # and restore ours afterwards. It also appends its nvcc flags (-gencode for sm_80/sm_90, ...) to
  # CMAKE_CUDA_FLAGS, which would compile every ditscale kernel twice: restore those too.
  if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(TORCH_CUDA_ARCH_LIST "")
    foreach(_arch ${DITSCALE_CUDA_ARCHS})
      string(REGEX REPLACE "^([0-9]+)([0-9])[a-z]*$" "\\1.\\2" _arch "${_arch}")
      list(APPEND TORCH_CUDA_ARCH_LIST ${_arch})
    endforeach()
  endif()
  if(DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(_ditscale_cuda_archs "${CMAKE_CUDA_ARCHITECTURES}")
  endif()
  set(_ditscale_cuda_flags "${CMAKE_CUDA_FLAGS}")
  set(_ditscale_had_python ${Python_FOUND})
  find_package(Torch QUIET)
  # Torch's CUDA config runs find_package(Python COMPONENTS Interpreter); pybind11 would then
  # take FindPython's `Python` (no Development component, no python_add_library): keep Python3.
  if(NOT _ditscale_had_python)
    unset(Python_FOUND)
  endif()
  if(DEFINED _ditscale_cuda_archs)
    set(CMAKE_CUDA_ARCHITECTURES "${_ditscale_cuda_archs}")
  endif()
  set(CMAKE_CUDA_FLAGS "${_ditscale_cuda_flags}")
endif()
if(Torch_FOUND)
  set(DITSCALE_HAVE_TORCH ON)
  find_library(TORCH_PYTHON_LIBRARY torch_python PATHS "${TORCH_INSTALL_PREFIX}/lib" REQUIRED)
elseif(DITSCALE_TORCH STREQUAL "ON")
  message(FATAL_ERROR "DITSCALE_TORCH=ON but Torch was not found in ${Python3_EXECUTABLE}")
else()
  message(STATUS "ditscale: Torch not found; the PyTorch extension is off")
endif()
