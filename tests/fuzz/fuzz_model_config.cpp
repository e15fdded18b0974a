// config.json: the JSON parser, the Hugging Face config reader and its validation.
#include "fuzz_input.hpp"
#include "kv/json.hpp"
#include "kv/model/config.hpp"

#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
    kv::fuzz::expect_clean_outcome([&] {
        const kv::json::Value value =
            kv::json::parse(std::string_view(reinterpret_cast<const char*>(data), size));
        const kv::ModelConfig config = kv::parse_hf_config(value, "config.json");
        kv::validate_config(config, "config.json");
        kv::json::dump(kv::config_to_hf_json(config));
    });
    return 0;
}
