#include "json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "error.h"

namespace lily {

class JsonParser {
 public:
  JsonParser(std::string_view s, const std::string& what) : s_(s), what_(what) {}

  Json parse_document() {
    Json v = parse_value(0);
    skip_ws();
    if (i_ != s_.size()) error("trailing characters");
    return v;
  }

 private:
  std::string_view s_;
  const std::string& what_;
  size_t i_ = 0;

  [[noreturn]] void error(const char* msg) const {
    fail(what_, ": invalid JSON at byte ", std::to_string(i_), ": ", msg);
  }
  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  char peek() {
    skip_ws();
    if (i_ >= s_.size()) error("unexpected end of input");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) error((std::string("expected '") + c + "'").c_str());
    ++i_;
  }

  Json parse_value(int depth) {
    if (depth > 64) error("nesting too deep");
    Json v;
    char c = peek();
    if (c == '{') {
      v.kind_ = Json::Kind::Object;
      ++i_;
      if (peek() == '}') { ++i_; return v; }
      for (;;) {
        if (peek() != '"') error("expected a string key");
        std::string key = parse_string();
        expect(':');
        v.obj_.emplace_back(std::move(key), parse_value(depth + 1));
        char d = peek();
        ++i_;
        if (d == '}') break;
        if (d != ',') error("expected ',' or '}'");
      }
    } else if (c == '[') {
      v.kind_ = Json::Kind::Array;
      ++i_;
      if (peek() == ']') { ++i_; return v; }
      for (;;) {
        v.arr_.push_back(parse_value(depth + 1));
        char d = peek();
        ++i_;
        if (d == ']') break;
        if (d != ',') error("expected ',' or ']'");
      }
    } else if (c == '"') {
      v.kind_ = Json::Kind::String;
      v.str_ = parse_string();
    } else if (c == 't' || c == 'f' || c == 'n') {
      auto word = [&](std::string_view w) {
        if (s_.substr(i_, w.size()) != w) error("invalid literal");
        i_ += w.size();
      };
      if (c == 't') { word("true"); v.kind_ = Json::Kind::Bool; v.b_ = true; }
      else if (c == 'f') { word("false"); v.kind_ = Json::Kind::Bool; }
      else { word("null"); }
    } else {
      v.kind_ = Json::Kind::Number;
      v.num_ = parse_number();
    }
    return v;
  }

  double parse_number() {
    size_t start = i_;
    if (i_ < s_.size() && (s_[i_] == '-' || s_[i_] == '+')) ++i_;
    while (i_ < s_.size() && (isdigit(static_cast<unsigned char>(s_[i_])) || s_[i_] == '.' ||
                              s_[i_] == 'e' || s_[i_] == 'E' || s_[i_] == '-' || s_[i_] == '+'))
      ++i_;
    // Python's json writes these for non-finite floats.
    for (std::string_view w : {"Infinity", "NaN"}) {
      if (s_.substr(i_, w.size()) == w) i_ += w.size();
    }
    std::string tok(s_.substr(start, i_ - start));
    if (tok.empty() || tok == "-" || tok == "+") error("expected a value");
    if (tok == "NaN") return NAN;
    if (tok == "Infinity") return INFINITY;
    if (tok == "-Infinity") return -INFINITY;
    char* end = nullptr;
    double d = std::strtod(tok.c_str(), &end);
    if (end != tok.c_str() + tok.size()) error("malformed number");
    return d;
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) out += static_cast<char>(cp);
    else if (cp < 0x800) { out += static_cast<char>(0xC0 | (cp >> 6)); out += static_cast<char>(0x80 | (cp & 0x3F)); }
    else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  uint32_t parse_hex4() {
    if (i_ + 4 > s_.size()) error("truncated \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      char h = s_[i_++];
      v <<= 4;
      if (h >= '0' && h <= '9') v |= h - '0';
      else if (h >= 'a' && h <= 'f') v |= h - 'a' + 10;
      else if (h >= 'A' && h <= 'F') v |= h - 'A' + 10;
      else error("bad hex digit in \\u escape");
    }
    return v;
  }

  std::string parse_string() {
    ++i_;  // opening quote
    std::string out;
    for (;;) {
      if (i_ >= s_.size()) error("unterminated string");
      char c = s_[i_++];
      if (c == '"') break;
      if (c != '\\') { out += c; continue; }
      if (i_ >= s_.size()) error("unterminated escape");
      char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = parse_hex4();
          if (cp >= 0xD800 && cp < 0xDC00 && i_ + 1 < s_.size() && s_[i_] == '\\' && s_[i_ + 1] == 'u') {
            i_ += 2;
            uint32_t lo = parse_hex4();
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default: error("invalid escape");
      }
    }
    return out;
  }
};

Json Json::parse(std::string_view text, const std::string& what) {
  return JsonParser(text, what).parse_document();
}

bool Json::is_integer() const {
  return kind_ == Kind::Number && std::isfinite(num_) && num_ == std::floor(num_) &&
         std::fabs(num_) < 9.2e18;
}

const Json* Json::find(std::string_view key) const {
  if (kind_ != Kind::Object) return nullptr;
  for (const auto& [k, v] : obj_)
    if (k == key) return &v;
  return nullptr;
}

std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char ch : s) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (ch < 0x20) {
          char esc[8];
          std::snprintf(esc, sizeof esc, "\\u%04x", ch);
          out += esc;
        } else {
          out += static_cast<char>(ch);
        }
    }
  }
  return out + "\"";
}

}  // namespace lily
