// The sparse methods' constructors, one per file of this folder; registry.cpp lists them.
#pragma once

#include "kv/sparse/policy.hpp"

#include <memory>

namespace kv::sparse {

std::unique_ptr<SparsePolicy> make_icecache(const PolicySetup& setup);
std::unique_ptr<SparsePolicy> make_streaming(const PolicySetup& setup);
std::unique_ptr<SparsePolicy> make_quest(const PolicySetup& setup);
std::unique_ptr<SparsePolicy> make_h2o(const PolicySetup& setup);
std::unique_ptr<SparsePolicy> make_topk(const PolicySetup& setup);

}  // namespace kv::sparse
