// libquern.so: the Engine API (include/quern/) in one shared library. Its
// code comes whole from the engine's static libraries (see CMakeLists.txt);
// this file only gives the library target a source of its own.
