/* C interface of kvtools' sentencepiece module (libkvspm.so).
 *
 * Debian's libsentencepiece embeds its own copy of protobuf-lite, whose symbols collide with the
 * libprotobuf that libtorch loads: linking both into one process crashes during static
 * initialisation. kvtools therefore never links libsentencepiece directly; this small module
 * does, and the tokenizer loads it on demand with RTLD_DEEPBIND so that sentencepiece binds to
 * its own protobuf. Only C types cross the boundary.
 */
#ifndef KV_SPM_H
#define KV_SPM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kv_spm kv_spm;

enum {
    KV_SPM_CONTROL = 1,
    KV_SPM_UNKNOWN = 2,
    KV_SPM_UNUSED = 4,
    KV_SPM_BYTE = 8,
};

/* Loads a serialized ModelProto; on failure returns NULL and writes a message to `error`. */
kv_spm* kv_spm_load(const char* bytes, size_t size, char* error, size_t error_size);
void kv_spm_free(kv_spm* model);
int32_t kv_spm_piece_count(const kv_spm* model);
int32_t kv_spm_bos_id(const kv_spm* model);
int32_t kv_spm_eos_id(const kv_spm* model);
/* The piece's text (valid while the model lives) and its length. */
const char* kv_spm_piece(const kv_spm* model, int32_t id, size_t* length);
int kv_spm_piece_flags(const kv_spm* model, int32_t id);
/* The id of an exact piece, or -1. */
int32_t kv_spm_piece_id(const kv_spm* model, const char* piece, size_t length);
/* Encodes text; the caller frees *ids with kv_spm_free_ids. Returns 0, or -1 with `error` set. */
int kv_spm_encode(const kv_spm* model, const char* text, size_t length, int32_t** ids,
                  size_t* count, char* error, size_t error_size);
void kv_spm_free_ids(int32_t* ids);

#ifdef __cplusplus
}
#endif

#endif
