# Which GPU architectures tpcore's CUDA kernels are built for, from the environment:
#   TPCORE_CUDA_ARCHS     CMake-style list, e.g. "90" or "80;90" (also "8.0 9.0", "90a")
#   TORCH_CUDA_ARCH_LIST  torch's style, e.g. "8.0;9.0+PTX" (used when TPCORE_CUDA_ARCHS is unset)
# else the data-centre GPUs we target (80;90): there is no GPU to probe at build time.
# Sets, in the caller's scope:
#   TPCORE_CUDA_ARCHS     for the target's CUDA_ARCHITECTURES
#   TORCH_CUDA_ARCH_LIST  the same list in torch's notation, which torch's CMake turns into
#                         -gencode flags (its variable takes precedence over the environment,
#                         which is why it is derived from the user's settings here)
function(tpcore_cuda_archs)
  if(DEFINED ENV{TPCORE_CUDA_ARCHS} AND NOT "$ENV{TPCORE_CUDA_ARCHS}" STREQUAL "")
    set(requested "$ENV{TPCORE_CUDA_ARCHS}")
  elseif(DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT "$ENV{TORCH_CUDA_ARCH_LIST}" STREQUAL "")
    set(requested "$ENV{TORCH_CUDA_ARCH_LIST}")
  else()
    set(requested "80;90")
  endif()
  string(REGEX REPLACE "[ ,]+" ";" requested "${requested}")
  set(archs "")
  set(torch_list "")
  foreach(item IN LISTS requested)
    string(REGEX REPLACE "\\+PTX$" "" item "${item}")
    if(item MATCHES "^([0-9]+)\\.([0-9]+)([a-z]?)$")  # torch style 9.0 / 9.0a
      set(major ${CMAKE_MATCH_1})
      set(minor ${CMAKE_MATCH_2})
      set(suffix ${CMAKE_MATCH_3})
    elseif(item MATCHES "^([0-9]+)([0-9])([a-z]?)$")  # CMake style 90 / 90a
      set(major ${CMAKE_MATCH_1})
      set(minor ${CMAKE_MATCH_2})
      set(suffix ${CMAKE_MATCH_3})
    else()
      message(FATAL_ERROR "tpcore: cannot read CUDA architecture '${item}' (from '${requested}'); "
                          "use e.g. TPCORE_CUDA_ARCHS=\"80;90\"")
    endif()
    list(APPEND archs "${major}${minor}${suffix}")
    list(APPEND torch_list "${major}.${minor}${suffix}")
  endforeach()
  list(REMOVE_DUPLICATES archs)
  list(REMOVE_DUPLICATES torch_list)
  set(TPCORE_CUDA_ARCHS "${archs}" PARENT_SCOPE)
  set(TORCH_CUDA_ARCH_LIST "${torch_list}" PARENT_SCOPE)
endfunction()

# `cmake -P cmake/cuda_archs.cmake` prints the result (used by the tests).
if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  tpcore_cuda_archs()
  message("TPCORE_CUDA_ARCHS=${TPCORE_CUDA_ARCHS}")
  message("TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}")
endif()
