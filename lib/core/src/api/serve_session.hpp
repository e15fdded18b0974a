// serve_once's stages over a model already loaded and a source of packets that may outlive one
// question: what serve_requests (kvserve-once --requests) runs for each request.
#pragma once

#include "context.hpp"
#include "kv/api/serve.hpp"
#include "kv/format/packet_source.hpp"
#include "kv/model/kv_cache.hpp"
#include "runtime.hpp"

#include <functional>
#include <optional>
#include <string_view>

namespace kv {

/// What one question leaves to the next in a process that answers many.
struct KeptBetweenQuestions {
    /// The last question's cache in memory, emptied and reused by the next one, so that its
    /// keys and values land in memory already faulted in.
    std::optional<KvCache> cache;
    /// BOS's rows, computed by the first question that starts with BOS.
    BosRows bos;
};

/// serve_once() without loading anything: the options are checked, then the context is
/// assembled from `packets` (into a fresh sparse attention and cache), the prompt prefilled and
/// the answer decoded. `threads` is what set_compute_threads() set, for the stats. With
/// `kept`, the cache is the one it holds (emptied; a fresh one where it is empty, offloaded or
/// much larger than needed) and goes back into it when the answer is done, and BOS comes from
/// its rows.
ServeStats serve_loaded(const ServeOptions& options, const Runtime& runtime, PacketSource& packets,
                        const std::function<void(std::string_view)>& emit, int threads,
                        KeptBetweenQuestions* kept = nullptr);

}  // namespace kv
