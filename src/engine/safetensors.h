// safetensors reading (and writing, for tests and tiny checkpoints).
//
// A .safetensors file is: an 8-byte little-endian header size H, H bytes of JSON mapping tensor
// names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the byte after
// the header; an optional "__metadata__" entry maps strings to strings), then the data. Everything
// in a file comes from outside the process, so every field is checked before it is used: header
// size against the file, JSON shape, dtype names, shape products against offsets (with overflow
// checks), offsets inside the data region, overlapping tensors. A bad file gives a Status with a
// sentence naming the file and the tensor; never a crash or a read outside the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "flashcpp/status.h"

namespace flashcpp::engine {

/// Element types a checkpoint may hold. The loader converts F32/F16/BF16 to the engine's dtype;
/// the others are listed so a header that names them parses (and a load of one refuses clearly).
enum class StDType : std::uint8_t { kF32, kF16, kBF16, kF64, kI64, kI32, kI16, kI8, kU8, kBool, kF8E4M3, kF8E5M2 };
const char* st_dtype_name(StDType t) noexcept;   ///< the safetensors spelling: "F32", "BF16", ...
std::size_t st_dtype_size(StDType t) noexcept;   ///< bytes per element

struct StTensorInfo {
  std::string name;
  StDType dtype = StDType::kF32;
  std::vector<std::int64_t> shape;  ///< empty = scalar
  std::uint64_t begin = 0;          ///< absolute byte offset of the data in its file
  std::uint64_t nbytes = 0;
  int file_index = 0;               ///< which file of the archive holds it
  std::int64_t numel() const noexcept;
};

/// Parses one file's header. `data` holds the first `size` bytes of a file of `file_size` bytes
/// (size >= 8 + H is required only for the header itself; tensor data is not read). Fills `out`
/// with absolute offsets. Used by the archive and, directly, by the fuzzer.
Status parse_safetensors_header(const std::uint8_t* data, std::size_t size, std::uint64_t file_size,
                                std::vector<StTensorInfo>* out, std::map<std::string, std::string>* metadata = nullptr);

/// A checkpoint: one model.safetensors, or the shards named by model.safetensors.index.json.
class SafetensorsArchive {
 public:
  /// `path` is a .safetensors file, an index .json file, or a directory holding
  /// model.safetensors.index.json (preferred) or model.safetensors.
  static Status open(const std::string& path, std::unique_ptr<SafetensorsArchive>* out);

  const StTensorInfo* find(std::string_view name) const noexcept;  ///< nullptr if absent
  std::vector<std::string> names() const;                          ///< sorted
  const std::vector<std::string>& files() const noexcept { return files_; }

  /// Reads a tensor's raw bytes (dst must hold info.nbytes).
  Status read_raw(const StTensorInfo& info, void* dst, std::size_t dst_bytes) const;
  /// Reads a tensor converted to bf16 / fp32 (from F32, F16 or BF16; round to nearest even).
  /// `count` must equal numel(). Other dtypes are refused with a sentence.
  Status read_bf16(const StTensorInfo& info, std::uint16_t* dst, std::size_t count) const;
  Status read_f32(const StTensorInfo& info, float* dst, std::size_t count) const;

 private:
  std::vector<std::string> files_;
  std::vector<std::uint64_t> file_sizes_;
  std::map<std::string, StTensorInfo, std::less<>> tensors_;
};

/// One tensor for write_safetensors: data holds numel * st_dtype_size(dtype) bytes.
struct StWriteTensor {
  std::string name;
  StDType dtype = StDType::kF32;
  std::vector<std::int64_t> shape;
  const void* data = nullptr;
};
/// Writes a .safetensors file (header padded to 8 bytes, tensors in the given order).
Status write_safetensors(const std::string& path, const std::vector<StWriteTensor>& tensors,
                         const std::map<std::string, std::string>& metadata = {});

/// Parses a model.safetensors.index.json text: {"weight_map": {tensor: file}}; returns the
/// mapping (file names relative to the index's directory; names with '/' or ".." are refused).
Status parse_safetensors_index(std::string_view json_text, std::map<std::string, std::string>* weight_map);

}  // namespace flashcpp::engine
