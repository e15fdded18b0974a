// The in-memory KV cache of one sequence: per layer, keys (after RoPE) and values laid out
// [kv_heads, tokens, head_dim], and the position of every stored token.
//
// Positions are stored rather than implied, because a packed context realigns packets and a
// compressed one has gaps: the next token's position (the logical length) may exceed the number
// of stored tokens.
#pragma once

#include <torch/types.h>
#include <torch/utils.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

namespace kv {

class FileArena;

class KvCache {
  public:
    KvCache(int64_t num_layers, int64_t kv_heads, int64_t head_dim, torch::ScalarType dtype,
            torch::Device device, int64_t capacity = 256);

    /// A host cache of fixed `capacity` whose keys and values live in an unnamed temporary file
    /// in `folder` (empty: $TMPDIR, else /tmp), mapped into memory (positions stay in memory): the
    /// offloading tier on disk. Reading a row brings its page in from the file (or the OS page
    /// cache); release_pages() drops the pages read so far from the process again, so that what
    /// stays resident is what one step reads, not what the cache holds. Throws IoError when the
    /// file cannot be made.
    static KvCache on_disk(int64_t num_layers, int64_t kv_heads, int64_t head_dim,
                           torch::ScalarType dtype, int64_t capacity,
                           const std::filesystem::path& folder);
    /// Whether the keys and values live in a file (on_disk).
    bool offloaded() const { return arena_ != nullptr; }
    /// Drops layer `layer`'s mapped pages from the process (all layers when -1); a no-op for a
    /// cache in memory. The data stays in the file.
    void release_pages(int64_t layer = -1);
    /// Bytes of the file holding an offloaded cache (0 in memory).
    int64_t offloaded_bytes() const;
    /// Copies the keys and values of `rows` of kv head `head` of layer `layer` to `keys_out` and
    /// `values_out` (rows.size() * head_dim elements of the cache's dtype each). An offloaded
    /// cache reads its file with pread, one read per run of consecutive rows, so that no page
    /// of it enters the process; a cache in memory copies from its tensors. A null output is
    /// skipped.
    void gather(int64_t layer, int64_t head, std::span<const int64_t> rows, void* keys_out,
                void* values_out) const;
    /// gather() of the consecutive rows [first, first + count): one read each for keys and
    /// values (a chunk of a layer streamed from disk).
    void gather_range(int64_t layer, int64_t head, int64_t first, int64_t count, void* keys_out,
                      void* values_out) const;
    /// The keys of rows [first, first + count) of kv head `head` of layer `layer` as float32 on
    /// the CPU, [count, head_dim], whichever tier holds them: copied from memory, or read with
    /// pread from an offloaded cache's file (no page of it mapped). What sparse methods read
    /// keys through, so that none of them needs to know where the cache lives.
    torch::Tensor read_keys(int64_t layer, int64_t head, int64_t first, int64_t count) const;
    /// The keys of `rows` of one kv head likewise: [rows.size(), head_dim].
    torch::Tensor gather_keys(int64_t layer, int64_t head, std::span<const int64_t> rows) const;
    /// A file for data that grows with the cache's rows and belongs in the same tier (IceCache's
    /// restored indexes keep their keys there): for an offloaded cache an unnamed file beside its
    /// own; nullptr for a cache in memory, whose derived data stays in memory too.
    std::unique_ptr<FileArena> new_spill_file() const;

    int64_t num_layers() const { return static_cast<int64_t>(keys_.size()); }
    int64_t kv_heads() const { return kv_heads_; }
    int64_t head_dim() const { return head_dim_; }
    torch::ScalarType dtype() const { return dtype_; }
    torch::Device device() const { return device_; }

    /// Tokens stored (committed).
    int64_t length() const { return length_; }
    /// The position the next token takes: one past the largest stored position.
    int64_t next_position() const { return next_position_; }

    /// Starts appending tokens at `positions` [T] (int64): every layer must then `write` T
    /// tokens before `commit`. Until then keys()/values() include the pending tokens.
    void begin_append(const torch::Tensor& positions);
    /// Stores layer `layer`'s keys and values [kv_heads, T, head_dim] for the pending tokens.
    void write(int64_t layer, const torch::Tensor& keys, const torch::Tensor& values);
    /// Stores pending tokens [first, first + T) of layer `layer` (keys, values [kv_heads, T,
    /// head_dim]): a layer computed in parts, as a document prefilled layer by layer is.
    void write_part(int64_t layer, int64_t first, const torch::Tensor& keys,
                    const torch::Tensor& values);
    /// Stores the keys (or values) [T, head_dim] of pending tokens [first, first + T) of one kv
    /// head of layer `layer`: a cache filled a (layer, head) plane at a time, as an offloaded
    /// one is.
    void write_plane(int64_t layer, int64_t head, bool keys, int64_t first,
                     const torch::Tensor& rows);
    void commit();
    /// Drops pending tokens (after an error mid-forward).
    void rollback();

    /// [kv_heads, length (+ pending), head_dim] views of the stored keys and values.
    torch::Tensor keys(int64_t layer) const;
    torch::Tensor values(int64_t layer) const;
    /// [length (+ pending)] int64 positions on the cache's device.
    torch::Tensor positions() const;

    /// Appends whole tokens with their keys and values for every layer (e.g. from a cache file);
    /// keys_per_layer[l] is [kv_heads, T, head_dim]. `used_per_layer` (optional, [kv_heads]
    /// int64 per layer) says how many of the T slots each head uses; the rest are padding that
    /// attention skips (a packet whose heads keep different numbers of tokens).
    void append(const std::vector<torch::Tensor>& keys_per_layer,
                const std::vector<torch::Tensor>& values_per_layer, const torch::Tensor& positions,
                const std::vector<torch::Tensor>& used_per_layer = {});

    /// [kv_heads, length (+ pending)] bool, false at padding slots; undefined while the cache
    /// has none (the common case, which costs nothing).
    torch::Tensor key_valid(int64_t layer) const;
    bool has_padding() const { return !valid_.empty(); }

    void reserve(int64_t capacity);
    /// Empties the cache for another sequence and keeps its memory (capacity, pages already
    /// faulted in): a --requests job's next question starts from the last one's cache.
    void clear();
    /// Faults in every page of an empty cache in host memory, on every compute thread (a no-op
    /// for one that holds tokens or is offloaded). The kernel zeroes fresh memory at its first
    /// touch: a cache about to be filled by a read would otherwise have the first huge page of
    /// every plane faulted in by one thread (BOS's row goes in first) and the rest inside the
    /// read's copies out of the page cache, both slower than this.
    void fault_in();
    /// Tokens the cache holds room for without growing.
    int64_t capacity() const { return capacity_; }

    /// Where the rows of `count` tokens after the last stored one are, in a host cache in
    /// memory (room for them reserved first): per layer, the address of kv head 0's first such
    /// row; heads `head_stride` bytes apart, each head's rows contiguous. For a reader that puts
    /// a packet's keys and values straight into the cache (no copy of the packet in between);
    /// append_written() then makes them part of it. Invalidated by anything that reserves more.
    struct RowsAfterEnd {
        std::vector<std::byte*> keys, values;  ///< per layer
        std::size_t head_stride = 0;
    };
    RowsAfterEnd rows_after_end(int64_t count);
    /// Makes the `positions.numel()` tokens whose rows were written through rows_after_end()
    /// part of the cache, at `positions`.
    void append_written(const torch::Tensor& positions);

    /// Moves the logical length forward (never back): a compressed packet spans more positions
    /// than it stores.
    void advance_to(int64_t next_position);

  private:
    int64_t visible() const { return length_ + pending_; }
    /// Rows [first, first + count) of one plane, already checked, to each non-null output.
    void copy_rows(int64_t layer, int64_t head, int64_t first, int64_t count, void* keys_out,
                   void* values_out) const;

    int64_t kv_heads_, head_dim_;
    torch::ScalarType dtype_;
    torch::Device device_;
    std::vector<torch::Tensor> keys_, values_;  // [kv_heads, capacity, head_dim]
    torch::Tensor positions_;                   // [capacity] int64
    std::vector<torch::Tensor> valid_;          // [kv_heads, capacity] bool, once padded
    int64_t capacity_ = 0;
    int64_t length_ = 0;
    int64_t pending_ = 0;
    int64_t next_position_ = 0;
    std::shared_ptr<FileArena> arena_;                 // the file of an offloaded cache
    std::filesystem::path folder_;                     // and the folder it is in
    std::vector<std::span<std::byte>> layer_regions_;  // its keys and values, per layer
    std::vector<std::size_t> layer_offsets_;           // where each region starts in the file
};

}  // namespace kv
