// IceCache's multi-level DCI index over the keys of one (layer, kv-head): keys clustered by
// meaning into 16-slot pages, so that decoding loads only the pages a query needs.
//
// Keys are lifted so that inner product becomes Euclidean distance, T(k) = [k, sqrt(M - |k|^2)]
// with M the largest squared norm; one random direction u in R^{d+1} projects them. About p0 of
// the tokens (every 1/p0-th, deterministically, counted level by level as M-DCI counts them:
// 9,875 / 99 / 20 / 5 / 1 points at 10,000 tokens) are promoted to level 1, p1 of each level to
// the next; every point hangs under its nearest point one level up: exactly, or, for the level-0
// tokens of an index of more than 3,000, through the authors' anchor shortcut (every n-th token
// exact, the others trying their neighbouring anchors' parents first). The children of one
// parent, in projection order, are cut into pages. A query walks down from the top level,
// keeping at each level the best points whose subtrees cover the pages it wants (never fewer
// than the field of view), scores most children of each (those nearest in projection), and
// ranks pages by the best token it saw in each. New tokens join incrementally: pages split in
// halves when full and, as in M-DCI's B+-tree, a page left below half full by a re-parenting
// borrows from a neighbour or merges with it; changed pages are reported dirty. The design
// follows the authors' M-DCI (github.com/yuzhenmao/M-DCI, construct_new_tree and btree_p.c).
#pragma once

#include "kv/packet.hpp"

#include <cstdint>
#include <deque>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace kv {

struct DciOptions {
    double promotion_first = 0.01;      ///< p0: share of level-0 tokens promoted to level 1
    double promotion_rest = 0.2;        ///< p1: share of each higher level promoted further
    int64_t page_size = 16;             ///< slots per page
    int64_t exact_parent_limit = 3000;  ///< exact parent search while the level above is this small
    int64_t anchor_interval = 120;      ///< every n-th token gets an exact parent (anchor)
    int64_t anchor_neighbours = 30;     ///< anchors looked at on each side
    double anchor_threshold = 0.9;  ///< accept an anchor's parent if within this share of its reach
    int64_t construction_field_of_view = 30;  ///< beam of the approximate parent search
    double norm_headroom = 1.25;              ///< M = headroom * largest squared norm seen at build
};

/// Throws UsageError naming the first option out of range (page size in [2, 4096], promotion
/// ratios in (0, 1), norm headroom >= 1, anchor interval >= 1, exact parent limit >= 0). The
/// index's constructor calls it; so do the tools before any work starts.
void validate_dci_options(const DciOptions& options);

struct DciQueryOptions {
    int64_t pages = 12;           ///< pages wanted (k)
    int64_t field_of_view = 0;    ///< points kept per level; 0: max(tokens / 1000, 30)
    double retrieve_share = 0.8;  ///< share of an expanded point's children scored exactly
};

struct DciQueryResult {
    std::vector<int32_t> pages;      ///< best first, at most `pages`
    std::vector<float> page_scores;  ///< the best q.k seen in each
    int64_t dot_products = 0;        ///< exact q.k computed
};

/// Writes the keys of `tokens` (a few thousand at most) in the index's frame, row-major float32,
/// to `out`.
using KeyReader = std::function<void(std::span<const int32_t> tokens, float* out)>;
/// The same keys as bf16 rows (what float_to_bf16 makes of the KeyReader's floats), for an index
/// keeping bf16 keys: a cache of bf16 keys copies its rows, no float32 between.
using Bf16KeyReader = std::function<void(std::span<const int32_t> tokens, uint16_t* out)>;

/// Where an index restored in place keeps its keys and everything else it knows per token:
/// dci_storage_floats(count, head_dim, bf16_keys) floats at `floats` (e.g. a FileArena region),
/// the keys first, a row per slot in the index's own order of slots (each point's children side
/// by side, page after page), as float32 or, with bf16_keys, as bf16 (half the bytes, exact for
/// keys that were bf16), then each slot's projection, then each slot's token id (its bits).
/// Restoring writes them once, front to back. `read` copies floats [offset, offset + count) back
/// for a query; empty, queries read `floats` in place. A file read through `read` (pread) brings
/// nothing into the process but the copy. An empty storage (neither) is memory the index
/// allocates and owns: the fastest to query, every expanded point's children one run of keys.
struct KeyStorage {
    float* floats = nullptr;
    std::function<void(int64_t offset, int64_t count, float* out)> read;
    bool bf16_keys = false;  ///< keys stored as bf16 (head_dim even); exact for bf16 keys only
};

/// The run [first, last) of the `wanted` values of sorted `projections` nearest `target`: what
/// a merge outward from target's place picks, the nearer value first and, at equal distances,
/// the one on the right (M-DCI's walk over a cell's children). All of them when fewer.
std::pair<std::size_t, std::size_t> nearest_in_projection(std::span<const float> projections,
                                                          float target, std::size_t wanted);

/// The floats a KeyStorage of `count` tokens needs.
int64_t dci_storage_floats(int64_t count, int64_t head_dim, bool bf16_keys);

/// A projection direction: head_dim + 1 standard normal draws from `seed`, normalised. One
/// serves every index of a file.
std::vector<float> dci_projection(int64_t head_dim, uint64_t seed);

class DciIndex {
  public:
    /// `projection` is the direction u (d + 1 values, normalised here); the same u serves every
    /// head of a file, as in IceCache.
    DciIndex(int64_t head_dim, std::vector<float> projection, DciOptions options = {});

    /// Indexes `count` keys (row-major [count, head_dim]) as tokens 0..count-1, replacing any
    /// previous content. `threads` > 1 splits the parent search.
    void build(const float* keys, int64_t count, int threads = 1);
    /// Appends `count` keys as the next tokens, one by one as decoding produces them.
    void insert(const float* keys, int64_t count);
    DciQueryResult query(const float* query, const DciQueryOptions& options) const;
    /// query() for each of several queries at once (the query heads that share a kv head):
    /// each gets exactly what query() would give it, but the children of a point that several
    /// of them expand are read once for all of them.
    std::vector<DciQueryResult> query_group(std::span<const float* const> queries,
                                            const DciQueryOptions& options) const;

    /// The tree and pages as stored (live pages in id order; free ones are left out, so page ids
    /// are renumbered by restore).
    DciLayout layout() const;
    /// Rebuilds an index from its keys and a stored layout; throws FormatError, naming `source`,
    /// when the layout does not describe a valid index of these keys.
    void restore(const float* keys, int64_t count, const DciLayout& layout,
                 const std::string& source);
    /// restore() that keeps the keys, and every per-token number a query needs, in `storage`
    /// instead of memory: `read` gives the keys a few thousand at a time (in token order, then
    /// in slot order), and a query reads each expanded point's children in one run of rows.
    /// Memory keeps the pages (a slot range each, ids unchanged), the points that own pages
    /// (about 1.25% of the tokens) and nothing per token. Such an index answers query(),
    /// tokens_of_page(), child_pages(), size(), levels() and the page counts; the per-token
    /// accessors (level, parent, token_page, projection_of, key, page_tokens) are not for it,
    /// and it takes no new tokens (insert() throws).
    /// With storage.bf16_keys, `read_bf16` (where given) writes the stored keys.
    void restore_in_place(const KeyReader& read, int64_t count, const DciLayout& layout,
                          const std::string& source, KeyStorage storage,
                          const Bf16KeyReader& read_bf16 = {});
    /// Whether the index keeps its keys in the slot storage of restore_in_place.
    bool in_place() const { return in_place_; }

    int64_t head_dim() const { return head_dim_; }
    int64_t size() const { return in_place() ? token_count_ : static_cast<int64_t>(level_.size()); }
    int levels() const { return static_cast<int>(level_points_.size()); }
    /// Page ids are stable until the page is freed (ids of freed pages are reused).
    int64_t page_capacity() const {
        return static_cast<int64_t>(in_place() ? page_first_slot_.size() : pages_.size());
    }
    int64_t live_pages() const;
    std::span<const int32_t> page_tokens(int32_t page) const { return pages_[page].tokens; }
    /// A page's tokens, in any index (read from the storage of one restored in place).
    std::vector<int32_t> tokens_of_page(int32_t page) const;
    /// The owning point, -1 for the root, -2 for a free page.
    int32_t page_parent(int32_t page) const { return pages_[page].parent; }
    /// A point's pages (the root's for -1), in projection order.
    std::span<const int32_t> child_pages(int32_t parent) const { return pages_of(parent); }
    int32_t token_page(int64_t token) const { return token_page_[token]; }
    int level(int64_t token) const { return level_[token]; }
    /// -1 for the points of the top level, which hang under the virtual root.
    int32_t parent(int64_t token) const { return parent_[token]; }
    std::span<const int32_t> level_points(int level) const { return level_points_[level]; }
    /// The key of a token, for an index that keeps its keys (not restored in place).
    const float* key(int64_t token) const { return keys_.data() + token * head_dim_; }
    float projection_of(int64_t token) const { return projection_value_[token]; }
    double max_squared_norm() const { return max_squared_norm_; }
    /// Pages written since the last call (split, grown, emptied or re-filled), then forgotten.
    std::vector<int32_t> take_dirty_pages();
    /// ½|T(a) - T(b)|², the distance parents are chosen by.
    double lifted_distance(int64_t a, int64_t b) const;

  private:
    struct Page {
        int32_t parent = -1;          // owning point, -1 the root; -2 when free
        std::vector<int32_t> tokens;  // in projection order
    };
    int32_t root_slot() const { return static_cast<int32_t>(level_.size()); }
    std::vector<int32_t>& pages_of(int32_t parent);
    const std::vector<int32_t>& pages_of(int32_t parent) const;
    int64_t pages_below(int32_t point) const;  ///< level-0 pages in its subtree (-1: the root)
    int32_t owner_index(int32_t point) const;  ///< its row in owned_pages_, -1 if it owns none
    void reset();
    int next_level();
    void add_token(const float* key);
    float project(const float* key, double squared_norm) const;
    /// project() from the key's dot product with the direction, `along`.
    float projection(double along, double squared_norm) const;
    double lifted_distance_to(const float* key, double squared_norm, int64_t other) const;
    /// lifted_distance_to's arithmetic from the keys' dot product and squared norms.
    double lifted_from_dot(double dot, double squared_norm, double other_squared_norm) const;
    /// out[i] = lifted_distance(token, others[i]), the same bits, the dot products of several
    /// others at once.
    void lifted_distances(int64_t token, std::span<const int32_t> others,
                          std::vector<double>& out) const;
    void pack_level(int level);
    int32_t nearest_exact(int64_t token, int level) const;
    int32_t nearest_descending(int64_t token, int level) const;
    void assign_parents(int level, int threads);
    void lay_out_pages(int32_t parent, std::vector<int32_t> children);
    void place(int64_t token, int32_t parent);
    void remove(int64_t token);
    /// Moves `count` tokens between neighbouring pages `from` and `to` of one parent: the end
    /// of `from` to the front of `to` when `from` comes first, else the front to the end.
    void shift_tokens(int32_t from, int32_t to, std::size_t count);
    /// Frees an empty page and drops it from its parent's list.
    void free_page_slot(int32_t page);
    int32_t new_page(int32_t parent);
    void count_pages_below();
    void reproject_and_rebuild();
    void restore_from(const KeyReader& read, int64_t count, const DciLayout& layout,
                      const std::string& source, bool keep_keys);
    /// The key of a token, wherever the index keeps it.
    void copy_key(int32_t token, float* out) const;
    /// Where an in-place index's regions start in its storage, in floats: the slots' keys, their
    /// projections, their tokens.
    int64_t key_floats_of(int64_t slots) const;
    int64_t projections_at() const { return key_floats_of(token_count_); }
    int64_t tokens_at() const { return projections_at() + token_count_; }
    /// Floats [offset, offset + count) of an in-place index's storage: where they lie in memory,
    /// or a copy read into `buffer`.
    const float* storage_floats(int64_t offset, int64_t count, std::vector<float>& buffer) const;

    int64_t head_dim_;
    std::vector<float> direction_;  // u, unit length, d + 1 values
    DciOptions options_;
    double max_squared_norm_ = 0;

    std::vector<float> keys_;  // empty when restored in place
    // An index restored in place keeps no per-token table: its storage has a row per slot,
    // the owners their first slot, the pages (ids kept) their slot range.
    KeyStorage key_storage_;
    std::vector<float> owned_storage_;  // the storage when restore_in_place was given none
    bool in_place_ = false;
    int64_t token_count_ = 0;
    // Per owner: its children's slots [first_slot, first_slot + children), and its pages in
    // slot order at [pages_begin, pages_begin + pages) of owner_page_ids_ (their sizes at the
    // same places of owner_page_sizes_). A query reads an owner's from one place, where a list
    // per owner and a size per page id cost it a cache miss each.
    struct OwnerSlots {
        int32_t first_slot = 0, children = 0, pages_begin = 0, pages = 0;
    };
    std::vector<OwnerSlots> owner_slots_;
    std::vector<int32_t> owner_page_ids_, owner_page_sizes_;
    // Point -> owner row for the points that own pages, once owner_ is given up (in place):
    // one array, open addressing, linear probing, at most half full. A query looks one up per
    // point it expands; std::unordered_map's nodes cost a cache miss or two each (perf at 131k
    // tokens: 7-8% of the queries' samples in the lookup).
    class PointOwners {
      public:
        void clear() { slots_.clear(); }
        void assign(const std::vector<std::pair<int32_t, int32_t>>& entries) {
            int shift = 31;  // 2^(32 - shift) slots, at least twice the entries
            while ((std::size_t{1} << (32 - shift)) < 2 * entries.size())
                --shift;
            shift_ = shift;
            slots_.assign(std::size_t{1} << (32 - shift), {-1, -1});
            for (const auto& entry : entries)
                slots_[probe(entry.first)] = entry;
        }
        int32_t find(int32_t point) const {
            if (slots_.empty()) return -1;
            return slots_[probe(point)].second;
        }

      private:
        // The slot holding `point`, or the empty one where it would go.
        std::size_t probe(int32_t point) const {
            const std::size_t mask = slots_.size() - 1;
            std::size_t slot = (static_cast<uint32_t>(point) * 0x9E3779B1u) >> shift_;
            while (slots_[slot].first != point && slots_[slot].first != -1)
                slot = (slot + 1) & mask;
            return slot;
        }
        std::vector<std::pair<int32_t, int32_t>> slots_;  // {point, owner}, {-1, -1} empty
        int shift_ = 31;
    };
    PointOwners owner_of_point_;
    std::vector<int32_t> page_first_slot_, page_size_;  // per page id
    std::vector<float> squared_norm_;
    std::vector<float> projection_value_;
    std::vector<int8_t> level_;
    std::vector<int32_t> parent_;
    std::vector<float> parent_distance_;
    std::vector<int32_t> token_page_;
    std::vector<std::vector<int32_t>> level_points_;  // tokens of each level, in token order
    // The promotion rule's state (M-DCI's num_points_on_level and next_target_level): points
    // on each level, and the level the next token goes to.
    std::vector<int64_t> level_count_;
    int next_target_ = 0;
    // Pages are owned by the root and by the few points that have children (levels >= 1,
    // about 1.25% of the tokens): a table per owner, so that a level-0 token costs 4 bytes here.
    std::vector<int32_t> owner_;                    // per token: its row below, -1 if it owns none
    std::deque<std::vector<int32_t>> owned_pages_;  // per owner (the root first): its pages
    std::vector<int64_t> owned_pages_below_;        // per owner: level-0 pages in its subtree
    std::vector<Page> pages_;
    std::vector<int32_t> free_pages_;
    std::vector<uint8_t> dirty_;
    // Each level's keys and squared norms row by row, for the brute-force parent search; points
    // only ever join a level, so the packs grow and stay valid.
    std::vector<std::vector<float>> packed_keys_;
    std::vector<std::vector<float>> packed_norms_;
};

}  // namespace kv
