# Third-party libraries, all from the system (Debian/Ubuntu packages; scripts/install-deps.sh).
find_package(Threads REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(CLI11 CONFIG REQUIRED)
if(FLEXEP_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
