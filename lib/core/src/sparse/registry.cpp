// The sparse methods there are: what --attention offers, its help text, and how each is made.
#include "kv/error.hpp"
#include "kv/sparse/options.hpp"
#include "methods.hpp"

namespace kv {
namespace {

struct Entry {
    SparseMethodInfo info;
    std::unique_ptr<SparsePolicy> (*make)(const PolicySetup&);  // null for "full"
};

const std::vector<Entry>& entries() {
    static const std::vector<Entry> list = {
        {{"full", "every row (dense attention)"}, nullptr},
        {{"icecache",
          "IceCache: pages of keys clustered by meaning, retrieved through each layer's DCI "
          "index"},
         sparse::make_icecache},
        {{"streaming", "StreamingLLM: the sink and the most recent rows"}, sparse::make_streaming},
        {{"quest", "Quest: token-order pages ranked by an upper bound of their keys' scores"},
         sparse::make_quest},
        {{"h2o", "H2O: the recent rows and those that gathered the most attention"},
         sparse::make_h2o},
        {{"topk", "the exact best rows of each step (an oracle: it scores every key)"},
         sparse::make_topk},
    };
    return list;
}

}  // namespace

const std::vector<SparseMethodInfo>& sparse_methods() {
    static const std::vector<SparseMethodInfo> methods = [] {
        std::vector<SparseMethodInfo> infos;
        for (const Entry& entry : entries())
            infos.push_back(entry.info);
        return infos;
    }();
    return methods;
}

void check_sparse_method(const std::string& name) {
    std::string names;
    const std::vector<Entry>& list = entries();
    for (std::size_t i = 0; i < list.size(); ++i) {
        if (list[i].info.name == name) return;
        names += (i == 0 ? "" : i + 1 == list.size() ? " or " : ", ") + list[i].info.name;
    }
    throw UsageError("unknown attention method " + kv::quoted(name) + " (" + names + ")");
}

std::unique_ptr<SparsePolicy> make_sparse_policy(const std::string& method,
                                                 const PolicySetup& setup) {
    check_sparse_method(method);
    for (const Entry& entry : entries())
        if (entry.info.name == method && entry.make) return entry.make(setup);
    throw UsageError("attention method " + kv::quoted(method) + " chooses no rows");
}

}  // namespace kv
