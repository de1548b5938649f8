// Warnings about a configuration are printed once per process: every rank's layer (and the CPU
// check's replica) meets the same rewrite, and one line says it.
#pragma once

#include <string>

namespace flexep {

// Logs "flexep: <message>" as a warning the first time this process sees `message` and returns true;
// later calls with the same text log nothing and return false. Thread-safe.
bool warn_once(const std::string& message);

}  // namespace flexep
