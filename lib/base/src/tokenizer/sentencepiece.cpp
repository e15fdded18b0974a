// Sentencepiece tokenizer.model files, through the sentencepiece library itself, which lives in
// a module loaded on first use (lib/base/spm-module/kv_spm.h explains why it cannot be linked).

#include "../../spm-module/kv_spm.h"
#include "kv/error.hpp"
#include "loaders.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <memory>
#include <mutex>

namespace kv::tokenizer_detail {

namespace {

constexpr std::string_view metaspace = "\xE2\x96\x81";  // U+2581, sentencepiece's space mark

// The module's functions, resolved once per process.
struct SpmModule {
    decltype(&kv_spm_load) load;
    decltype(&kv_spm_free) free;
    decltype(&kv_spm_piece_count) piece_count;
    decltype(&kv_spm_bos_id) bos_id;
    decltype(&kv_spm_eos_id) eos_id;
    decltype(&kv_spm_piece) piece;
    decltype(&kv_spm_piece_flags) piece_flags;
    decltype(&kv_spm_piece_id) piece_id;
    decltype(&kv_spm_encode) encode;
    decltype(&kv_spm_free_ids) free_ids;
};

std::filesystem::path executable_directory() {
    std::error_code error;
    const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
    return error ? std::filesystem::path() : self.parent_path();
}

const SpmModule& spm_module() {
    static std::once_flag once;
    static SpmModule module;
    static std::string failure;
    std::call_once(once, [] {
        // $KV_SPM_MODULE, then the installed layout relative to the executable (the build tree
        // mirrors it), then the absolute install path.
        std::vector<std::filesystem::path> candidates;
        if (const char* override_path = std::getenv("KV_SPM_MODULE"))
            candidates.emplace_back(override_path);
        candidates.push_back(executable_directory() / KV_SPM_MODULE_FROM_BIN);
        candidates.emplace_back(KV_SPM_MODULE_INSTALLED);
        void* handle = nullptr;
        std::string reasons;
#if defined(__SANITIZE_ADDRESS__)
        // AddressSanitizer refuses RTLD_DEEPBIND (google/sanitizers#611). Without it the
        // module's protobuf meets libtorch's and sentencepiece refuses to run: under ASan a
        // tokenizer.model fails with that message instead of aborting the process.
        constexpr int deep_bind = 0;
#else
        constexpr int deep_bind = RTLD_DEEPBIND;
#endif
        for (const auto& candidate : candidates) {
            handle = ::dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL | deep_bind);
            if (handle) break;
            const char* reason = ::dlerror();
            reasons +=
                std::string(reasons.empty() ? "" : "; ") + (reason ? reason : candidate.string());
        }
        if (!handle) {
            failure = "cannot load kvtools' sentencepiece module: " + reasons;
            return;
        }
        auto resolve = [&](auto& slot, const char* name) {
            slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(::dlsym(handle, name));
            if (!slot && failure.empty())
                failure = std::string("sentencepiece module lacks ") + name;
        };
        resolve(module.load, "kv_spm_load");
        resolve(module.free, "kv_spm_free");
        resolve(module.piece_count, "kv_spm_piece_count");
        resolve(module.bos_id, "kv_spm_bos_id");
        resolve(module.eos_id, "kv_spm_eos_id");
        resolve(module.piece, "kv_spm_piece");
        resolve(module.piece_flags, "kv_spm_piece_flags");
        resolve(module.piece_id, "kv_spm_piece_id");
        resolve(module.encode, "kv_spm_encode");
        resolve(module.free_ids, "kv_spm_free_ids");
    });
    if (!failure.empty()) throw UnsupportedError(failure);
    return module;
}

struct ModelDeleter {
    decltype(&kv_spm_free) free = nullptr;
    void operator()(kv_spm* model) const {
        if (model && free) free(model);
    }
};

class SentencePieceTokenizer final : public Tokenizer {
  public:
    SentencePieceTokenizer(const std::filesystem::path& path, std::string_view bytes,
                           const ModelConfigs& configs)
        : spm_(spm_module()), where_(kv::quoted(path.string())) {
        kind_ = "sentencepiece";
        char error[512] = "";
        model_.reset(spm_.load(bytes.data(), bytes.size(), error, sizeof error));
        if (!model_) throw FormatError("invalid sentencepiece model " + where_ + ": " + error);
        model_.get_deleter().free = spm_.free;
        const int32_t size = spm_.piece_count(model_.get());
        token_bytes_.resize(static_cast<size_t>(size));
        for (int32_t id = 0; id < size; ++id)
            token_bytes_[id] = bytes_of_piece(id);

        bos_id_ = spm_.bos_id(model_.get());
        eos_id_ = spm_.eos_id(model_.get());
        add_bos_ = bos_id_ >= 0;
        if (configs.tokenizer_config) {
            const json::Value& config = *configs.tokenizer_config;
            if (int32_t id = piece_id(special_token_content(config.find("bos_token"))); id >= 0) {
                bos_id_ = id;
            }
            if (int32_t id = piece_id(special_token_content(config.find("eos_token"))); id >= 0) {
                eos_id_ = id;
            }
            const json::Value* add_bos = config.find("add_bos_token");
            if (add_bos && add_bos->is_bool()) add_bos_ = add_bos->as_bool() && bos_id_ >= 0;
            const json::Value* add_eos = config.find("add_eos_token");
            if (add_eos && add_eos->is_bool() && add_eos->as_bool() && eos_id_ >= 0) {
                special_suffix_ = {eos_id_};
            }
        }
        if (add_bos_) special_prefix_ = {bos_id_};
        add_end_of_generation(eos_id_);
        for (const auto* config : {&configs.model_config, &configs.generation_config}) {
            if (!*config) continue;
            for (int32_t id : config_token_ids((*config)->find("eos_token_id"))) {
                if (id < size) add_end_of_generation(id);
            }
        }
        // The dummy prefix shows as a space mark at the start of the first piece.
        const std::vector<int32_t> probe = encode("a");
        strips_leading_space_ =
            !probe.empty() && std::string_view(piece_text(probe.front())).starts_with(metaspace);
        set_fingerprint(bytes);
    }

    int32_t vocab_size() const override { return static_cast<int32_t>(token_bytes_.size()); }

    std::string token_bytes(int32_t id) const override {
        check_id(id);
        return token_bytes_[static_cast<size_t>(id)];
    }

    std::vector<int32_t> encode(std::string_view text) const override {
        int32_t* ids = nullptr;
        size_t count = 0;
        char error[512] = "";
        if (spm_.encode(model_.get(), text.data(), text.size(), &ids, &count, error,
                        sizeof error) != 0)
            throw Error("sentencepiece cannot encode with " + where_ + ": " + error);
        std::vector<int32_t> result(ids, ids + count);
        spm_.free_ids(ids);
        return result;
    }

  private:
    std::string piece_text(int32_t id) const {
        size_t length = 0;
        const char* text = spm_.piece(model_.get(), id, &length);
        return std::string(text, length);
    }

    int32_t piece_id(const std::string& piece) const {
        if (piece.empty()) return -1;
        return spm_.piece_id(model_.get(), piece.data(), piece.size());
    }

    std::string bytes_of_piece(int32_t id) const {
        const int flags = spm_.piece_flags(model_.get(), id);
        if (flags & (KV_SPM_CONTROL | KV_SPM_UNKNOWN | KV_SPM_UNUSED)) return "";
        const std::string piece = piece_text(id);
        if ((flags & KV_SPM_BYTE) && piece.size() == 6) {
            return std::string(1, static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));
        }
        std::string text;
        for (size_t at = 0; at < piece.size();) {
            if (std::string_view(piece).substr(at).starts_with(metaspace)) {
                text += ' ';
                at += metaspace.size();
            } else {
                text += piece[at++];
            }
        }
        return text;
    }

    const SpmModule& spm_;
    std::string where_;
    std::unique_ptr<kv_spm, ModelDeleter> model_;
    std::vector<std::string> token_bytes_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece(const std::filesystem::path& path, std::string bytes,
                                              const ModelConfigs& configs) {
    return std::make_unique<SentencePieceTokenizer>(path, bytes, configs);
}

}  // namespace kv::tokenizer_detail
