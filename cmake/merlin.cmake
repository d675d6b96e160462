# Helpers shared by the module CMakeLists.

# Source files named *_avx2.cpp / *_avx512.cpp are compiled with the matching instruction-set flags; the
# code in them is only called after run-time CPU detection (core/cpu_features.h).
set(MERLIN_AVX2_FLAGS -mavx2 -mfma -mf16c)
set(MERLIN_AVX512_FLAGS -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512bf16 -mfma -mf16c -mavx2)

function(merlin_module name)
  file(GLOB _srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/*.cpp)
  add_library(${name} STATIC ${_srcs})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR}/src)
  foreach(_src IN LISTS _srcs)
    if(_src MATCHES "_avx2\\.cpp$")
      set_source_files_properties(${_src} PROPERTIES COMPILE_OPTIONS "${MERLIN_AVX2_FLAGS}")
    elseif(_src MATCHES "_avx512\\.cpp$")
      set_source_files_properties(${_src} PROPERTIES COMPILE_OPTIONS "${MERLIN_AVX512_FLAGS}")
    endif()
  endforeach()
  target_link_libraries(${name} PUBLIC ${ARGN})
endfunction()
