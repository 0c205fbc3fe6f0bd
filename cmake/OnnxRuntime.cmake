# Provides the imported target onnxruntime::onnxruntime.
# Prefers a system installation (CMake package or pkg-config) and falls back to
# third_party/onnxruntime, which scripts/setup.sh fills with the pinned 1.32.0 (1.21.0 headers: the C API is versioned).
set(QUERN_ORT_ROOT "${PROJECT_SOURCE_DIR}/third_party/onnxruntime" CACHE PATH "Fallback ONNX Runtime prefix")

find_package(onnxruntime CONFIG QUIET)
if(TARGET onnxruntime::onnxruntime)
  message(STATUS "ONNX Runtime: system CMake package ${onnxruntime_DIR}")
  return()
endif()

find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(ORT_PC QUIET IMPORTED_TARGET libonnxruntime)
  if(ORT_PC_FOUND)
    add_library(onnxruntime::onnxruntime ALIAS PkgConfig::ORT_PC)
    message(STATUS "ONNX Runtime: system pkg-config ${ORT_PC_VERSION}")
    return()
  endif()
endif()

find_path(QUERN_ORT_INCLUDE onnxruntime_cxx_api.h PATHS "${QUERN_ORT_ROOT}/include" NO_DEFAULT_PATH)
find_library(QUERN_ORT_LIB NAMES onnxruntime PATHS "${QUERN_ORT_ROOT}/lib" NO_DEFAULT_PATH)
if(NOT QUERN_ORT_INCLUDE OR NOT QUERN_ORT_LIB)
  message(FATAL_ERROR "ONNX Runtime not found: run scripts/setup.sh (it installs 1.32.0 into ${QUERN_ORT_ROOT})")
endif()
add_library(onnxruntime::onnxruntime SHARED IMPORTED GLOBAL)
set_target_properties(onnxruntime::onnxruntime PROPERTIES
  IMPORTED_LOCATION "${QUERN_ORT_ROOT}/lib/libonnxruntime.so.1"
  IMPORTED_SONAME "libonnxruntime.so.1"
  INTERFACE_INCLUDE_DIRECTORIES "${QUERN_ORT_INCLUDE}")
# Binaries find the library without LD_LIBRARY_PATH.
set(CMAKE_BUILD_RPATH "${QUERN_ORT_ROOT}/lib" CACHE INTERNAL "")
message(STATUS "ONNX Runtime: ${QUERN_ORT_ROOT}")

# Installs the ONNX Runtime library that Quern links against into
# DESTINATION (a private folder found through RUNPATH), under its soname, and
# its licence and third-party notices (scripts/setup.sh keeps them from the
# wheel) into NOTICES_DESTINATION. Nothing to do for a system ONNX Runtime (a
# package or pkg-config), which brings its own.
function(quern_install_onnxruntime destination notices_destination component)
  get_target_property(soname onnxruntime::onnxruntime IMPORTED_SONAME)
  get_target_property(location onnxruntime::onnxruntime IMPORTED_LOCATION)
  if(soname AND location)
    file(REAL_PATH "${location}" file)
    install(FILES "${file}" DESTINATION "${destination}" RENAME "${soname}" COMPONENT ${component})
    foreach(notice LICENSE ThirdPartyNotices.txt)
      if(EXISTS "${QUERN_ORT_ROOT}/${notice}")
        install(FILES "${QUERN_ORT_ROOT}/${notice}" DESTINATION "${notices_destination}" COMPONENT ${component})
      endif()
    endforeach()
  endif()
endfunction()
