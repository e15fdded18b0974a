// Working memory of the hand-written kernels (gemv.cpp, attention_rows.cpp): a float buffer per
// thread and per use, kept between calls, so that a kernel called per layer and head does not
// allocate, zero-fill and fault in fresh pages each time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kv {

/// At least `count` floats for the calling thread, one buffer per `Use` (a tag type, so that two
/// kernels live at once never share one). Their contents are the caller's to write before reading:
/// growing it keeps nothing.
template <class Use>
float* kernel_scratch(int64_t count) {
    thread_local std::vector<float> buffer;
    if (static_cast<int64_t>(buffer.size()) < count) {
        buffer = {};  // no copy of the old contents into the larger buffer
        buffer.resize(static_cast<std::size_t>(count));
    }
    return buffer.data();
}

}  // namespace kv
