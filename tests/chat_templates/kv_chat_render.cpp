// kvtools' side of the chat template conformance suite (README.md beside this file).
//
// Usage: kv_chat_render MODEL_DIR < CASES > RESULTS. Reads the model folder's chat template and
// special tokens with kv::text::read_chat_template, and for every case (a JSON line whose
// variables hold messages, tools and add_generation_prompt) renders it with the variables
// chat_variables() gives, as kvserve-once --chat does; writes {"output"} or {"error", "kind"}.
#include <exception>
#include <iostream>
#include <string>

#include "kv/error.hpp"
#include "kv/json.hpp"
#include "kv/text/chat_template.hpp"

int main(int argc, char** argv) {
    if (argc != 2) {
        std::cerr << "usage: kv_chat_render MODEL_DIR < CASES\n";
        return 2;
    }
    try {
        auto model = kv::text::read_chat_template(argv[1]);
        if (!model) {
            std::cerr << "kv_chat_render: " << argv[1] << " has no chat template\n";
            return 1;
        }
        kv::text::ChatTemplate tmpl(model->source);
        std::string line;
        while (std::getline(std::cin, line)) {
            kv::json::Value c = kv::json::parse(line);
            const kv::json::Value& given = c.at("variables");
            kv::json::Value variables = kv::text::chat_variables(
                *model, given.at("messages"), given.at("add_generation_prompt").as_bool());
            variables.set("tools", given.at("tools"));
            kv::text::ChatRenderOptions options;
            options.now = c.at("now").as_int();
            kv::json::Value result = kv::json::Value::object();
            try {
                result.set("output", tmpl.render(variables, options));
            } catch (const kv::text::ChatTemplateError& e) {
                result.set("error", e.what());
                result.set("kind", e.raised_by_template() ? "raised" : "render");
            } catch (const kv::UnsupportedError& e) {
                result.set("error", e.what());
                result.set("kind", "unsupported");
            }
            std::cout << kv::json::dump(result) << "\n";
        }
    } catch (const std::exception& e) {
        std::cerr << "kv_chat_render: " << e.what() << "\n";
        return 1;
    }
    return 0;
}
