// Packets baked separately and realigned equal one forward pass over all documents with a
// block-diagonal mask: the proof that realignment by rotation is exact, for both RoPE layouts.
#include "cache_fixtures.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/model/model.hpp"
#include "kv/model/ops.hpp"
#include "kv/model/packets.hpp"
#include "kv/model/row_attention.hpp"
#include "kv/rope.hpp"
#include "random_model.hpp"
#include "test_support.hpp"

#include <ATen/Parallel.h>
#include <catch2/catch.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>

using namespace kv;

namespace {

Packet bake_alone(const Model& model, const std::vector<int32_t>& ids, const std::string& id) {
    KvCache cache = model.new_cache();
    model.prefill(ids, cache);
    Packet packet;
    packet.id = id;
    packet.token_ids = ids;
    for (std::size_t i = 0; i < ids.size(); ++i)
        packet.positions.push_back(static_cast<int64_t>(i));
    packet.logical_length = static_cast<int64_t>(ids.size());
    copy_cache_to_packet(cache, 0, static_cast<int64_t>(ids.size()), CacheDtype::f32, packet);
    return packet;
}

}  // namespace

TEST_CASE("packed packets equal a block-diagonal pass over all documents", "[packets]") {
    for (const std::string architecture : {"LlamaForCausalLM", "llama2.c", "Qwen3ForCausalLM"}) {
        DYNAMIC_SECTION(architecture) {
            ModelConfig config = testing::small_config(architecture);
            if (architecture == "LlamaForCausalLM") {  // with llama3 scaling, the hardest rotation
                config.rope_theta = 500000;
                config.rope_scaling = {RopeScalingType::llama3, 8.0, 1.0, 4.0, 64};
            }
            auto model = Model::from_weights(testing::make_random_model(config, 11).weights,
                                             torch::kFloat32, torch::kCPU);
            torch::NoGradGuard no_grad;
            const std::vector<int32_t> first = {1, 4, 9, 16, 25}, second = {2, 3, 5, 7, 11, 13, 17};
            const std::vector<int32_t> question = {8, 6, 4};

            // Separately baked at positions from 0, then packed: keys rotated by their offsets.
            KvCache packed = model->new_cache();
            append_packet(model->rope(), packed, bake_alone(*model, first, "a"), CacheDtype::f32);
            append_packet(model->rope(), packed, bake_alone(*model, second, "b"), CacheDtype::f32);
            CHECK(packed.next_position() == 12);

            // One pass over both documents, each seeing only itself, at positions 0..11.
            std::vector<int32_t> both = first;
            both.insert(both.end(), second.begin(), second.end());
            torch::Tensor allow = torch::zeros({12, 12}, torch::kBool);
            allow.narrow(0, 0, 5).narrow(1, 0, 5).fill_(true);
            allow.narrow(0, 5, 7).narrow(1, 5, 7).fill_(true);
            KvCache joint = model->new_cache();
            model->forward(model->embed(both), torch::arange(12, torch::kInt64), joint, allow);

            for (int64_t layer = 0; layer < config.num_layers; ++layer) {
                CHECK(torch::allclose(packed.keys(layer), joint.keys(layer), 1e-4, 1e-5));
                CHECK(torch::allclose(packed.values(layer), joint.values(layer), 1e-4, 1e-5));
            }
            CHECK(torch::equal(packed.positions(), joint.positions()));

            // And a question decoded on top sees the same context either way.
            const torch::Tensor from_packed = model->prefill(question, packed);
            const torch::Tensor from_joint = model->prefill(question, joint);
            CHECK(torch::allclose(from_packed, from_joint, 1e-4, 1e-4));
        }
    }
}

TEST_CASE("a cleared cache answers the next question as a fresh one does, bit for bit",
          "[packets]") {
    // kvserve-once --requests empties the last question's cache for the next one.
    ModelConfig config = testing::small_config("LlamaForCausalLM");
    auto model = Model::from_weights(testing::make_random_model(config, 31).weights,
                                     torch::kFloat32, torch::kCPU);
    torch::NoGradGuard no_grad;
    const Packet a = bake_alone(*model, {1, 4, 9, 16, 25, 36}, "a");
    const Packet b = bake_alone(*model, {2, 3, 5, 7}, "b");
    const Packet c = bake_alone(*model, {8, 6, 7, 5, 3, 0, 9}, "c");
    const std::vector<int32_t> question = {12, 14, 6};
    KvCache reused = model->new_cache(64);
    append_packet(model->rope(), reused, a, CacheDtype::f32);
    append_packet(model->rope(), reused, b, CacheDtype::f32);
    model->prefill(question, reused);
    reused.clear();
    append_packet(model->rope(), reused, c, CacheDtype::f32);
    const torch::Tensor from_reused = model->prefill(question, reused);
    KvCache fresh = model->new_cache(64);
    append_packet(model->rope(), fresh, c, CacheDtype::f32);
    const torch::Tensor from_fresh = model->prefill(question, fresh);
    CHECK(torch::equal(from_reused, from_fresh));
    REQUIRE(reused.length() == fresh.length());
    CHECK(torch::equal(reused.positions(), fresh.positions()));
    for (int64_t layer = 0; layer < config.num_layers; ++layer) {
        CHECK(torch::equal(reused.keys(layer), fresh.keys(layer)));
        CHECK(torch::equal(reused.values(layer), fresh.values(layer)));
    }
}

TEST_CASE("BOS's kept rows are the rows the model gives BOS, bit for bit", "[packets]") {
    // kvserve-once --requests computes BOS once and copies its rows into every later question.
    for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
        ModelConfig config = testing::small_config("LlamaForCausalLM");
        auto model =
            Model::from_weights(testing::make_random_model(config, 33).weights, dtype, torch::kCPU);
        torch::NoGradGuard no_grad;
        const Packet doc = bake_alone(*model, {7, 3, 11, 2}, "doc");
        const std::vector<int32_t> question = {5, 9, 4};
        const int32_t bos = 1;
        BosRows kept;
        std::vector<torch::Tensor> answers;
        std::vector<KvCache> caches;
        for (int question_number = 0; question_number < 3; ++question_number) {
            KvCache cache = model->new_cache(64);
            if (question_number < 2)
                kept.prefill(*model, bos, cache);  // computed, then copied
            else
                model->prefill(std::span<const int32_t>(&bos, 1), cache);  // as without it
            CHECK(cache.length() == 1);
            CHECK(cache.next_position() == 1);
            append_packet(model->rope(), cache, doc, CacheDtype::f32);
            answers.push_back(model->prefill(question, cache));
            caches.push_back(std::move(cache));
        }
        for (std::size_t other : {0, 1}) {
            CHECK(torch::equal(answers[other], answers[2]));
            CHECK(torch::equal(caches[other].positions(), caches[2].positions()));
            for (int64_t layer = 0; layer < config.num_layers; ++layer) {
                CHECK(torch::equal(caches[other].keys(layer), caches[2].keys(layer)));
                CHECK(torch::equal(caches[other].values(layer), caches[2].values(layer)));
            }
        }
        KvCache not_empty = model->new_cache(64);
        append_packet(model->rope(), not_empty, doc, CacheDtype::f32);
        CHECK_THROWS_WITH(kept.prefill(*model, bos, not_empty),
                          Catch::Contains("BOS goes into an empty cache"));
    }
}

TEST_CASE("the cache takes written rows as libtorch's copy would, from any layout", "[packets]") {
    // Host rows go in by memcpy; other layouts, dtypes and autograd's sources through copy_.
    torch::NoGradGuard no_grad;
    for (torch::ScalarType dtype : {torch::kFloat32, torch::kBFloat16}) {
        const int64_t heads = 3, dim = 8;
        KvCache cache(1, heads, dim, dtype, torch::kCPU, 4);
        std::vector<torch::Tensor> keys, values;
        auto write = [&](const torch::Tensor& k, const torch::Tensor& v) {
            const int64_t tokens = k.size(1);
            cache.begin_append(torch::arange(cache.next_position(), cache.next_position() + tokens,
                                             torch::kInt64));
            cache.write(0, k, v);
            cache.commit();
            keys.push_back(k.to(dtype));
            values.push_back(v.to(dtype));
        };
        torch::manual_seed(5);
        // Contiguous [H, T, D]; a decoding step's view of [T, H, D]; a prefill's; another dtype
        // (converted by copy_); rows with a gap between them; one token. The cache grows past 4.
        write(torch::randn({heads, 2, dim}).to(dtype), torch::randn({heads, 2, dim}).to(dtype));
        write(torch::randn({1, heads, dim}).to(dtype).transpose(0, 1),
              torch::randn({1, heads, dim}).to(dtype).transpose(0, 1));
        write(torch::randn({5, heads, dim}).to(dtype).transpose(0, 1),
              torch::randn({5, heads, dim}).to(dtype).transpose(0, 1));
        write(torch::randn({heads, 3, dim}, torch::kFloat64), torch::randn({heads, 3, dim}));
        write(torch::randn({heads, 4, 2 * dim}).to(dtype).narrow(2, 0, dim),
              torch::randn({heads, 4, dim + 1}).to(dtype).narrow(2, 1, dim));
        write(torch::randn({heads, 1, dim}).to(dtype), torch::randn({heads, 1, dim}).to(dtype));
        CHECK(cache.length() == 16);
        CHECK(torch::equal(cache.keys(0), torch::cat(keys, 1)));
        CHECK(torch::equal(cache.values(0), torch::cat(values, 1)));
    }
}

TEST_CASE(
    "an empty cache's pages are faulted in on every thread, a cache with tokens is left alone",
    "[packets]") {
    torch::NoGradGuard no_grad;
    const int64_t layers = 2, heads = 2, dim = 64, capacity = 20000;  // 2.4 MiB a tensor in f32
    KvCache cache(layers, heads, dim, torch::kFloat32, torch::kCPU, capacity);
    // Which of a tensor's 4 KiB pages are in memory (mincore).
    auto resident_pages = [](const torch::Tensor& tensor) {
        const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
        const auto begin = reinterpret_cast<std::uintptr_t>(tensor.data_ptr()) & ~(page - 1);
        const auto end = reinterpret_cast<std::uintptr_t>(tensor.data_ptr()) +
                         static_cast<std::uintptr_t>(tensor.nbytes());
        std::vector<unsigned char> in_memory((end - begin + page - 1) / page);
        REQUIRE(mincore(reinterpret_cast<void*>(begin), end - begin, in_memory.data()) == 0);
        return static_cast<std::size_t>(std::count_if(in_memory.begin(), in_memory.end(),
                                                      [](unsigned char v) { return v & 1; }));
    };
    const int64_t threads = at::get_num_threads();
    at::set_num_threads(2);
    cache.fault_in();
    at::set_num_threads(static_cast<int>(threads));
    const torch::Tensor whole_keys =
        cache.keys(0).as_strided({heads, capacity, dim}, {capacity * dim, dim, 1});
    const auto pages = static_cast<std::size_t>((whole_keys.nbytes() + 4095) / 4096);
    CHECK(resident_pages(whole_keys) >= pages);

    // Rows written after it are the rows read back; fault_in on a cache holding them is a no-op.
    torch::manual_seed(3);
    const torch::Tensor keys = torch::randn({heads, 5, dim}),
                        values = torch::randn({heads, 5, dim});
    cache.begin_append(torch::arange(0, 5, torch::kInt64));
    for (int64_t layer = 0; layer < layers; ++layer)
        cache.write(layer, keys, values);
    cache.commit();
    cache.fault_in();
    for (int64_t layer = 0; layer < layers; ++layer) {
        CHECK(torch::equal(cache.keys(layer), keys));
        CHECK(torch::equal(cache.values(layer), values));
    }
}

TEST_CASE("a compressed packet keeps its logical length when packed", "[packets]") {
    auto model = Model::from_weights(
        testing::make_random_model(testing::small_config("llama2.c"), 5).weights, torch::kFloat32,
        torch::kCPU);
    torch::NoGradGuard no_grad;
    Packet packet = bake_alone(*model, {3, 1, 4, 1, 5}, "gappy");
    packet.logical_length = 9;  // as if four trailing positions had been pruned
    KvCache cache = model->new_cache();
    append_packet(model->rope(), cache, packet, CacheDtype::f32);
    append_packet(model->rope(), cache, packet, CacheDtype::f32);
    CHECK(cache.length() == 10);
    CHECK(cache.next_position() == 18);
    CHECK(cache.positions()[5].item<int64_t>() == 9);
}

TEST_CASE(
    "selective recomputation: all of it equals prefilling the documents together, "
    "CacheBlend and EPIC recompute what they say",
    "[packets]") {
    ModelConfig config = testing::small_config("LlamaForCausalLM");
    config.num_layers = 4;
    auto model = Model::from_weights(testing::make_random_model(config, 23).weights,
                                     torch::kFloat32, torch::kCPU);
    torch::NoGradGuard no_grad;
    const std::vector<int32_t> first = {1, 4, 9, 16, 25}, second = {2, 3, 5, 7, 11, 13, 17};
    std::vector<int32_t> both = first;
    both.insert(both.end(), second.begin(), second.end());
    auto packed = [&] {
        KvCache cache = model->new_cache();
        append_packet(model->rope(), cache, bake_alone(*model, first, "a"), CacheDtype::f32);
        append_packet(model->rope(), cache, bake_alone(*model, second, "b"), CacheDtype::f32);
        return cache;
    };
    KvCache together = model->new_cache();
    model->prefill(both, together);
    const torch::Tensor every = torch::arange(12, torch::kInt64);

    KvCache all = packed();
    CHECK(model->recompute(all, every, both) == std::vector<int64_t>{12, 12, 12, 12});
    for (int64_t layer = 0; layer < config.num_layers; ++layer) {
        CHECK(torch::allclose(all.keys(layer), together.keys(layer), 1e-4, 1e-5));
        CHECK(torch::allclose(all.values(layer), together.values(layer), 1e-4, 1e-5));
    }

    // CacheBlend: layers 0 and 1 for every token, then the half that moved most at layer 1.
    KvCache blend = packed();
    const KvCache baked = packed();
    CHECK(model->recompute(blend, every, both, 0.5, 1) == std::vector<int64_t>{12, 12, 6, 6});
    for (int64_t layer : {0, 1})
        CHECK(torch::allclose(blend.keys(layer), together.keys(layer), 1e-4, 1e-5));
    const torch::Tensor changed = (blend.keys(2) - baked.keys(2))
                                      .abs()
                                      .amax(std::vector<int64_t>{0, 2})
                                      .gt(0)
                                      .to(torch::kInt64);
    CHECK(changed.sum().item<int64_t>() == 6);
    // The first document saw nothing before it: its tokens do not move, so the six that did are
    // in the second.
    CHECK(changed.narrow(0, 0, 5).sum().item<int64_t>() == 0);

    // EPIC: the first two tokens of each document, in every layer; the rest stay as baked.
    KvCache epic = packed();
    const std::vector<int32_t> starts = {first[0], first[1], second[0], second[1]};
    CHECK(model->recompute(epic, torch::tensor({0, 1, 5, 6}, torch::kInt64), starts) ==
          std::vector<int64_t>{4, 4, 4, 4});
    for (int64_t layer = 0; layer < config.num_layers; ++layer) {
        const torch::Tensor moved =
            (epic.keys(layer) - baked.keys(layer)).abs().amax(std::vector<int64_t>{0, 2}).gt(1e-6);
        CHECK(moved.narrow(0, 0, 5).sum().item<int64_t>() == 0);  // the first saw nothing new
        CHECK(moved.narrow(0, 7, 5).sum().item<int64_t>() == 0);  // not recomputed
        // Layer 0's keys depend on the token alone; from layer 1 on they saw the first document.
        if (layer > 0) CHECK(moved.narrow(0, 5, 2).all().item<bool>());
    }
}

TEST_CASE("a cache offloaded to disk holds and decodes exactly what one in memory does",
          "[packets][offload]") {
    ModelConfig config = testing::small_config("LlamaForCausalLM");
    config.num_layers = 3;
    auto model = Model::from_weights(testing::make_random_model(config, 41).weights,
                                     torch::kFloat32, torch::kCPU);
    torch::NoGradGuard no_grad;
    test::TempDir dir;
    for (const CacheDtype stored : {CacheDtype::f32, CacheDtype::bf16}) {
        CAPTURE(cache_dtype_name(stored));
        // Two baked packets in one file, in the stored dtype: the second is realigned.
        CacheModelInfo info = test::test_model(stored);
        info.num_layers = config.num_layers;
        info.num_kv_heads = config.num_kv_heads;
        info.head_dim = config.head_dim;
        std::vector<Packet> packets = {bake_alone(*model, {3, 1, 4, 1, 5, 9, 2, 6}, "a"),
                                       bake_alone(*model, {2, 7, 1, 8, 2, 8}, "b")};
        for (Packet& packet : packets) {
            if (stored == CacheDtype::bf16)
                for (auto* tensor : {&packet.keys, &packet.values}) {
                    const torch::Tensor wide =
                        torch::from_blob(tensor->data(), {static_cast<int64_t>(tensor->size() / 4)},
                                         torch::kFloat32);
                    const torch::Tensor narrow = wide.to(torch::kBFloat16);
                    const auto* bytes = static_cast<const std::byte*>(narrow.data_ptr());
                    *tensor = std::vector<std::byte>(bytes, bytes + narrow.nbytes());
                }
        }
        const auto path = dir.path() / (std::string(cache_dtype_name(stored)) + ".kvc");
        test::write_store(path, info, packets);
        const CacheReader reader(path);

        KvCache memory = model->new_cache();
        KvCache disk = KvCache::on_disk(config.num_layers, config.num_kv_heads, config.head_dim,
                                        torch::kFloat32, 20, dir.path());
        CHECK(disk.offloaded());
        CHECK_FALSE(memory.offloaded());
        for (const PacketInfo& packet : reader.packets()) {
            append_packet(model->rope(), memory, reader.read(packet.id), stored);
            append_packet_planes(model->rope(), disk, reader.read_without_tensors(packet.id),
                                 reader, stored);
        }
        disk.release_pages();  // the data stays in the file
        REQUIRE(disk.length() == 14);
        CHECK(disk.next_position() == memory.next_position());
        CHECK(torch::equal(disk.positions(), memory.positions()));
        for (int64_t layer = 0; layer < config.num_layers; ++layer) {
            CHECK(torch::equal(disk.keys(layer), memory.keys(layer)));
            CHECK(torch::equal(disk.values(layer), memory.values(layer)));
        }
        // Decoding writes new tokens into the file and reads them back, layer by layer released.
        const std::vector<int32_t> prompt = {4, 2, 11};
        const torch::Tensor from_memory = model->prefill(prompt, memory);
        const torch::Tensor from_disk = model->prefill(prompt, disk);
        CHECK(torch::equal(from_memory, from_disk));
        CHECK(torch::equal(disk.keys(2), memory.keys(2)));
        // Chosen rows gathered from the file into one staging buffer attend exactly as rows
        // picked from memory (runs and single rows, out of order across heads).
        const std::vector<std::vector<int64_t>> rows = {{0, 1, 2, 7, 9, 16}, {3, 4, 5, 6, 16}};
        const torch::Tensor queries = torch::randn({config.num_heads, 1, config.head_dim});
        for (int64_t layer = 0; layer < config.num_layers; ++layer) {
            const torch::Tensor expected =
                attention_over_rows(queries, memory.keys(layer), memory.values(layer), rows, 0.25);
            CHECK(torch::equal(attention_over_staged_rows(queries, disk, layer, rows, 0.25),
                               expected));
            CHECK(torch::equal(attention_over_staged_rows(queries, memory, layer, rows, 0.25),
                               expected));
        }
        // A dense layer of the file streamed in chunks is, bit for bit, attention over all its
        // rows in memory (the decoding kernel), and so is attention over every row chosen.
        std::vector<std::vector<int64_t>> all(2);
        for (auto& head : all)
            for (int64_t row = 0; row < disk.length(); ++row)
                head.push_back(row);
        const AttentionMask sees_all{torch::tensor(std::vector<int64_t>{memory.next_position()}),
                                     memory.positions(),
                                     0,
                                     {},
                                     {}};
        for (int64_t layer = 0; layer < config.num_layers; ++layer)
            for (const int64_t chunk : {1, 5, 4096}) {
                const torch::Tensor streamed =
                    attention_streamed(queries, disk, layer, 0.25, chunk);
                CHECK(torch::equal(streamed, attention(queries, memory.keys(layer),
                                                       memory.values(layer), sees_all, 0.25)));
                CHECK(torch::equal(streamed, attention_over_rows(queries, memory.keys(layer),
                                                                 memory.values(layer), all, 0.25)));
            }
        // One decoding step, whose dense layers stream: the same logits, bit for bit.
        const torch::Tensor step_memory = model->prefill(std::vector<int32_t>{7}, memory);
        const torch::Tensor step_disk = model->prefill(std::vector<int32_t>{7}, disk);
        CHECK(torch::equal(step_memory, step_disk));
        // Made for 20 tokens, it cannot grow.
        CHECK_THROWS_AS(model->prefill(std::vector<int32_t>(3, 1), disk), UnsupportedError);
        CHECK(disk.length() == 18);
    }
    // The file has no name: nothing is left in the folder.
    CHECK(std::distance(std::filesystem::directory_iterator(dir.path()),
                        std::filesystem::directory_iterator()) == 2);
    CHECK_THROWS_AS(KvCache::on_disk(1, 1, 8, torch::kFloat32, 4, dir.path() / "absent"), IoError);
}

TEST_CASE("a bf16 cache on disk streams and stages its rows as one in memory attends to them",
          "[offload]") {
    torch::NoGradGuard no_grad;
    test::TempDir dir;
    torch::manual_seed(5);
    const int64_t layers = 2, kv_heads = 2, dim = 16, tokens = 37;
    KvCache memory(layers, kv_heads, dim, torch::kBFloat16, torch::kCPU);
    KvCache disk = KvCache::on_disk(layers, kv_heads, dim, torch::kBFloat16, 40, dir.path());
    std::vector<torch::Tensor> keys, values;
    for (int64_t layer = 0; layer < layers; ++layer) {
        keys.push_back(torch::randn({kv_heads, tokens, dim}).to(torch::kBFloat16));
        values.push_back(torch::randn({kv_heads, tokens, dim}).to(torch::kBFloat16));
    }
    const torch::Tensor positions = torch::arange(tokens, torch::kInt64);
    memory.append(keys, values, positions);
    disk.append(keys, values, positions);
    disk.release_pages();
    // A range of rows reads the same bytes as the same rows gathered one list, from either tier.
    for (const KvCache* cache : {&memory, &disk}) {
        const std::vector<int64_t> rows = {5, 6, 7, 8, 9, 10};
        const torch::Tensor by_list = torch::empty({2, 6, dim}, torch::kBFloat16);
        const torch::Tensor by_range = torch::empty({2, 6, dim}, torch::kBFloat16);
        cache->gather(1, 1, rows, by_list[0].data_ptr(), by_list[1].data_ptr());
        cache->gather_range(1, 1, 5, 6, by_range[0].data_ptr(), by_range[1].data_ptr());
        CHECK(torch::equal(by_list, by_range));
        CHECK(torch::equal(by_range[0], keys[1][1].narrow(0, 5, 6)));
        CHECK_THROWS_WITH(cache->gather_range(1, 1, 30, 8, by_range[0].data_ptr(), nullptr),
                          Catch::Contains("gather of rows 30+8 of 37"));
    }
    const torch::Tensor queries = torch::randn({6, 1, dim}).to(torch::kBFloat16);
    std::vector<std::vector<int64_t>> all(kv_heads), some = {{0, 5, 6, 7, 30}, {36, 2, 3}};
    for (auto& head : all)
        for (int64_t row = 0; row < tokens; ++row)
            head.push_back(row);
    for (int64_t layer = 0; layer < layers; ++layer) {
        const torch::Tensor expected =
            attention_over_rows(queries, memory.keys(layer), memory.values(layer), all, 0.3)
                .to(torch::kFloat32);
        const AttentionMask sees_all{
            torch::tensor(std::vector<int64_t>{tokens}), positions, 0, {}, {}};
        const torch::Tensor in_memory =
            attention(queries, memory.keys(layer), memory.values(layer), sees_all, 0.3);
        for (const int64_t chunk : {1, 8, 64}) {
            const torch::Tensor streamed = attention_streamed(queries, disk, layer, 0.3, chunk);
            CHECK(torch::equal(streamed, in_memory));
            CHECK(torch::allclose(streamed.to(torch::kFloat32), expected, 1e-2, 1e-2));
        }
        CHECK(torch::equal(
            attention_over_staged_rows(queries, disk, layer, some, 0.3),
            attention_over_rows(queries, memory.keys(layer), memory.values(layer), some, 0.3)));
        // Every row chosen is attention() itself, bit for bit (the decoding kernel); some rows
        // are, up to bf16's rounding of the result, float64 attention over those rows.
        CHECK(torch::equal(
            attention_over_rows(queries, memory.keys(layer), memory.values(layer), all, 0.3),
            in_memory));
        const torch::Tensor chosen =
            attention_over_rows(queries, memory.keys(layer), memory.values(layer), some, 0.3);
        const int64_t group = queries.size(0) / kv_heads;
        for (int64_t head = 0; head < kv_heads; ++head) {
            const torch::Tensor index = torch::tensor(some[static_cast<std::size_t>(head)]);
            const torch::Tensor k = keys[layer][head].index_select(0, index).to(torch::kFloat64);
            const torch::Tensor v = values[layer][head].index_select(0, index).to(torch::kFloat64);
            const torch::Tensor q =
                queries.narrow(0, head * group, group).reshape({group, dim}).to(torch::kFloat64);
            const torch::Tensor reference =
                torch::softmax(torch::matmul(q, k.t()) * 0.3, -1).matmul(v);
            CHECK(torch::allclose(
                chosen.narrow(0, head * group, group).reshape({group, dim}).to(torch::kFloat64),
                reference, 1e-2, 1e-2));
        }
    }
}

TEST_CASE("a long packet goes to disk in pieces, realigned, as append_packet puts it in memory",
          "[offload]") {
    torch::NoGradGuard no_grad;
    test::TempDir dir;
    CacheModelInfo info = test::test_model(CacheDtype::bf16);
    info.rope_scaling = rope_scaling_to_json({RopeScalingType::llama3, 8.0, 1.0, 4.0, 64});
    const RopeSettings settings = rope_settings(info);
    const Rope rope(settings.layout, settings.inverse_frequencies);
    // Plain values: make_packet's bf16 bytes are arbitrary bit patterns.
    auto plain = [](Packet packet) {
        for (auto* tensor : {&packet.keys, &packet.values}) {
            const auto count = static_cast<int64_t>(tensor->size() / 2);
            const torch::Tensor values =
                torch::randn({count}, torch::TensorOptions().dtype(torch::kFloat32))
                    .to(torch::kBFloat16);
            const auto* bytes = static_cast<const std::byte*>(values.data_ptr());
            *tensor = std::vector<std::byte>(bytes, bytes + values.nbytes());
        }
        return packet;
    };
    torch::manual_seed(9);
    const std::vector<Packet> packets = {plain(test::make_packet(info, "short", 37, 1)),
                                         plain(test::make_packet(info, "long", 16384 + 100, 2))};
    test::write_store(dir.path() / "a.kvc", info, packets);
    const CacheReader reader(dir.path() / "a.kvc");
    KvCache memory(info.num_layers, info.num_kv_heads, info.head_dim, torch::kBFloat16,
                   torch::kCPU);
    KvCache disk = KvCache::on_disk(info.num_layers, info.num_kv_heads, info.head_dim,
                                    torch::kBFloat16, 16384 + 137, dir.path());
    for (const PacketInfo& packet : reader.packets()) {
        append_packet(rope, memory, reader.read(packet.id), CacheDtype::bf16);
        append_packet_planes(rope, disk, reader.read_without_tensors(packet.id), reader,
                             CacheDtype::bf16);
    }
    REQUIRE(disk.length() == 16384 + 137);
    CHECK(torch::equal(disk.positions(), memory.positions()));
    for (int64_t layer = 0; layer < info.num_layers; ++layer) {
        CHECK(torch::equal(disk.keys(layer), memory.keys(layer)));
        CHECK(torch::equal(disk.values(layer), memory.values(layer)));
    }
}

TEST_CASE("packets read straight into a cache's rows hold what append_packet puts there",
          "[packets]") {
    // Several packets one after another, into a cache that already holds a token and must
    // grow for them: the rows, positions and logical length are append_packet's, bit for bit,
    // whether the keys were turned (every packet after the first) or not.
    torch::NoGradGuard no_grad;
    test::TempDir dir;
    for (const CacheDtype dtype : {CacheDtype::bf16, CacheDtype::f32}) {
        CAPTURE(cache_dtype_name(dtype));
        CacheModelInfo info = test::test_model(dtype);
        info.rope_scaling = rope_scaling_to_json({RopeScalingType::llama3, 8.0, 1.0, 4.0, 64});
        const RopeSettings settings = rope_settings(info);
        const Rope rope(settings.layout, settings.inverse_frequencies);
        const torch::ScalarType scalar =
            dtype == CacheDtype::bf16 ? torch::kBFloat16 : torch::kFloat32;
        torch::manual_seed(5);
        std::vector<Packet> packets = {test::make_packet(info, "a", 300, 1),
                                       test::make_packet(info, "b", 37, 2),
                                       test::make_packet(info, "c", 1000, 3)};
        for (Packet& packet : packets)  // plain numbers: make_packet's bytes are arbitrary bits
            for (auto* tensor : {&packet.keys, &packet.values}) {
                const torch::Tensor values =
                    torch::randn({static_cast<int64_t>(tensor->size() / cache_dtype_size(dtype))})
                        .to(scalar);
                const auto* bytes = static_cast<const std::byte*>(values.data_ptr());
                *tensor = std::vector<std::byte>(bytes, bytes + values.nbytes());
            }
        packets[1].logical_length = 50;  // a compressed packet keeps its gap
        // The keys turn chunk by chunk as they land: whole planes in one chunk, chunks of 64
        // tokens (the last of a plane shorter), compressed or not.
        for (const auto& [chunk_tokens, zstd_level] :
             {std::pair<int64_t, int>{0, 3}, {64, 3}, {64, 0}}) {
            CAPTURE(chunk_tokens, zstd_level);
            CacheWriteOptions options;
            options.chunk_tokens = chunk_tokens;
            options.zstd_level = zstd_level;
            const auto path = dir.path() / (std::string(cache_dtype_name(dtype)) + ".kvc");
            std::filesystem::remove(path);
            test::write_store(path, info, packets, options);
            const CacheReader reader(path);
            KvCache copied(info.num_layers, info.num_kv_heads, info.head_dim, scalar, torch::kCPU,
                           16);
            KvCache in_place(info.num_layers, info.num_kv_heads, info.head_dim, scalar, torch::kCPU,
                             16);
            for (KvCache* cache : {&copied, &in_place}) {  // one token held before the packets
                const torch::Tensor row =
                    torch::ones({info.num_kv_heads, 1, info.head_dim}, scalar);
                std::vector<torch::Tensor> keys(static_cast<std::size_t>(info.num_layers), row);
                cache->append(keys, keys, torch::zeros({1}, torch::kInt64));
            }
            for (const PacketInfo& packet : reader.packets()) {
                append_packet(rope, copied, reader.read(packet.id), dtype);
                REQUIRE(can_read_into_cache(reader, packet.id, in_place));
                const int64_t length = in_place.length();
                const int64_t turned_by = in_place.next_position();
                const Packet read = read_packet_into_cache(rope, reader, packet.id, in_place);
                CHECK(in_place.length() == length);  // not part of it yet
                CHECK(read.keys.empty());
                append_packet_in_place(in_place, read, turned_by);
            }
            CHECK(in_place.length() == copied.length());
            CHECK(in_place.next_position() == copied.next_position());
            CHECK(torch::equal(in_place.positions(), copied.positions()));
            for (int64_t layer = 0; layer < info.num_layers; ++layer) {
                CHECK(torch::equal(in_place.keys(layer), copied.keys(layer)));
                CHECK(torch::equal(in_place.values(layer), copied.values(layer)));
            }
            // A cache of another dtype converts, so it takes the copying path.
            const KvCache other(info.num_layers, info.num_kv_heads, info.head_dim,
                                dtype == CacheDtype::bf16 ? torch::kFloat32 : torch::kBFloat16,
                                torch::kCPU);
            CHECK_FALSE(can_read_into_cache(reader, "a", other));
            // Appended at another position than the keys were turned for: refused.
            KvCache moved(info.num_layers, info.num_kv_heads, info.head_dim, scalar, torch::kCPU,
                          16);
            const Packet read = read_packet_into_cache(rope, reader, "b", moved);
            CHECK_THROWS_AS(append_packet_in_place(moved, read, 3), Error);
        }
    }
}
