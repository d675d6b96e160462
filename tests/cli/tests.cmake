# CLI-level tests (included by tests/CMakeLists.txt): bad inputs must give one "error:" line and a
# non-zero exit, never a crash or a hang. One ctest test per case: cli.info.empty, cli.run.wrong_magic, ...
# The cases are listed by tests/cli/bad_input.sh itself.
if(NOT TARGET merlin)
  return()
endif()
find_program(MERLIN_BASH bash REQUIRED)
set(_cli_script ${CMAKE_CURRENT_LIST_DIR}/bad_input.sh)
set(_cli_work ${PROJECT_BINARY_DIR}/tests/cli_inputs)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_cli_script})
execute_process(
  COMMAND ${MERLIN_BASH} ${_cli_script} merlin ${_cli_work} list
  OUTPUT_VARIABLE _cli_cases OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE _cli_rc)
if(NOT _cli_rc EQUAL 0)
  message(FATAL_ERROR "tests/cli/bad_input.sh list failed")
endif()
string(REPLACE "\n" ";" _cli_cases "${_cli_cases}")

set(_cli_env "MERLIN_DEFAULT_DATA_DIR=${MERLIN_DEFAULT_DATA_DIR}")
add_test(NAME cli.setup COMMAND ${MERLIN_BASH} ${_cli_script} $<TARGET_FILE:merlin> ${_cli_work} setup)
set_tests_properties(cli.setup PROPERTIES FIXTURES_SETUP merlin_cli_inputs TIMEOUT 300
  ENVIRONMENT "${_cli_env}" LABELS cli)
foreach(_case IN LISTS _cli_cases)
  add_test(NAME cli.${_case} COMMAND ${MERLIN_BASH} ${_cli_script} $<TARGET_FILE:merlin> ${_cli_work} ${_case})
  set_tests_properties(cli.${_case} PROPERTIES FIXTURES_REQUIRED merlin_cli_inputs TIMEOUT 120
    SKIP_RETURN_CODE 77 ENVIRONMENT "${_cli_env}" LABELS cli)
endforeach()

add_test(NAME cli.init_streaming COMMAND ${MERLIN_BASH} ${CMAKE_CURRENT_LIST_DIR}/init_streaming.sh $<TARGET_FILE:merlin>)
set_tests_properties(cli.init_streaming PROPERTIES TIMEOUT 300 SKIP_RETURN_CODE 77 ENVIRONMENT "${_cli_env}" LABELS cli)

# bench/cuda_trace_summary.py (the GPU timeline summary) on a synthetic trace: plain python3, no packages.
find_program(MERLIN_PYTHON3 python3)
if(MERLIN_PYTHON3)
  add_test(NAME bench.trace_summary COMMAND ${MERLIN_PYTHON3} -W error ${CMAKE_CURRENT_LIST_DIR}/trace_summary_test.py)
  set_tests_properties(bench.trace_summary PROPERTIES TIMEOUT 60 LABELS cli)
endif()
