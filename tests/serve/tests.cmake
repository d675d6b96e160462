# `merlin serve` integration tests (included by tests/CMakeLists.txt). Each starts its own server on a free
# loopback port (--port 0) with models/merlin-default.gguf:
#   serve.http         curl: SSE wire format, 400/401/404/405/413/503, disconnects, SIGTERM (tests/serve/http.sh)
#   serve.sdk          the official OpenAI SDK, openai@^6 from tests/serve/install.sh (tests/serve/sdk.mjs)
#   serve.concurrency  32 streaming clients, some leaving early: batch invariance, KV blocks freed
# Skipped (exit 77) when node, curl, python3, the npm package or the model is missing.
if(NOT TARGET merlin)
  return()
endif()
set(_serve_model ${PROJECT_SOURCE_DIR}/models/merlin-default.gguf)
find_program(MERLIN_BASH bash REQUIRED)
add_test(NAME serve.http COMMAND ${MERLIN_BASH} ${CMAKE_CURRENT_LIST_DIR}/http.sh $<TARGET_FILE:merlin> ${_serve_model})
set_tests_properties(serve.http PROPERTIES TIMEOUT 180 SKIP_RETURN_CODE 77 LABELS serve)

find_program(MERLIN_NODE node)
if(NOT MERLIN_NODE)
  message(STATUS "tests/serve: node not found; the OpenAI SDK tests of the server are not registered")
  return()
endif()
foreach(_t sdk concurrency)
  add_test(NAME serve.${_t} COMMAND ${MERLIN_NODE} ${CMAKE_CURRENT_LIST_DIR}/${_t}.mjs $<TARGET_FILE:merlin> ${_serve_model})
  set_tests_properties(serve.${_t} PROPERTIES TIMEOUT 180 SKIP_RETURN_CODE 77 LABELS serve)
endforeach()
