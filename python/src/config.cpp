// BackendConfig and MoEConfig cross the boundary as JSON, the format the library already parses and
// validates (core/config_json.h): Python builds a dict with Automodel's field names, and every rule
// (ranges, allowed values, normalisation) runs here in C++, so the messages are the library's own.
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "flexep/core/config_json.h"

namespace flexep::py {

void bind_config(nb::module_& m) {
  nb::module_ c = m.def_submodule("config", "BackendConfig / MoEConfig validation and normalisation (C++)");
  c.def(
      "check_backend",
      [](const std::string& json) {
        BackendConfig b = backend_config_from_json(json);
        validate(b);
        return to_json(b);
      },
      nb::arg("json"), "Parses and validates a backend config; returns the canonical JSON (every field).");
  c.def(
      "check_moe",
      [](const std::string& json) {
        MoEConfig moe = moe_config_from_json(json);
        validate(moe);
        return to_json(moe);
      },
      nb::arg("json"), "Parses and validates an MoE config; returns the canonical JSON (every field).");
  c.def(
      "check_ep",
      [](const std::string& moe_json, int ep_size) { validate_ep(moe_config_from_json(moe_json), ep_size); },
      nb::arg("moe_json"), nb::arg("ep_size"), "Checks what depends on the EP size (E divisible by it).");
  c.def(
      "normalize_backend",
      [](const std::string& json, int ep_size) {
        BackendConfig b = backend_config_from_json(json);
        validate(b);
        Normalization n = normalize(b, ep_size);
        return std::make_tuple(to_json(b), n.messages, n.local_fallback);
      },
      nb::arg("json"), nb::arg("ep_size"),
      "Automodel's rewrites made visible: returns (json, messages, local_fallback).");
}

}  // namespace flexep::py
