# The Debian package (cpack -G DEB in a build folder): the binary, libquern
# with its headers and CMake/pkg-config files, the ONNX Runtime library in
# /usr/lib/quern, the OpenVINO plugin with OpenVINO's runtime in
# /usr/lib/quern/openvino (where the build found it), the systemd unit and the default settings; the maintainer
# scripts make the user `quern`, /var/lib/quern/models and
# /etc/quern/quern.toml, and enable the service where systemd runs.
include(GNUInstallDirs)
install(FILES ${PROJECT_SOURCE_DIR}/packaging/quern.service DESTINATION lib/systemd/system COMPONENT runtime)
install(FILES ${PROJECT_SOURCE_DIR}/packaging/quern.toml DESTINATION ${CMAKE_INSTALL_DATADIR}/quern COMPONENT runtime)
install(FILES ${PROJECT_SOURCE_DIR}/README.md ${PROJECT_SOURCE_DIR}/LICENSE ${PROJECT_SOURCE_DIR}/NOTICE
        DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT runtime)
# The Debian package's machine-readable copyright file (/usr/share/doc/quern/copyright).
install(FILES ${PROJECT_SOURCE_DIR}/packaging/debian/copyright DESTINATION ${CMAKE_INSTALL_DOCDIR} COMPONENT runtime)
set(CPACK_RESOURCE_FILE_LICENSE ${PROJECT_SOURCE_DIR}/LICENSE)

set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME quern)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "Quern, a small fast model server (KServe v2, Triton configs, ONNX Runtime, OpenVINO)")
set(CPACK_PACKAGE_DESCRIPTION "Serves ONNX, Python and C++ models from a Triton-style repository with dynamic batching \
over KServe v2 HTTP and gRPC, the CodeProject.AI vision API and /predict; runs as the systemd service quern.")
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "Quern developers <quern@localhost>")
set(CPACK_DEBIAN_PACKAGE_SECTION net)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS_PRIVATE_DIRS "${CMAKE_INSTALL_LIBDIR}/quern" "${CMAKE_INSTALL_LIBDIR}/quern/openvino")
set(CPACK_DEBIAN_PACKAGE_GENERATE_SHLIBS ON)
set(CPACK_DEBIAN_PACKAGE_DEPENDS "passwd")
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "python3, python3-numpy")
set(CPACK_DEBIAN_PACKAGE_CONTROL_EXTRA "${PROJECT_SOURCE_DIR}/packaging/debian/postinst;${PROJECT_SOURCE_DIR}/packaging/debian/prerm;${PROJECT_SOURCE_DIR}/packaging/debian/postrm")
set(CPACK_DEBIAN_PACKAGE_CONTROL_STRICT_PERMISSION ON)
include(CPack)
