// serve_once's stages over a model already loaded and a source of packets that may outlive one
// question: what serve_requests (kvserve-once --requests) runs for each request.
#pragma once

#include "kv/api/serve.hpp"
#include "kv/format/packet_source.hpp"
#include "runtime.hpp"

#include <functional>
#include <string_view>

namespace kv {

/// serve_once() without loading anything: the options are checked, then the context is
/// assembled from `packets` (a fresh cache and sparse attention), the prompt prefilled and the
/// answer decoded. `threads` is what set_compute_threads() set, for the stats.
ServeStats serve_loaded(const ServeOptions& options, const Runtime& runtime,
                        PacketSource& packets,
                        const std::function<void(std::string_view)>& emit, int threads);

}  // namespace kv
