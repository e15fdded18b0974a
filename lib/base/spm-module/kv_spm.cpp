// The only translation unit of kvtools that includes sentencepiece (see kv_spm.h for why).
#include "kv_spm.h"

#include <sentencepiece_processor.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

struct kv_spm {
    sentencepiece::SentencePieceProcessor processor;
};

namespace {

void write_error(char* error, size_t error_size, const std::string& message) {
    if (!error || error_size == 0) return;
    const size_t length = std::min(message.size(), error_size - 1);
    std::memcpy(error, message.data(), length);
    error[length] = '\0';
}

bool valid_id(const kv_spm* model, int32_t id) {
    return id >= 0 && id < model->processor.GetPieceSize();
}

}  // namespace

extern "C" {

kv_spm* kv_spm_load(const char* bytes, size_t size, char* error, size_t error_size) {
    try {
        auto* model = new kv_spm();
        const auto status = model->processor.LoadFromSerializedProto(std::string_view(bytes, size));
        if (!status.ok()) {
            write_error(error, error_size, status.ToString());
            delete model;
            return nullptr;
        }
        return model;
    } catch (const std::exception& exception) {
        write_error(error, error_size, exception.what());
        return nullptr;
    }
}

void kv_spm_free(kv_spm* model) {
    delete model;
}

int32_t kv_spm_piece_count(const kv_spm* model) {
    return model->processor.GetPieceSize();
}
int32_t kv_spm_bos_id(const kv_spm* model) {
    return model->processor.bos_id();
}
int32_t kv_spm_eos_id(const kv_spm* model) {
    return model->processor.eos_id();
}

const char* kv_spm_piece(const kv_spm* model, int32_t id, size_t* length) {
    if (!valid_id(model, id)) {
        *length = 0;
        return "";
    }
    const std::string& piece = model->processor.IdToPiece(id);
    *length = piece.size();
    return piece.data();
}

int kv_spm_piece_flags(const kv_spm* model, int32_t id) {
    if (!valid_id(model, id)) return 0;
    const auto& processor = model->processor;
    return (processor.IsControl(id) ? KV_SPM_CONTROL : 0) |
           (processor.IsUnknown(id) ? KV_SPM_UNKNOWN : 0) |
           (processor.IsUnused(id) ? KV_SPM_UNUSED : 0) | (processor.IsByte(id) ? KV_SPM_BYTE : 0);
}

int32_t kv_spm_piece_id(const kv_spm* model, const char* piece, size_t length) {
    const std::string wanted(piece, length);
    const int id = model->processor.PieceToId(wanted);
    // PieceToId answers unknown pieces with the <unk> id.
    return id >= 0 && model->processor.IdToPiece(id) == wanted ? id : -1;
}

int kv_spm_encode(const kv_spm* model, const char* text, size_t length, int32_t** ids,
                  size_t* count, char* error, size_t error_size) {
    try {
        std::vector<int> encoded;
        const auto status = model->processor.Encode(std::string_view(text, length), &encoded);
        if (!status.ok()) {
            write_error(error, error_size, status.ToString());
            return -1;
        }
        *count = encoded.size();
        *ids = static_cast<int32_t*>(
            std::malloc(std::max<size_t>(1, encoded.size()) * sizeof(int32_t)));
        if (!*ids) throw std::bad_alloc();
        for (size_t i = 0; i < encoded.size(); ++i)
            (*ids)[i] = encoded[i];
        return 0;
    } catch (const std::exception& exception) {
        write_error(error, error_size, exception.what());
        return -1;
    }
}

void kv_spm_free_ids(int32_t* ids) {
    std::free(ids);
}
}
