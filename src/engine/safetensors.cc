// safetensors reading and writing: see safetensors.h. Every number in a header comes from
// outside the process, so each one is checked (type, sign, range, overflow) before it is used,
// and every refusal is one sentence naming the file and the tensor.
#include "engine/safetensors.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "flashcpp/half.h"

namespace flashcpp::engine {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; the loader reads it in place");

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

/// Headers larger than this are refused before anything is allocated (real ones are < 1 MB).
constexpr std::uint64_t kMaxHeaderBytes = 100ull << 20;
/// Index files larger than this are refused (real ones are < 100 KB).
constexpr std::uint64_t kMaxIndexBytes = 64ull << 20;
/// Tensors are read and converted this many bytes at a time.
constexpr std::size_t kChunkBytes = 16u << 20;

struct DTypeName {
  StDType t;
  const char* name;
  std::size_t size;
};
constexpr DTypeName kDTypes[] = {
    {StDType::kF32, "F32", 4},         {StDType::kF16, "F16", 2},         {StDType::kBF16, "BF16", 2},
    {StDType::kF64, "F64", 8},         {StDType::kI64, "I64", 8},         {StDType::kI32, "I32", 4},
    {StDType::kI16, "I16", 2},         {StDType::kI8, "I8", 1},           {StDType::kU8, "U8", 1},
    {StDType::kBool, "BOOL", 1},       {StDType::kF8E4M3, "F8_E4M3", 1},  {StDType::kF8E5M2, "F8_E5M2", 1},
};

bool parse_dtype(std::string_view s, StDType* t) {
  for (const auto& d : kDTypes) {
    if (s == d.name) {
      *t = d.t;
      return true;
    }
  }
  return false;
}

std::string known_dtypes() {
  std::string s;
  for (const auto& d : kDTypes) {
    if (!s.empty()) s += ", ";
    s += d.name;
  }
  return s;
}

std::string shape_str(const std::vector<std::int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

/// A JSON value shown in a message: short, on one line, never throwing.
std::string brief(const json& j) {
  std::string s = j.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

/// The numel of `shape`, or false when the product does not fit in int64.
bool checked_numel(const std::vector<std::int64_t>& shape, std::int64_t* n) {
  std::int64_t p = 1;
  for (std::int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(p, d, &p)) return false;
  }
  *n = p;
  return true;
}

/// Header parsing with a label (the file's path, or "safetensors header") for the messages.
Status parse_header(const std::string& label, const std::uint8_t* data, std::size_t size, std::uint64_t file_size,
                    std::vector<StTensorInfo>* out, std::map<std::string, std::string>* metadata) {
  if (data == nullptr && size != 0) return Status::Invalid(fmt::format("{}: no header bytes were given", label));
  if (size > file_size) {
    return Status::Invalid(fmt::format("{}: {} header bytes were given for a file of only {} bytes", label, size,
                                       file_size));
  }
  if (file_size < 8) {
    return Status::Invalid(fmt::format(
        "{}: the file is {} bytes, too short to hold the 8-byte header size of a safetensors file", label, file_size));
  }
  if (size < 8) {
    return Status::Invalid(fmt::format("{}: only {} bytes were given, fewer than the 8-byte header size", label, size));
  }
  std::uint64_t h = 0;
  for (int i = 7; i >= 0; --i) h = (h << 8) | data[i];
  if (h > kMaxHeaderBytes) {
    return Status::Invalid(fmt::format(
        "{}: header size {} bytes is larger than the {} MB this loader accepts (not a safetensors file?)", label, h,
        kMaxHeaderBytes >> 20));
  }
  if (h > file_size - 8) {
    return Status::Invalid(fmt::format(
        "{}: header size {} bytes is larger than the file allows ({} bytes, so at most {}); the file is truncated "
        "or not a safetensors file",
        label, h, file_size, file_size - 8));
  }
  if (h > size - 8) {
    return Status::Invalid(fmt::format("{}: header size is {} bytes but only {} header bytes were given", label, h,
                                       size - 8));
  }
  const char* text = reinterpret_cast<const char*>(data + 8);
  json root;
  // The same tensor named twice would be ambiguous (JSON parsers keep one or the other): refused.
  std::set<std::string> keys;
  std::string duplicate;
  const json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key && duplicate.empty() && parsed.is_string() &&
        !keys.insert(parsed.get<std::string>()).second) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  try {
    root = json::parse(text, text + h, on_event);
  } catch (const json::exception& e) {
    return Status::Invalid(fmt::format("{}: the {}-byte header is not valid JSON ({})", label, h, e.what()));
  }
  if (!duplicate.empty()) {
    return Status::Invalid(fmt::format("{}: tensor '{}' is named twice in the header", label, duplicate));
  }
  if (!root.is_object()) {
    return Status::Invalid(
        fmt::format("{}: the header must be a JSON object of tensors, not a JSON {}", label, root.type_name()));
  }

  const std::uint64_t data_begin = 8 + h;
  const std::uint64_t data_size = file_size - data_begin;
  std::vector<StTensorInfo> tensors;
  std::map<std::string, std::string> meta;
  tensors.reserve(root.size());
  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      if (entry.is_null()) continue;  // as the reference implementation reads it: no metadata
      if (!entry.is_object()) {
        return Status::Invalid(fmt::format("{}: \"__metadata__\" must be an object of strings, not a JSON {}", label,
                                           entry.type_name()));
      }
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) {
          return Status::Invalid(fmt::format("{}: \"__metadata__\" entry '{}' must be a string, not a JSON {} ({})",
                                             label, k, v.type_name(), brief(v)));
        }
        meta[k] = v.get<std::string>();
      }
      continue;
    }
    const std::string where = fmt::format("{}: tensor '{}'", label, name);
    if (!entry.is_object()) {
      return Status::Invalid(fmt::format("{} must be an object with dtype, shape and data_offsets, not a JSON {}",
                                         where, entry.type_name()));
    }
    StTensorInfo info;
    info.name = name;

    const auto dt = entry.find("dtype");
    if (dt == entry.end()) return Status::Invalid(fmt::format("{} has no \"dtype\"", where));
    if (!dt->is_string()) {
      return Status::Invalid(
          fmt::format("{}: \"dtype\" must be a string, not a JSON {} ({})", where, dt->type_name(), brief(*dt)));
    }
    if (!parse_dtype(dt->get_ref<const std::string&>(), &info.dtype)) {
      return Status::Invalid(fmt::format("{} has unknown dtype {} (known: {})", where, brief(*dt), known_dtypes()));
    }

    const auto sh = entry.find("shape");
    if (sh == entry.end()) return Status::Invalid(fmt::format("{} has no \"shape\"", where));
    if (!sh->is_array()) {
      return Status::Invalid(fmt::format("{}: \"shape\" must be an array of non-negative integers, not a JSON {} ({})",
                                         where, sh->type_name(), brief(*sh)));
    }
    info.shape.reserve(sh->size());
    for (const auto& d : *sh) {
      if (d.is_number_unsigned() && d.get<std::uint64_t>() <= std::uint64_t(std::numeric_limits<std::int64_t>::max())) {
        info.shape.push_back(static_cast<std::int64_t>(d.get<std::uint64_t>()));
      } else if (d.is_number_integer() && !d.is_number_unsigned() && d.get<std::int64_t>() >= 0) {
        info.shape.push_back(d.get<std::int64_t>());
      } else {
        return Status::Invalid(
            fmt::format("{}: \"shape\" entries must be non-negative integers that fit in 64 bits; {} in {} is not",
                        where, brief(d), brief(*sh)));
      }
    }

    const auto off = entry.find("data_offsets");
    if (off == entry.end()) return Status::Invalid(fmt::format("{} has no \"data_offsets\"", where));
    if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned()) {
      return Status::Invalid(fmt::format(
          "{}: \"data_offsets\" must be an array of two non-negative integers [begin, end], not {}", where,
          brief(*off)));
    }
    const std::uint64_t b = (*off)[0].get<std::uint64_t>(), e = (*off)[1].get<std::uint64_t>();
    if (b > e) {
      return Status::Invalid(fmt::format("{}: data_offsets [{}, {}] end before they begin", where, b, e));
    }

    std::int64_t numel = 0;
    std::uint64_t nbytes = 0;
    const std::size_t esize = st_dtype_size(info.dtype);
    if (!checked_numel(info.shape, &numel) ||
        __builtin_mul_overflow(static_cast<std::uint64_t>(numel), static_cast<std::uint64_t>(esize), &nbytes)) {
      return Status::Invalid(fmt::format("{}: shape {} of {} has more bytes than fit in 64 bits", where,
                                         shape_str(info.shape), st_dtype_name(info.dtype)));
    }
    if (e - b != nbytes) {
      return Status::Invalid(fmt::format(
          "{} data_offsets [{}, {}] do not match its shape {} of {} ({} bytes expected, {} given)", where, b, e,
          shape_str(info.shape), st_dtype_name(info.dtype), nbytes, e - b));
    }
    if (e > data_size) {
      return Status::Invalid(fmt::format(
          "{}: data_offsets [{}, {}] end past the data region, which holds {} bytes (file of {} bytes, header of "
          "{}); the file is truncated or the header is wrong",
          where, b, e, data_size, file_size, h));
    }
    info.begin = data_begin + b;
    info.nbytes = nbytes;
    tensors.push_back(std::move(info));
  }

  // No two tensors may share a byte. Empty tensors own no bytes and cannot overlap.
  std::vector<const StTensorInfo*> by_offset;
  for (const auto& t : tensors) {
    if (t.nbytes > 0) by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const StTensorInfo* a, const StTensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->nbytes < b->nbytes;
  });
  for (std::size_t i = 1; i < by_offset.size(); ++i) {
    const StTensorInfo& a = *by_offset[i - 1];
    const StTensorInfo& c = *by_offset[i];
    if (a.begin + a.nbytes > c.begin) {
      return Status::Invalid(fmt::format(
          "{}: tensors '{}' (data_offsets [{}, {}]) and '{}' (data_offsets [{}, {}]) overlap", label, a.name,
          a.begin - data_begin, a.begin - data_begin + a.nbytes, c.name, c.begin - data_begin,
          c.begin - data_begin + c.nbytes));
    }
  }

  if (out) *out = std::move(tensors);
  if (metadata) *metadata = std::move(meta);
  return Status::Ok();
}

/// The size of the file at `path`, refusing what is not a regular file.
Status regular_file_size(const std::string& path, std::uint64_t* size) {
  std::error_code ec;
  const auto st = fs::status(path, ec);
  if (ec || !fs::exists(st)) return Status::Invalid(fmt::format("{}: no such file", path));
  if (!fs::is_regular_file(st)) return Status::Invalid(fmt::format("{}: not a regular file", path));
  *size = fs::file_size(path, ec);
  if (ec) return Status::Invalid(fmt::format("{}: cannot read its size ({})", path, ec.message()));
  return Status::Ok();
}

/// Reads exactly `n` bytes at `offset` of an open stream.
Status read_exact(std::ifstream& f, const std::string& path, std::uint64_t offset, void* dst, std::uint64_t n,
                  const char* what) {
  f.clear();
  f.seekg(static_cast<std::streamoff>(offset));
  char* p = static_cast<char*>(dst);
  std::uint64_t done = 0;
  while (done < n && f) {
    const std::uint64_t step = std::min<std::uint64_t>(n - done, kChunkBytes);
    f.read(p + done, static_cast<std::streamsize>(step));
    done += static_cast<std::uint64_t>(f.gcount());
  }
  if (done != n) {
    return Status::Invalid(fmt::format("{}: could not read {} ({} bytes at offset {}; got {}): the file is shorter "
                                       "than its header says or unreadable",
                                       path, what, n, offset, done));
  }
  return Status::Ok();
}

Status parse_file_header(const std::string& path, std::vector<StTensorInfo>* tensors, std::uint64_t* file_size) {
  FLASHCPP_RETURN_IF_ERROR(regular_file_size(path, file_size));
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status::Invalid(fmt::format("{}: cannot open for reading", path));
  std::vector<std::uint8_t> buf(8);
  if (*file_size < 8) return parse_header(path, buf.data(), 0, *file_size, tensors, nullptr);
  FLASHCPP_RETURN_IF_ERROR(read_exact(f, path, 0, buf.data(), 8, "the 8-byte header size"));
  std::uint64_t h = 0;
  for (int i = 7; i >= 0; --i) h = (h << 8) | buf[i];
  if (h > kMaxHeaderBytes || h > *file_size - 8) {
    return parse_header(path, buf.data(), 8, *file_size, tensors, nullptr);  // refuses with the sentence
  }
  buf.resize(8 + h);
  FLASHCPP_RETURN_IF_ERROR(read_exact(f, path, 8, buf.data() + 8, h, "the JSON header"));
  return parse_header(path, buf.data(), buf.size(), *file_size, tensors, nullptr);
}

Status read_text_file(const std::string& path, std::uint64_t cap, std::string* text) {
  std::uint64_t size = 0;
  FLASHCPP_RETURN_IF_ERROR(regular_file_size(path, &size));
  if (size > cap) {
    return Status::Invalid(fmt::format("{}: {} bytes is larger than the {} MB accepted", path, size, cap >> 20));
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status::Invalid(fmt::format("{}: cannot open for reading", path));
  text->assign(size, '\0');
  return read_exact(f, path, 0, text->data(), size, "the file");
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

const char* st_dtype_name(StDType t) noexcept {
  for (const auto& d : kDTypes) {
    if (d.t == t) return d.name;
  }
  return "unknown";
}

std::size_t st_dtype_size(StDType t) noexcept {
  for (const auto& d : kDTypes) {
    if (d.t == t) return d.size;
  }
  return 0;
}

std::int64_t StTensorInfo::numel() const noexcept {
  std::int64_t n = 0;
  return checked_numel(shape, &n) ? n : -1;
}

Status parse_safetensors_header(const std::uint8_t* data, std::size_t size, std::uint64_t file_size,
                                std::vector<StTensorInfo>* out, std::map<std::string, std::string>* metadata) {
  return parse_header("safetensors header", data, size, file_size, out, metadata);
}

Status parse_safetensors_index(std::string_view json_text, std::map<std::string, std::string>* weight_map) {
  json root;
  try {
    root = json::parse(json_text.begin(), json_text.end());
  } catch (const json::exception& e) {
    return Status::Invalid(fmt::format("safetensors index: not valid JSON ({})", e.what()));
  }
  if (!root.is_object()) {
    return Status::Invalid(fmt::format("safetensors index: must be a JSON object, not a JSON {}", root.type_name()));
  }
  const auto wm = root.find("weight_map");
  if (wm == root.end()) return Status::Invalid("safetensors index: has no \"weight_map\"");
  if (!wm->is_object()) {
    return Status::Invalid(fmt::format("safetensors index: \"weight_map\" must be an object of tensor -> file, not a "
                                       "JSON {}",
                                       wm->type_name()));
  }
  std::map<std::string, std::string> m;
  for (const auto& [tensor, file] : wm->items()) {
    if (!file.is_string()) {
      return Status::Invalid(fmt::format("safetensors index: tensor '{}' maps to a JSON {} ({}), not a file name",
                                         tensor, file.type_name(), brief(file)));
    }
    const std::string& f = file.get_ref<const std::string&>();
    if (f.empty() || f.find('/') != std::string::npos || f.find('\\') != std::string::npos ||
        f.find("..") != std::string::npos || f.find('\0') != std::string::npos) {
      return Status::Invalid(fmt::format(
          "safetensors index: tensor '{}' names file {}; shard names must be plain file names in the index's "
          "directory (no '/', '\\' or '..')",
          tensor, brief(file)));
    }
    m[tensor] = f;
  }
  if (weight_map) *weight_map = std::move(m);
  return Status::Ok();
}

Status SafetensorsArchive::open(const std::string& path, std::unique_ptr<SafetensorsArchive>* out) {
  if (out == nullptr) return Status::Invalid("SafetensorsArchive::open: out is null");
  std::error_code ec;
  std::string file = path;
  if (fs::is_directory(path, ec)) {
    const fs::path dir(path);
    if (fs::exists(dir / "model.safetensors.index.json", ec)) {
      file = (dir / "model.safetensors.index.json").string();
    } else if (fs::exists(dir / "model.safetensors", ec)) {
      file = (dir / "model.safetensors").string();
    } else {
      return Status::Invalid(
          fmt::format("{}: the directory holds neither model.safetensors.index.json nor model.safetensors", path));
    }
  }

  auto a = std::unique_ptr<SafetensorsArchive>(new SafetensorsArchive());
  if (ends_with(file, ".json")) {
    std::string text;
    FLASHCPP_RETURN_IF_ERROR(read_text_file(file, kMaxIndexBytes, &text));
    std::map<std::string, std::string> weight_map;
    Status st = parse_safetensors_index(text, &weight_map);
    if (!st.ok()) return Status(st.code(), fmt::format("{}: {}", file, st.message()));
    if (weight_map.empty()) return Status::Invalid(fmt::format("{}: \"weight_map\" names no tensors", file));
    std::map<std::string, int> shard_index;
    for (const auto& [tensor, shard] : weight_map) shard_index.emplace(shard, 0);
    const fs::path dir = fs::path(file).parent_path();
    for (auto& [shard, idx] : shard_index) {
      idx = static_cast<int>(a->files_.size());
      a->files_.push_back((dir / shard).string());
    }
    std::vector<std::map<std::string, StTensorInfo>> per_file(a->files_.size());
    a->file_sizes_.resize(a->files_.size());
    for (std::size_t i = 0; i < a->files_.size(); ++i) {
      std::vector<StTensorInfo> list;
      FLASHCPP_RETURN_IF_ERROR(parse_file_header(a->files_[i], &list, &a->file_sizes_[i]));
      for (auto& t : list) {
        t.file_index = static_cast<int>(i);
        std::string name = t.name;
        per_file[i].emplace(std::move(name), std::move(t));
      }
    }
    // Tensors come from the shard the index names; tensors a shard holds but the index does not
    // name are left out, as Hugging Face's loader does.
    for (const auto& [tensor, shard] : weight_map) {
      const int idx = shard_index.at(shard);
      const auto it = per_file[idx].find(tensor);
      if (it == per_file[idx].end()) {
        return Status::Invalid(fmt::format("{}: tensor '{}' is mapped to {}, which does not hold it", file, tensor,
                                           a->files_[idx]));
      }
      a->tensors_.emplace(tensor, std::move(it->second));
    }
  } else {
    a->files_.push_back(file);
    a->file_sizes_.push_back(0);
    std::vector<StTensorInfo> list;
    FLASHCPP_RETURN_IF_ERROR(parse_file_header(file, &list, &a->file_sizes_[0]));
    for (auto& t : list) {
      std::string name = t.name;
      a->tensors_.emplace(std::move(name), std::move(t));
    }
  }
  *out = std::move(a);
  return Status::Ok();
}

const StTensorInfo* SafetensorsArchive::find(std::string_view name) const noexcept {
  const auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

std::vector<std::string> SafetensorsArchive::names() const {
  std::vector<std::string> v;
  v.reserve(tensors_.size());
  for (const auto& [name, info] : tensors_) v.push_back(name);
  return v;  // std::map keeps them sorted
}

Status SafetensorsArchive::read_raw(const StTensorInfo& info, void* dst, std::size_t dst_bytes) const {
  if (info.file_index < 0 || static_cast<std::size_t>(info.file_index) >= files_.size()) {
    return Status::Invalid(fmt::format("tensor '{}': file index {} is not one of this archive's {} files", info.name,
                                       info.file_index, files_.size()));
  }
  const std::string& path = files_[info.file_index];
  const std::uint64_t fsize = file_sizes_[info.file_index];
  if (info.begin > fsize || info.nbytes > fsize - info.begin) {
    return Status::Invalid(fmt::format("{}: tensor '{}' ({} bytes at offset {}) lies outside the file ({} bytes)",
                                       path, info.name, info.nbytes, info.begin, fsize));
  }
  if (dst_bytes < info.nbytes) {
    return Status::Invalid(fmt::format("{}: tensor '{}' holds {} bytes but the destination has room for {}", path,
                                       info.name, info.nbytes, dst_bytes));
  }
  if (info.nbytes == 0) return Status::Ok();
  if (dst == nullptr) return Status::Invalid(fmt::format("{}: tensor '{}': destination is null", path, info.name));
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status::Invalid(fmt::format("{}: cannot open for reading tensor '{}'", path, info.name));
  return read_exact(f, path, info.begin, dst, info.nbytes, fmt::format("tensor '{}'", info.name).c_str());
}

namespace {

/// Streams a tensor through a bounded buffer, converting each chunk of elements with `convert`
/// (which gets the source bytes, the first element index and the number of elements).
template <class Convert>
Status read_converted(const std::string& path, std::uint64_t file_size, const StTensorInfo& info,
                      Convert convert) {
  if (info.begin > file_size || info.nbytes > file_size - info.begin) {
    return Status::Invalid(fmt::format("{}: tensor '{}' ({} bytes at offset {}) lies outside the file ({} bytes)",
                                       path, info.name, info.nbytes, info.begin, file_size));
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status::Invalid(fmt::format("{}: cannot open for reading tensor '{}'", path, info.name));
  const std::size_t esize = st_dtype_size(info.dtype);
  const std::size_t per_chunk = kChunkBytes / esize;
  const std::int64_t numel = info.numel();
  std::vector<std::uint8_t> buf(std::min<std::uint64_t>(info.nbytes, per_chunk * esize));
  const std::string what = fmt::format("tensor '{}'", info.name);
  for (std::int64_t first = 0; first < numel; first += static_cast<std::int64_t>(per_chunk)) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::int64_t>(numel - first, per_chunk));
    FLASHCPP_RETURN_IF_ERROR(
        read_exact(f, path, info.begin + static_cast<std::uint64_t>(first) * esize, buf.data(), n * esize, what.c_str()));
    convert(buf.data(), static_cast<std::size_t>(first), n);
  }
  return Status::Ok();
}

Status check_convert_args(const std::vector<std::string>& files, const StTensorInfo& info, const void* dst,
                          std::size_t count, const char* to) {
  if (info.file_index < 0 || static_cast<std::size_t>(info.file_index) >= files.size()) {
    return Status::Invalid(fmt::format("tensor '{}': file index {} is not one of this archive's {} files", info.name,
                                       info.file_index, files.size()));
  }
  const std::string& file = files[info.file_index];
  if (info.dtype != StDType::kF32 && info.dtype != StDType::kF16 && info.dtype != StDType::kBF16) {
    return Status::Unsupported(fmt::format("{}: tensor '{}' is {}; only F32, F16 and BF16 tensors can be read as {}",
                                           file, info.name, st_dtype_name(info.dtype), to));
  }
  const std::int64_t numel = info.numel();
  if (numel < 0 || static_cast<std::uint64_t>(numel) * st_dtype_size(info.dtype) != info.nbytes) {
    return Status::Invalid(fmt::format("{}: tensor '{}': shape {} does not match its {} bytes", file, info.name,
                                       shape_str(info.shape), info.nbytes));
  }
  if (static_cast<std::uint64_t>(numel) != count) {
    return Status::Invalid(fmt::format("{}: tensor '{}' has {} elements (shape {}) but {} were asked for", file,
                                       info.name, numel, shape_str(info.shape), count));
  }
  if (dst == nullptr && count > 0) {
    return Status::Invalid(fmt::format("{}: tensor '{}': destination is null", file, info.name));
  }
  return Status::Ok();
}

}  // namespace

Status SafetensorsArchive::read_bf16(const StTensorInfo& info, std::uint16_t* dst, std::size_t count) const {
  FLASHCPP_RETURN_IF_ERROR(check_convert_args(files_, info, dst, count, "bf16"));
  if (info.dtype == StDType::kBF16) return read_raw(info, dst, count * sizeof(std::uint16_t));
  const bool f16 = info.dtype == StDType::kF16;
  return read_converted(files_[info.file_index], file_sizes_[info.file_index], info,
                        [&](const std::uint8_t* src, std::size_t first, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      float x;
      if (f16) {
        std::uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        x = half_bits_to_float(h);  // exact: every fp16 value is a float
      } else {
        std::memcpy(&x, src + 4 * i, 4);
      }
      dst[first + i] = float_to_bf16_bits(x);  // round to nearest even, NaN stays NaN
    }
  });
}

Status SafetensorsArchive::read_f32(const StTensorInfo& info, float* dst, std::size_t count) const {
  FLASHCPP_RETURN_IF_ERROR(check_convert_args(files_, info, dst, count, "fp32"));
  if (info.dtype == StDType::kF32) return read_raw(info, dst, count * sizeof(float));
  const bool f16 = info.dtype == StDType::kF16;
  return read_converted(files_[info.file_index], file_sizes_[info.file_index], info,
                        [&](const std::uint8_t* src, std::size_t first, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      std::uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      dst[first + i] = f16 ? half_bits_to_float(h) : bf16_bits_to_float(h);
    }
  });
}

Status write_safetensors(const std::string& path, const std::vector<StWriteTensor>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  std::vector<std::uint64_t> sizes;
  sizes.reserve(tensors.size());
  for (const auto& t : tensors) {
    const std::string where = fmt::format("{}: tensor '{}'", path, t.name);
    if (t.name == "__metadata__") return Status::Invalid(fmt::format("{}: the name is reserved", where));
    if (header.contains(t.name)) return Status::Invalid(fmt::format("{} is given twice", where));
    const std::size_t esize = st_dtype_size(t.dtype);
    if (esize == 0) return Status::Invalid(fmt::format("{} has an unknown dtype", where));
    std::int64_t numel = 0;
    std::uint64_t nbytes = 0, end = 0;
    if (!checked_numel(t.shape, &numel) ||
        __builtin_mul_overflow(static_cast<std::uint64_t>(numel), static_cast<std::uint64_t>(esize), &nbytes) ||
        __builtin_add_overflow(offset, nbytes, &end)) {
      return Status::Invalid(
          fmt::format("{}: shape {} has a negative dimension or too many bytes", where, shape_str(t.shape)));
    }
    if (nbytes > 0 && t.data == nullptr) return Status::Invalid(fmt::format("{}: data is null", where));
    header[t.name] = {{"dtype", st_dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, end}}};
    sizes.push_back(nbytes);
    offset = end;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    return Status::Invalid(fmt::format("{}: cannot write the header ({})", path, e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::uint8_t size_bytes[8];
  for (int i = 0; i < 8; ++i) size_bytes[i] = static_cast<std::uint8_t>(static_cast<std::uint64_t>(text.size()) >> (8 * i));

  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return Status::Invalid(fmt::format("{}: cannot open for writing", path));
  f.write(reinterpret_cast<const char*>(size_bytes), 8);
  f.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const char* p = static_cast<const char*>(tensors[i].data);
    for (std::uint64_t done = 0; done < sizes[i] && f;) {
      const std::uint64_t step = std::min<std::uint64_t>(sizes[i] - done, kChunkBytes);
      f.write(p + done, static_cast<std::streamsize>(step));
      done += step;
    }
  }
  f.flush();
  if (!f) return Status::Invalid(fmt::format("{}: writing failed (disk full or not writable?)", path));
  return Status::Ok();
}

}  // namespace flashcpp::engine
