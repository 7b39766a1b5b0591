# ctest GitCommitLabelIsWrittenAtBuildTime: cmake/git_commit.cmake writes the label the binaries
# print at build time (a reused build directory used to keep the commit it was configured at), and
# rewrites the header only when the label changes (so an unchanged commit recompiles nothing).
#   cmake -DSCRIPT=cmake/git_commit.cmake -DWORK=<scratch dir> -P tests/cmake/test_git_commit.cmake
set(out "${WORK}/flashcpp_git_commit.h")
file(REMOVE "${out}")
function(run label)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env FLASHCPP_GIT_COMMIT=${label}
                          ${CMAKE_COMMAND} -DOUT=${out} -DSRC=${WORK} -DCONFIGURED=configured -P ${SCRIPT}
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "git_commit.cmake failed (${rc}) for label ${label}")
  endif()
endfunction()
function(expect label)
  file(READ "${out}" text)
  string(FIND "${text}" "#define FLASHCPP_GIT_COMMIT \"${label}\"" at)
  if(at LESS 0)
    message(FATAL_ERROR "expected label ${label} in ${out}, found:\n${text}")
  endif()
endfunction()
run(aaaa1111)
expect(aaaa1111)
run(bbbb2222)   # a later build at another commit: the header follows
expect(bbbb2222)
execute_process(COMMAND ${CMAKE_COMMAND} -E sleep 1)
file(TIMESTAMP "${out}" t_before "%s")
run(bbbb2222)   # the same label again: the file is not rewritten
file(TIMESTAMP "${out}" t_after "%s")
if(NOT t_before STREQUAL t_after)
  message(FATAL_ERROR "the header was rewritten for an unchanged label (mtime ${t_before} -> ${t_after})")
endif()
message(STATUS "git commit label: written at build time, rewritten only on change")
