# llama.cpp interoperability (included by tests/CMakeLists.txt): llama.cpp, through the prebuilt binding of the
# npm package node-llama-cpp (installed by tests/interop/install.sh), loads GGUF files written by `merlin init`
# and must produce the same greedy token ids as `merlin run`. Skipped (exit 77) when node, the npm packages or
# the GPT-2 vocabulary ($MERLIN_DATA, else MERLIN_DEFAULT_DATA_DIR)/tokenizer/gpt2 are missing.
if(NOT TARGET merlin)
  return()
endif()
find_program(MERLIN_NODE node)
if(NOT MERLIN_NODE)
  message(STATUS "tests/interop: node not found; llama.cpp interop test not registered")
  return()
endif()
add_test(NAME interop.llamacpp_greedy
  COMMAND ${MERLIN_NODE} ${CMAKE_CURRENT_LIST_DIR}/llamacpp_greedy.mjs $<TARGET_FILE:merlin>)
# The script reads $MERLIN_DATA first (from ctest's environment), then MERLIN_DEFAULT_DATA_DIR.
set_tests_properties(interop.llamacpp_greedy PROPERTIES
  ENVIRONMENT "MERLIN_DEFAULT_DATA_DIR=${MERLIN_DEFAULT_DATA_DIR}"
  SKIP_RETURN_CODE 77 TIMEOUT 900 LABELS interop)
