# Training tests beyond the gtest ones (included by tests/CMakeLists.txt), label "train":
#   train.parity           Merlin's loss, gradients and AdamW steps vs PyTorch autograd (check_train_parity.py)
#   train.cli.setup        fixture: prepare a small dataset, train 6 steps
#   train.cli.<case>       export/run/plot/info/resume end to end, and bad inputs (cli_train.sh list)
# All exit 77 (skipped) without the shared data; the parity test also without /usr/bin/python3 + torch.
if(NOT TARGET merlin)
  return()
endif()
set(_train_dir ${CMAKE_CURRENT_LIST_DIR})
set(_train_env "MERLIN_DEFAULT_DATA_DIR=${MERLIN_DEFAULT_DATA_DIR}")

set(MERLIN_TRAIN_PYTHON "/usr/bin/python3" CACHE FILEPATH "Python with numpy and torch for tests/train")
if(EXISTS "${MERLIN_TRAIN_PYTHON}")
  add_test(NAME train.parity
    COMMAND ${MERLIN_TRAIN_PYTHON} ${_train_dir}/check_train_parity.py $<TARGET_FILE:merlin> ${MERLIN_DEFAULT_DATA_DIR})
  set_tests_properties(train.parity PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 300 LABELS train)
endif()

find_program(MERLIN_BASH bash REQUIRED)
set(_train_cli ${_train_dir}/cli_train.sh)
set(_train_work ${PROJECT_BINARY_DIR}/tests/train_cli)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_train_cli})
execute_process(COMMAND ${MERLIN_BASH} ${_train_cli} merlin ${_train_work} list
  OUTPUT_VARIABLE _train_cases OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _train_rc)
if(NOT _train_rc EQUAL 0)
  message(FATAL_ERROR "tests/train/cli_train.sh list failed")
endif()
string(REPLACE "\n" ";" _train_cases "${_train_cases}")
add_test(NAME train.cli.setup COMMAND ${MERLIN_BASH} ${_train_cli} $<TARGET_FILE:merlin> ${_train_work} setup)
set_tests_properties(train.cli.setup PROPERTIES FIXTURES_SETUP merlin_train_cli TIMEOUT 300 SKIP_RETURN_CODE 77
  ENVIRONMENT "${_train_env}" LABELS train)
foreach(_case IN LISTS _train_cases)
  add_test(NAME train.cli.${_case} COMMAND ${MERLIN_BASH} ${_train_cli} $<TARGET_FILE:merlin> ${_train_work} ${_case})
  set_tests_properties(train.cli.${_case} PROPERTIES FIXTURES_REQUIRED merlin_train_cli TIMEOUT 120
    SKIP_RETURN_CODE 77 ENVIRONMENT "${_train_env}" LABELS train)
endforeach()
