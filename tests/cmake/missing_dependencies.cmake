# Configures refit (configure only, no build) with dependencies hidden: UCX and xxHash (no
# pkg-config modules) and yaml-cpp (CMAKE_DISABLE_FIND_PACKAGE). Each must be named on one line
# with its Debian package, a package that scripts/setup.sh installs, and configuring must fail.
# Usage: cmake -DSOURCE=<refit> -DBINARY=<scratch dir> -DGENERATOR=<generator> -P missing_dependencies.cmake
file(REMOVE_RECURSE ${BINARY})
file(MAKE_DIRECTORY ${BINARY}/no-pkgconfig)
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env --unset=PKG_CONFIG_PATH PKG_CONFIG_LIBDIR=${BINARY}/no-pkgconfig
          ${CMAKE_COMMAND} -S ${SOURCE} -B ${BINARY}/build -G ${GENERATOR} -DREFIT_WITH_CUDA=OFF
          -DCMAKE_DISABLE_FIND_PACKAGE_yaml-cpp=TRUE
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
file(REMOVE_RECURSE ${BINARY})
set(output "${out}${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "configuring without UCX, xxHash and yaml-cpp succeeded:\n${output}")
endif()
file(READ ${SOURCE}/scripts/setup.sh setup)
foreach(dependency "UCX:libucx-dev" "xxHash:libxxhash-dev" "yaml-cpp:libyaml-cpp-dev")
  string(REPLACE ":" ";" pair ${dependency})
  list(GET pair 0 name)
  list(GET pair 1 debian)
  set(line "refit needs ${name} (Debian: ${debian}); run scripts/setup.sh, which installs what is missing\n")
  string(FIND "${output}" "${line}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "no line '${line}' in:\n${output}")
  endif()
  if(NOT setup MATCHES "[ (]${debian}[ )\n]")
    message(FATAL_ERROR "${debian} is not in scripts/setup.sh's packages")
  endif()
endforeach()
# Only the missing ones are named, and CMake's own multi-line errors do not appear.
foreach(absent "refit needs fmt" "Could NOT find" "required by 'virtual:world'")
  string(FIND "${output}" "${absent}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "'${absent}' in:\n${output}")
  endif()
endforeach()
