# Included into the llama.cpp tree's own configure (CMAKE_PROJECT_llama.cpp_INCLUDE, set by
# spec-replay's CMakeLists.txt) to add spec-replay's helper programs as targets of that tree, so
# they link the tree's libraries with the tree's own flags. Deferred to the end of the top-level
# directory, when every target of the tree exists.
set(_spec_replay_native_dir "${CMAKE_CURRENT_LIST_DIR}")
function(_spec_replay_add_helpers)
    if(TARGET server-context)
        # the server's request parsing is a library from b7000-something on (tools/server/CMakeLists.txt)
        add_executable(spec-replay-request "${_spec_replay_native_dir}/server_request.cpp")
        target_include_directories(spec-replay-request PRIVATE
            "${CMAKE_SOURCE_DIR}/tools/server" "${CMAKE_SOURCE_DIR}/tools/mtmd" "${CMAKE_SOURCE_DIR}")
        target_link_libraries(spec-replay-request PRIVATE server-context)
        target_compile_features(spec-replay-request PRIVATE cxx_std_17)
        # ENABLE_EXPORTS (-rdynamic): the program's own system_clock::now() (server_request.cpp) is then
        # also the one libllama-common.so binds to (common_chat_extra_context reads the clock there)
        set_target_properties(spec-replay-request PROPERTIES RUNTIME_OUTPUT_DIRECTORY "${CMAKE_BINARY_DIR}/bin"
                                                             ENABLE_EXPORTS ON)
    else()
        # older trees keep the request parsing inside llama-server: nothing to link against
        add_custom_target(spec-replay-request
            COMMAND "${CMAKE_COMMAND}" -E echo "spec-replay-request: this llama.cpp tree has no server-context library")
    endif()
endfunction()
cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL _spec_replay_add_helpers)
