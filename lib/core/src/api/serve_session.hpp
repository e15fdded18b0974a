// serve_once's stages over a model already loaded and a source of packets that may outlive one
// question: what serve_requests (kvserve-once --requests) runs for each request.
#pragma once

#include "kv/api/serve.hpp"
#include "kv/format/packet_source.hpp"
#include "kv/model/kv_cache.hpp"
#include "runtime.hpp"

#include <functional>
#include <optional>
#include <string_view>

namespace kv {

/// serve_once() without loading anything: the options are checked, then the context is
/// assembled from `packets` (into a fresh sparse attention and cache), the prompt prefilled and
/// the answer decoded. `threads` is what set_compute_threads() set, for the stats. With
/// `kept_cache`, the cache is the one it holds (emptied; a fresh one where it is empty, offloaded
/// or much larger than needed) and goes back into it when the answer is done, so that the next
/// question's keys and values land in memory already faulted in.
ServeStats serve_loaded(const ServeOptions& options, const Runtime& runtime, PacketSource& packets,
                        const std::function<void(std::string_view)>& emit, int threads,
                        std::optional<KvCache>* kept_cache = nullptr);

}  // namespace kv
