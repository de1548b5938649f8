#include "flexep/core/config_json.h"

#include <algorithm>
#include <climits>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "flexep/core/error.h"

namespace flexep {

namespace {
using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

// One struct member: how to write it and how to read it back from a JSON value.
template <class C>
struct Field {
  std::string name;
  std::function<ojson(const C&)> get;
  std::function<void(C&, const json&, const std::string& arg)> set;
};

std::string given(const json& v) { return describe_json_value(v.type_name(), v.dump()); }

[[noreturn]] void wrong_type(const json& v, const std::string& arg, const char* expected) {
  throw_argument_error(arg, "expected ", expected, ", got ", given(v));
}

int as_int(const json& v, const std::string& arg) {
  if (!v.is_number_integer()) wrong_type(v, arg, "an integer");
  const bool fits = v.is_number_unsigned() ? v.get<std::uint64_t>() <= static_cast<std::uint64_t>(INT_MAX)
                                           : v.get<std::int64_t>() >= INT_MIN && v.get<std::int64_t>() <= INT_MAX;
  FLEXEP_CHECK_ARG(fits, arg, "value ", given(v), " does not fit a 32-bit integer");
  return v.get<int>();
}

double as_double(const json& v, const std::string& arg) {
  if (!v.is_number()) wrong_type(v, arg, "a number");
  return v.get<double>();
}

bool as_bool(const json& v, const std::string& arg) {
  if (!v.is_boolean()) wrong_type(v, arg, "a boolean (true or false)");
  return v.get<bool>();
}

std::string as_string(const json& v, const std::string& arg, const char* expected) {
  if (!v.is_string()) wrong_type(v, arg, expected);
  return v.get<std::string>();
}

// Automodel writes dtypes as "torch.bfloat16", "bfloat16" or "float32"; we write the long name.
std::string_view long_dtype_name(DType t) {
  switch (t) {
    case DType::bf16:
      return "bfloat16";
    case DType::f16:
      return "float16";
    case DType::f32:
      return "float32";
    case DType::f64:
      return "float64";
    default:
      return dtype_name(t);
  }
}

DType as_dtype(const json& v, const std::string& arg) {
  const std::string s = as_string(v, arg, "a dtype string such as \"bfloat16\" or \"torch.float32\"");
  const auto t = parse_dtype(s);
  FLEXEP_CHECK_ARG(t.has_value(), arg, "unknown dtype '", s,
                   "'; allowed: bfloat16, float16, float32, float64 (also bf16/f16/f32/f64, with or without 'torch.')");
  return *t;
}

template <class C>
Field<C> int_field(const char* name, int C::*m) {
  return {name, [m](const C& c) { return ojson(c.*m); },
          [m](C& c, const json& v, const std::string& a) { c.*m = as_int(v, a); }};
}
template <class C>
Field<C> double_field(const char* name, double C::*m) {
  return {name, [m](const C& c) { return ojson(c.*m); },
          [m](C& c, const json& v, const std::string& a) { c.*m = as_double(v, a); }};
}
template <class C>
Field<C> bool_field(const char* name, bool C::*m) {
  return {name, [m](const C& c) { return ojson(c.*m); },
          [m](C& c, const json& v, const std::string& a) { c.*m = as_bool(v, a); }};
}
template <class C, class E>
Field<C> enum_field(const char* name, E C::*m, E (*parse)(std::string_view, const std::string&)) {
  return {name, [m](const C& c) { return ojson(std::string(to_string(c.*m))); },
          [m, parse](C& c, const json& v, const std::string& a) { c.*m = parse(as_string(v, a, "a string"), a); }};
}

const std::vector<Field<BackendConfig>>& backend_fields() {
  using B = BackendConfig;
  static const std::vector<Field<B>> fields{
      enum_field("dispatcher", &B::dispatcher, &parse_dispatcher),
      enum_field("experts", &B::experts, &parse_experts),
      int_field("dispatcher_num_sms", &B::dispatcher_num_sms),
      int_field("deepep_num_sms", &B::deepep_num_sms),
      int_field("hybridep_num_sms", &B::hybridep_num_sms),
      int_field("hybridep_dispatch_sms", &B::hybridep_dispatch_sms),
      int_field("hybridep_combine_sms", &B::hybridep_combine_sms),
      int_field("hybridep_preprocess_sms", &B::hybridep_preprocess_sms),
      bool_field("fake_balanced_gate", &B::fake_balanced_gate),
      double_field("fake_gate_noise", &B::fake_gate_noise),
      {"gate_precision",
       [](const B& c) {
         return c.gate_precision ? ojson(std::string(long_dtype_name(*c.gate_precision))) : ojson(nullptr);
       },
       [](B& c, const json& v, const std::string& a) {
         if (v.is_null())
           c.gate_precision.reset();
         else
           c.gate_precision = as_dtype(v, a);
       }},
      bool_field("rows_in_place", &B::rows_in_place),
      int_field("dispatch_chunks", &B::dispatch_chunks),
  };
  return fields;
}

const std::vector<Field<MoEConfig>>& moe_fields() {
  using M = MoEConfig;
  static const std::vector<Field<M>> fields{
      int_field("n_routed_experts", &M::n_routed_experts),
      int_field("n_shared_experts", &M::n_shared_experts),
      int_field("n_activated_experts", &M::n_activated_experts),
      int_field("n_expert_groups", &M::n_expert_groups),
      int_field("n_limited_groups", &M::n_limited_groups),
      bool_field("train_gate", &M::train_gate),
      double_field("gate_bias_update_factor", &M::gate_bias_update_factor),
      double_field("aux_loss_coeff", &M::aux_loss_coeff),
      enum_field("score_func", &M::score_func, &parse_score_func),
      double_field("route_scale", &M::route_scale),
      int_field("dim", &M::dim),
      int_field("inter_dim", &M::inter_dim),
      int_field("moe_inter_dim", &M::moe_inter_dim),
      bool_field("norm_topk_prob", &M::norm_topk_prob),
      bool_field("router_bias", &M::router_bias),
      bool_field("expert_bias", &M::expert_bias),
      enum_field("expert_activation", &M::expert_activation, &parse_activation),
      double_field("activation_alpha", &M::activation_alpha),
      double_field("activation_limit", &M::activation_limit),
      bool_field("softmax_before_topk", &M::softmax_before_topk),
      bool_field("shared_expert_gate", &M::shared_expert_gate),
      // Automodel's default is None (use moe_inter_dim), which is our 0.
      {"shared_expert_inter_dim", [](const M& c) { return ojson(c.shared_expert_inter_dim); },
       [](M& c, const json& v, const std::string& a) { c.shared_expert_inter_dim = v.is_null() ? 0 : as_int(v, a); }},
      enum_field("shared_expert_activation", &M::shared_expert_activation, &parse_activation),
      bool_field("force_e_score_correction_bias", &M::force_e_score_correction_bias),
      {"dtype", [](const M& c) { return ojson(std::string(long_dtype_name(c.dtype))); },
       [](M& c, const json& v, const std::string& a) { c.dtype = as_dtype(v, a); }},
      // Automodel 0.7.0's later fields, in its order, then flexep's own.
      bool_field("apply_router_weight_after_down", &M::apply_router_weight_after_down),
      double_field("swiglu_limit", &M::swiglu_limit),
      bool_field("router_weights_fp32", &M::router_weights_fp32),
      bool_field("router_weight_uses_score_correction_bias", &M::router_weight_uses_score_correction_bias),
      {"gate_dtype",
       [](const M& c) { return c.gate_dtype ? ojson(std::string(long_dtype_name(*c.gate_dtype))) : ojson(nullptr); },
       [](M& c, const json& v, const std::string& a) {
         if (v.is_null())
           c.gate_dtype.reset();
         else
           c.gate_dtype = as_dtype(v, a);
       }},
      // Automodel's None is our 0; an explicit 0 would be a zero-width projection there.
      {"moe_latent_size", [](const M& c) { return c.moe_latent_size > 0 ? ojson(c.moe_latent_size) : ojson(nullptr); },
       [](M& c, const json& v, const std::string& a) {
         if (v.is_null()) {
           c.moe_latent_size = 0;
           return;
         }
         const int n = as_int(v, a);
         FLEXEP_CHECK_ARG(n >= 1 && n <= (1 << 20), a, "is ", n, "; allowed: 1 to 1048576, or null for none");
         c.moe_latent_size = n;
       }},
      bool_field("enable_routing_replay", &M::enable_routing_replay),
      enum_field("group_mask", &M::group_mask, &parse_group_mask),
  };
  return fields;
}

template <class C>
std::string known_keys(const std::vector<Field<C>>& fields) {
  std::string s;
  for (const auto& f : fields) s += (s.empty() ? "" : ", ") + f.name;
  return s;
}

template <class C>
const Field<C>& find_field(const std::vector<Field<C>>& fields, const std::string& key, const std::string& where) {
  for (const auto& f : fields)
    if (f.name == key) return f;
  throw_argument_error(where + "." + key, "unknown key; known keys: ", known_keys(fields));
}

template <class C>
void apply_object(C& c, const std::vector<Field<C>>& fields, const json& obj, const std::string& where) {
  if (!obj.is_object()) wrong_type(obj, where, "a JSON object");
  for (const auto& [key, value] : obj.items()) {
    const std::string arg = where + "." + key;
    find_field(fields, key, where).set(c, value, arg);
  }
}

template <class C>
std::string dump_fields(const C& c, const std::vector<Field<C>>& fields) {
  ojson out = ojson::object();
  for (const auto& f : fields) out[f.name] = f.get(c);
  return out.dump(2);
}

// Line and column make a syntax error findable in a hand-edited file; nlohmann reports bytes only.
// A key given twice in one object is refused (nlohmann would keep the last silently).
json parse_text(const std::string& text, const std::string& where) {
  if (const std::size_t nul = text.find('\0'); nul != std::string::npos)
    throw_argument_error(where, "holds a NUL byte at byte ", nul, "; a configuration is JSON text");
  check_json_depth(text, where);
  std::vector<std::vector<std::string>> keys;  // the keys of each open object, innermost last
  const json::parser_callback_t unique_keys = [&](int, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      keys.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      keys.pop_back();
    } else if (event == json::parse_event_t::key) {
      const std::string k = parsed.get<std::string>();
      std::vector<std::string>& seen = keys.back();
      if (std::find(seen.begin(), seen.end(), k) != seen.end())
        throw_argument_error(where, "key '", k, "' appears twice in one object; give each key once");
      seen.push_back(k);
    }
    return true;
  };
  try {
    return json::parse(text, unique_keys, true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    std::size_t line = 1, col = 1;
    const std::size_t end = std::min<std::size_t>(e.byte > 0 ? e.byte - 1 : 0, text.size());
    for (std::size_t i = 0; i < end; ++i) {
      if (text[i] == '\n')
        ++line, col = 1;
      else
        ++col;
    }
    // Drop nlohmann's own "[json.exception...] parse error at ...: " prefix, whose column is off.
    std::string reason = e.what();
    if (const std::size_t p = reason.find(": "); p != std::string::npos) reason.erase(0, p + 2);
    throw_argument_error(where, "JSON syntax error at line ", line, ", column ", col, " (byte ", e.byte, "): ", reason);
  } catch (const json::exception& e) {  // e.g. 406: a number such as 1e400 that no double holds
    std::string reason = e.what();
    if (const std::size_t p = reason.find("] "); p != std::string::npos) reason.erase(0, p + 2);
    throw_argument_error(where, "JSON value out of range: ", reason);
  }
}
}  // namespace

std::string to_json(const BackendConfig& c) { return dump_fields(c, backend_fields()); }
std::string to_json(const MoEConfig& c) { return dump_fields(c, moe_fields()); }

BackendConfig backend_config_from_json(const std::string& text, const std::string& where) {
  BackendConfig c;
  apply_object(c, backend_fields(), parse_text(text, where), where);
  return c;
}

MoEConfig moe_config_from_json(const std::string& text, const std::string& where) {
  MoEConfig c;
  apply_object(c, moe_fields(), parse_text(text, where), where);
  return c;
}

ConfigFile parse_config(const std::string& text, const std::string& where, const ConfigFile& base) {
  const json doc = parse_text(text, where);
  if (!doc.is_object()) wrong_type(doc, where, "a JSON object with sections moe, backend, train");
  ConfigFile f = base;
  for (const auto& [key, value] : doc.items()) {
    if (key == "moe") {
      apply_object(f.moe, moe_fields(), value, "moe");
    } else if (key == "backend") {
      apply_object(f.backend, backend_fields(), value, "backend");
    } else if (key == "train") {
      if (!value.is_object()) wrong_type(value, key, "a JSON object");
      f.extra_json = value.dump();
    } else {
      throw_argument_error(key, "unknown top-level section in ", where, "; allowed: moe, backend, train");
    }
  }
  return f;
}

ConfigFile load_config_file(const std::string& path, const ConfigFile& base) {
  // A device (/dev/zero) or a FIFO would be read forever; a config is a small file.
  std::error_code ec;
  FLEXEP_CHECK_ARG(std::filesystem::exists(path, ec), "config_file", "'", path, "' does not exist");
  FLEXEP_CHECK_ARG(std::filesystem::is_regular_file(path, ec), "config_file", "'", path,
                   "' is not a regular file; allowed: a JSON file");
  const auto bytes = std::filesystem::file_size(path, ec);
  constexpr std::uintmax_t kMaxBytes = 16u << 20;
  FLEXEP_CHECK_ARG(!ec && bytes <= kMaxBytes, "config_file", "'", path, "' holds ", bytes,
                   " bytes; allowed: at most 16 MiB");
  std::ifstream in(path, std::ios::binary);
  FLEXEP_CHECK_ARG(in.good(), "config_file", "cannot open '", path, "' for reading");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_config(text.str(), path, base);
}

void apply_override(MoEConfig& moe, BackendConfig& backend, const std::string& assignment) {
  const std::size_t eq = assignment.find('=');
  FLEXEP_CHECK_ARG(eq != std::string::npos && eq > 0, assignment,
                   "is not an assignment; expected "
                   "'moe.<field>=<value>' or 'backend.<field>=<value>'");
  const std::string key = assignment.substr(0, eq), text = assignment.substr(eq + 1);
  const std::size_t dot = key.find('.');
  const std::string section = dot == std::string::npos ? key : key.substr(0, dot);
  FLEXEP_CHECK_ARG(dot != std::string::npos && (section == "moe" || section == "backend"), key,
                   "unknown section; expected 'moe.<field>=<value>' or 'backend.<field>=<value>'");
  const std::string field = key.substr(dot + 1);
  // Bare words (hybridep, torch.bfloat16) are not JSON; they are meant as strings.
  check_json_depth(text, key);
  json value = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) value = text;
  if (section == "moe")
    find_field(moe_fields(), field, section).set(moe, value, key);
  else
    find_field(backend_fields(), field, section).set(backend, value, key);
}

void check_json_depth(const std::string& text, const std::string& where) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (ch == '\\') escaped = true;
      else if (ch == '"') in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      FLEXEP_CHECK_ARG(++depth <= kMaxJsonDepth, where, "JSON nested deeper than ", kMaxJsonDepth,
                       " levels (at byte ", i, "); a configuration nests 2");
    } else if (ch == ']' || ch == '}') {
      --depth;
    }
  }
}

std::string describe_json_value(const std::string& type_name, const std::string& text) {
  if (type_name == "null") return "null";
  constexpr std::size_t kShown = 80;
  if (text.size() <= kShown) return type_name + " " + text;
  return type_name + " " + text.substr(0, kShown) + "... (" + std::to_string(text.size()) + " characters)";
}

}  // namespace flexep
