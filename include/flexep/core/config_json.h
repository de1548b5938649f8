// JSON form of BackendConfig and MoEConfig: the same field names as the structs (and as Automodel's
// YAML), enums as strings, Automodel's dtype spellings ("torch.bfloat16") accepted. Parsing applies
// the given keys on top of the defaults and never validates: callers call validate() so that one
// place owns the rules.
#pragma once

#include <string>

#include "flexep/core/config.h"

namespace flexep {

// Pretty-printed, every field, in declaration order.
std::string to_json(const BackendConfig& c);
std::string to_json(const MoEConfig& c);

// `text` is a JSON object. `where` prefixes error names ("moe" -> "moe.n_activated_experts").
// Unknown keys, wrong JSON types and syntax errors throw ArgumentError.
BackendConfig backend_config_from_json(const std::string& text, const std::string& where = "backend");
MoEConfig moe_config_from_json(const std::string& text, const std::string& where = "moe");

// A whole configuration document: {"moe": {...}, "backend": {...}, "train": {...}}, every section
// optional.
struct ConfigFile {
  MoEConfig moe;
  BackendConfig backend;
  std::string extra_json = "{}";  // the "train" object, raw (compact JSON)
};
// `where` names the document in syntax errors (a path, "<command line>"). The keys found are
// applied on top of `base` (the library defaults unless a program has its own).
ConfigFile parse_config(const std::string& text, const std::string& where, const ConfigFile& base = {});
ConfigFile load_config_file(const std::string& path, const ConfigFile& base = {});

// One command-line assignment, "moe.n_activated_experts=8" or "backend.dispatcher=hybridep". The
// value is parsed as JSON when it is valid JSON, else taken as a string.
void apply_override(MoEConfig& moe, BackendConfig& backend, const std::string& assignment);

// JSON nested deeper than this is refused before it is parsed (a config nests 2 levels; printing a
// value nested 100,000 deep in an error message would overflow the stack).
constexpr int kMaxJsonDepth = 64;
// Throws ArgumentError naming `where` when `text` (JSON, strings skipped) nests deeper than
// kMaxJsonDepth.
void check_json_depth(const std::string& text, const std::string& where);
// A JSON value for an error message: its type and text, cut to about 80 characters.
std::string describe_json_value(const std::string& type_name, const std::string& text);

}  // namespace flexep
