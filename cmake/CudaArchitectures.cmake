# jaxcp_choose_cuda_architectures(): sets CMAKE_CUDA_ARCHITECTURES (before enable_language(CUDA))
# and prints which architectures the CUDA extension is built for.
#
# - Given by the user (-DCMAKE_CUDA_ARCHITECTURES=..., or the CUDAARCHS environment variable):
#   used as given.
# - Else the GPUs of this machine, as nvidia-smi reports them: 9.0 -> 90a-real (the sm_90a
#   kernels need the arch-specific target), any other of 8.0 and up -> its own real target (e.g.
#   8.6 -> 86-real), duplicates dropped. One GPU kind compiles about half as much as two.
# - Else (no nvidia-smi, no GPU, or a GPU older than 8.0, which the kernels do not run on) the
#   portable default 80-real;90a-real.
set(JAXCP_DEFAULT_CUDA_ARCHITECTURES "80-real;90a-real")

function(_jaxcp_cuda_archs_of_local_gpus out_archs out_caps)
  set(${out_archs} "" PARENT_SCOPE)
  set(${out_caps} "" PARENT_SCOPE)
  find_program(_jaxcp_nvidia_smi nvidia-smi)
  if(NOT _jaxcp_nvidia_smi)
    return()
  endif()
  execute_process(
    COMMAND "${_jaxcp_nvidia_smi}" --query-gpu=compute_cap --format=csv,noheader
    OUTPUT_VARIABLE _out RESULT_VARIABLE _rc ERROR_QUIET TIMEOUT 30)
  if(NOT _rc EQUAL 0)
    return()
  endif()
  string(REPLACE "\n" ";" _lines "${_out}")
  set(_archs "")
  set(_caps "")
  foreach(_line IN LISTS _lines)
    string(STRIP "${_line}" _cap)
    if(_cap STREQUAL "")
      continue()
    endif()
    if(NOT _cap MATCHES "^([0-9]+)\\.([0-9]+)$")
      return()  # an answer we cannot read: the default
    endif()
    set(_major "${CMAKE_MATCH_1}")
    set(_minor "${CMAKE_MATCH_2}")
    list(APPEND _caps "${_cap}")
    if(_major LESS 8)
      return()  # the kernels need sm_80 or newer: the default
    elseif(_major EQUAL 9 AND _minor EQUAL 0)
      list(APPEND _archs "90a-real")
    else()
      list(APPEND _archs "${_major}${_minor}-real")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES _archs)
  list(REMOVE_DUPLICATES _caps)
  set(${out_archs} "${_archs}" PARENT_SCOPE)
  set(${out_caps} "${_caps}" PARENT_SCOPE)
endfunction()

macro(jaxcp_choose_cuda_architectures)
  if(DEFINED CMAKE_CUDA_ARCHITECTURES OR DEFINED ENV{CUDAARCHS})
    set(_jaxcp_archs_source "as given")
  else()
    _jaxcp_cuda_archs_of_local_gpus(_jaxcp_local_archs _jaxcp_local_caps)
    if(_jaxcp_local_archs)
      set(CMAKE_CUDA_ARCHITECTURES "${_jaxcp_local_archs}")
      set(_jaxcp_archs_source "this machine's GPUs, compute capability ${_jaxcp_local_caps}")
    else()
      set(CMAKE_CUDA_ARCHITECTURES "${JAXCP_DEFAULT_CUDA_ARCHITECTURES}")
      set(_jaxcp_archs_source "no GPU of compute capability 8.0 or newer found by nvidia-smi: the portable default")
    endif()
  endif()
endmacro()

# After enable_language(CUDA), which reads CUDAARCHS into CMAKE_CUDA_ARCHITECTURES.
macro(jaxcp_report_cuda_architectures)
  message(STATUS "jaxcp: building the CUDA kernels for ${CMAKE_CUDA_ARCHITECTURES} (${_jaxcp_archs_source}; "
                 "-DCMAKE_CUDA_ARCHITECTURES=... chooses others). The CUDA build takes several minutes.")
endmacro()
