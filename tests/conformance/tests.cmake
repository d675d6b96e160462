# llama.cpp conformance on real files (included by tests/CMakeLists.txt): perplexity and greedy text of the
# tiny-llama-conformance model in every type, against llama-perplexity's and llama-cli's outputs. One ctest
# test per case (conformance.ppl.q4_0, conformance.greedy.f16, ...), listed by the script; skipped (exit 77)
# when the shared data is absent.
if(NOT TARGET merlin)
  return()
endif()
find_program(MERLIN_BASH bash REQUIRED)
set(_conf_script ${CMAKE_CURRENT_LIST_DIR}/conformance.sh)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_conf_script})
execute_process(COMMAND ${MERLIN_BASH} ${_conf_script} - list
  OUTPUT_VARIABLE _conf_cases OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _conf_rc)
if(NOT _conf_rc EQUAL 0)
  message(FATAL_ERROR "tests/conformance/conformance.sh list failed")
endif()
string(REPLACE "\n" ";" _conf_cases "${_conf_cases}")
foreach(_case IN LISTS _conf_cases)
  add_test(NAME conformance.${_case} COMMAND ${MERLIN_BASH} ${_conf_script} $<TARGET_FILE:merlin> ${_case})
  set_tests_properties(conformance.${_case} PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77
    ENVIRONMENT "MERLIN_DEFAULT_DATA_DIR=${MERLIN_DEFAULT_DATA_DIR}" LABELS conformance)
endforeach()
