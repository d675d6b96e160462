# PyTorch reference parity tests (see tests/reference/README.md). Included from tests/CMakeLists.txt.
#
# reference_selfcheck          the reference itself vs llama2.c / llama.cpp outputs on shared data
# reference_init_<model>       fixture: `merlin init` writes a random model into ${CMAKE_BINARY_DIR}/reference-models
# reference_parity_<model>     Merlin's logits (prefill/decode/nocache) and greedy ids vs the reference
#
# They need /usr/bin/python3 with numpy and torch (Debian's python3-torch) and the shared data directory
# ($MERLIN_DATA, else MERLIN_DEFAULT_DATA_DIR); without them they are reported as skipped (exit 77).

set(MERLIN_REFERENCE_PYTHON "/usr/bin/python3" CACHE FILEPATH "Python with numpy and torch for tests/reference")
set(_ref_dir ${CMAKE_CURRENT_LIST_DIR})
set(_ref_models ${CMAKE_BINARY_DIR}/reference-models)

if(NOT EXISTS "${MERLIN_REFERENCE_PYTHON}")
  message(STATUS "tests/reference: ${MERLIN_REFERENCE_PYTHON} not found; PyTorch parity tests not registered")
  return()
endif()

add_test(NAME reference_selfcheck
  COMMAND ${MERLIN_REFERENCE_PYTHON} ${_ref_dir}/test_reference_selfcheck.py --data-dir ${MERLIN_DEFAULT_DATA_DIR})
set_tests_properties(reference_selfcheck PROPERTIES
  SKIP_RETURN_CODE 77 TIMEOUT 300 LABELS "reference")

# Random-init models written by merlin itself: name, then `merlin init` options.
set(_ref_init_sanity         --preset sanity --seed 1)
set(_ref_init_sanity_f16     --preset sanity --seed 1 --type f16)
set(_ref_init_sanity_bf16    --preset sanity --seed 1 --type bf16)
set(_ref_init_sanity_gqa     --preset sanity --seed 2 --heads 4 --kv-heads 2 --untied)
set(_ref_init_experiment     --preset experiment --seed 1)

foreach(_m sanity sanity_f16 sanity_bf16 sanity_gqa experiment)
  add_test(NAME reference_init_${_m}
    COMMAND ${MERLIN_REFERENCE_PYTHON} ${_ref_dir}/init_model.py $<TARGET_FILE:merlin> ${_ref_models}/${_m}.gguf
            ${MERLIN_DEFAULT_DATA_DIR} ${_ref_init_${_m}})
  set_tests_properties(reference_init_${_m} PROPERTIES
    FIXTURES_SETUP reference_model_${_m} SKIP_RETURN_CODE 77
    TIMEOUT 120 LABELS "reference")
  add_test(NAME reference_parity_${_m}
    COMMAND ${MERLIN_REFERENCE_PYTHON} ${_ref_dir}/check_parity.py $<TARGET_FILE:merlin> ${_ref_models}/${_m}.gguf
            --tol 1e-4)
  set_tests_properties(reference_parity_${_m} PROPERTIES
    FIXTURES_REQUIRED reference_model_${_m} SKIP_RETURN_CODE 77
    TIMEOUT 300 LABELS "reference")
endforeach()

# Models from the shared data directory, written by llama.cpp's tools (untied output, GQA, F16/BF16 tensors).
set(_ref_data_stories260k  models/stories260K/stories260K.gguf)
set(_ref_data_tiny_f32     models/tiny-llama-conformance/tiny-f32.gguf)
set(_ref_data_tiny_f16     models/tiny-llama-conformance/tiny-f16.gguf)
set(_ref_data_tiny_bf16    models/tiny-llama-conformance/tiny-bf16.gguf)
foreach(_m stories260k tiny_f32 tiny_f16 tiny_bf16)
  add_test(NAME reference_parity_${_m}
    COMMAND ${MERLIN_REFERENCE_PYTHON} ${_ref_dir}/check_parity.py $<TARGET_FILE:merlin> data:${_ref_data_${_m}}
            --data-dir ${MERLIN_DEFAULT_DATA_DIR} --tol 1e-4)
  set_tests_properties(reference_parity_${_m} PROPERTIES
    SKIP_RETURN_CODE 77 TIMEOUT 300 LABELS "reference")
endforeach()
